"""Score and rerank rows (`/v1/score`, `/v1/rerank` lines): how a line becomes a stored row and
how the row's scores follow from its texts' embeddings.

They run in an embedding job (task embed), not in a task of their own: with an embedding model
(a bi-encoder) vLLM's `LLM.score` is the cosine of the two texts' embeddings (vLLM's
SCORE_TYPE_MAP: embed -> bi-encoder; scoring/io_processor.BiEncoderIOProcessor), so the engine
that embeds is the engine that scores: the same build (pooling runner, embed), the same fleet
queue, and a file may mix embeddings with score and rerank lines, as run-batch's may. The
row's texts, queries first, are embedded as a list embedding input is (one engine request per
text, gathered again); the scores are computed here from the vectors. The model decides the
task, as it does in vLLM: with a cross-encoder (a classifier with one label) the same lines run
in a classification job (task classify), which scores each pair in one pass
(engine/cross_encoder.py). Neither calls `LLM.score`: it runs its requests to the end in one
call, and a job's feed keeps the engine full across rows and commits rows as they finish.

A row stores its texts in `inputs` and its shape in its settings under "score": how many texts
are queries (1, or one per document), whether it is a rerank, its top_n.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from batchllm.input.formats.schemas import OpenAIRerankBody, OpenAIScoreBody, Request

SCORE_KEY = "score"  # the row settings' key of its shape


@dataclass(frozen=True, slots=True)
class ScoreShape:
    """A score row's shape: its first `queries` texts are queries (1: paired with every
    document; else one per document), the rest documents."""

    queries: int
    rerank: bool = False
    top_n: int | None = None  # a rerank's best documents to return (None: all)

    def settings(self) -> dict[str, Any]:
        shape: dict[str, Any] = {"queries": self.queries}
        if self.rerank:
            shape["rerank"] = True
        if self.top_n:
            shape["top_n"] = self.top_n
        return {SCORE_KEY: shape}

    @classmethod
    def of(cls, settings: Mapping[str, Any]) -> ScoreShape:
        shape = settings.get(SCORE_KEY) or {}
        return cls(int(shape.get("queries", 1)), bool(shape.get("rerank")), shape.get("top_n"))


def unpaired(body: OpenAIScoreBody) -> str | None:
    """Why a /v1/score body's texts do not pair (as vLLM's validate_score_input refuses
    them), or None."""
    queries, documents = body.text_1, body.text_2
    if len(queries) in (1, len(documents)):
        return None
    return (
        f"text_1 has {len(queries)} texts and text_2 {len(documents)}: give one text_1 or "
        "one per text_2"
    )


def score_request(line: int, custom_id: str, body: OpenAIScoreBody) -> Request:
    """The row of a validated /v1/score body (`unpaired` says None)."""
    queries, documents = body.text_1, body.text_2
    return Request(
        line=line,
        custom_id=custom_id,
        kind="score",
        inputs=queries + documents,
        sampling=ScoreShape(len(queries)).settings(),
    )


def rerank_request(line: int, custom_id: str, body: OpenAIRerankBody) -> Request:
    """The row of a validated /v1/rerank body: the query against each document."""
    return Request(
        line=line,
        custom_id=custom_id,
        kind="score",
        inputs=[body.query, *body.documents],
        sampling=ScoreShape(1, rerank=True, top_n=body.top_n).settings(),
    )


def pair_scores(shape: ScoreShape, vectors: Sequence[Sequence[float]]) -> list[float]:
    """One score per document: the cosine of its embedding and its query's, as vLLM's
    bi-encoder scores (its vectors come normalized from the embed pooler; the cosine does
    not rely on it)."""
    queries, documents = vectors[: shape.queries], vectors[shape.queries :]
    if len(queries) == 1:
        queries = list(queries) * len(documents)
    return [_cosine(q, d) for q, d in zip(queries, documents, strict=True)]


def _cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norms if norms else 0.0


def ranked(scores: Sequence[float], top_n: int | None) -> list[int]:
    """Document indexes, best score first (ties in document order), the first `top_n` when
    given (vLLM's rerank: top_n 0 returns all)."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return order[:top_n] if top_n else order
