"""Score rows on a classification engine: a cross-encoder scores each (query, document) pair
in one forward pass, and its one class's probability is the pair's score.

vLLM's `LLM.score` does this for a classifier with one label (SCORE_TYPE_MAP: classify ->
cross-encoder); but `LLM.score` drives the engine to the end itself, and the runner feeds the
engine continuously and commits rows as they finish. So a score row's pairs are rendered here
by vLLM's own cross-encoder processor (`LLM.pooling_io_processors["cross-encoder"]`: the
model's pair template or separator tokens, token type ids, truncation, exactly what `LLM.score`
renders) and run as one engine request per pair, gathered again like a list embedding input.
"""

from __future__ import annotations

import json
from typing import Any

from batchllm.engine.prompts import Prepared
from batchllm.input.formats.rows import InputRow
from batchllm.input.formats.scoring import ScoreShape
from batchllm.row_errors import INVALID_PROMPT, REQUEST_REJECTED, Refusal

_TYPES_KEY = "compressed_token_type_ids"  # vLLM's pooling params key of a pair's token types


class PairIds(list[int]):
    """A rendered pair's token ids, carrying its token types (vLLM's compressed form: where
    the document's tokens begin) to `add`, for models that have them (BERT-like)."""

    __slots__ = ("token_types",)

    def __init__(self, ids: list[int], token_types: Any) -> None:
        super().__init__(ids)
        self.token_types = token_types


class CrossEncoder:
    """A classification engine's scorer of score rows; `unable` says why a model cannot score
    (vLLM scores with a classifier of exactly one label)."""

    def __init__(self, llm: Any) -> None:
        self._io = llm.pooling_io_processors.get("cross-encoder")
        labels = getattr(llm.llm_engine.model_config.hf_config, "num_labels", 0)
        self.unable = (
            None
            if self._io is not None
            else f"scoring needs a cross-encoder, a classifier with one label; this model has "
            f"{labels}"
        )
        self._tok_params = llm.renderer.default_cmpl_tok_params if self._io is not None else None

    def prepare(self, rows: list[InputRow], prepared: list[Prepared]) -> list[Prepared]:
        """The rows' prepared ids with each score row's replaced by its pairs' ids."""
        from vllm.pooling_params import PoolingParams

        result = list(prepared)
        params = PoolingParams(task="classify")
        for i, row in enumerate(rows):
            if row.kind != "score" or row.error is not None:
                continue
            if self._io is None:
                result[i] = Refusal(str(self.unable), REQUEST_REJECTED)
                continue
            texts = json.loads(row.inputs or "[]")
            shape = ScoreShape.of(row.overrides())
            queries, documents = texts[: shape.queries], texts[shape.queries :]
            if len(queries) == 1:
                queries = queries * len(documents)
            pairs: list[list[int]] = []
            try:
                for query, document in zip(queries, documents, strict=True):
                    pairs.append(self._render(query, document, params))
            except Exception as exc:  # one row's texts, not the batch's
                result[i] = Refusal(
                    f"the pair could not be prepared: {type(exc).__name__}: {exc}", INVALID_PROMPT
                )
                continue
            result[i] = pairs
        return result

    def _render(self, query: str, document: str, params: Any) -> PairIds:
        assert self._io is not None
        rendered = self._io.render(
            {
                "data_1": query,
                "data_2": document,
                "chat_template": None,
                "max_tokens_per_query": 0,
                "max_tokens_per_doc": 0,
                "tok_params": self._tok_params,
                "prompt_extras": None,
                "skip_mm_cache": False,
                "params": params,
                "lora_requests": None,
                "priorities": 0,
            }
        )
        types = (rendered["params"].extra_kwargs or {}).get(_TYPES_KEY)
        return PairIds(rendered["prompts"]["prompt_token_ids"], types)

    @staticmethod
    def request(ids: Any, params: Any) -> tuple[list[int], Any]:
        """One pair's engine ids (a plain list, as vLLM sends it to its engine process) and
        pooling params: `params` with the pair's token types, if any."""
        types = getattr(ids, "token_types", None)
        if types is None:
            return list(ids), params
        own = params.clone()
        own.extra_kwargs = {**(own.extra_kwargs or {}), _TYPES_KEY: types}
        return list(ids), own
