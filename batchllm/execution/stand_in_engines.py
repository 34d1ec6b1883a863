"""Engines that stand in for vLLM: the instant worker, the bench and the tests run jobs on them.

They live here, not in engine/, because engine/ is the vLLM adapter and nothing else; they sit
in execution/ (the first layer above engine/, whose Engine Protocol, prompt preparation and
sampling settings they reuse) beside instant.py, the instant worker built on InstantEngine.
They ship in the package, not in tests/support/, because `worker --engine instant`, the kept
engine and `batchllm bench` run InstantEngine, and FakeEngine beside it is checked against the
same Protocol by mypy.

- `FakeEngine`: deterministic and scriptable, for tests of the runner: a word tokenizer, a
  fixed number of steps per request, an echo of the prompt, a hook between steps, and a
  prefix cache (a request's cached tokens: the longest prefix it shares with an earlier one).
  For an embed job it answers bag-of-words vectors (texts sharing words are close), for a
  classify job FAKE_LABELS probabilities from the words' ids.
- `InstantEngine`: the bench's (bench/parts/overhead.py): the model's real tokenizer and chat
  template and VllmEngine's own sampling settings, but generation answers at once, so a job
  costs only batchllm's own work.

Both satisfy the Engine Protocol (engine/protocol.py; mypy checks it below); each comes with
an EngineSource that hands it to `run_job`.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

from batchllm.engine.prompts import Prepared, prepare_prompts
from batchllm.engine.protocol import Adapter, Engine, EngineSource, Finished
from batchllm.engine.vllm_engine import sampling_values
from batchllm.input.formats.rows import InputRow
from batchllm.input.formats.scoring import ScoreShape
from batchllm.spec import JobSpec

FAKE_MAX_MODEL_LEN = 24
FAKE_DIMENSIONS = 16
FAKE_LABELS = ("even", "odd")  # a fake classifier's classes: the parity of most word ids


class WordTokenizer:
    """Tokenizes by splitting on whitespace; a plain prompt gets a BOS token like Llama's."""

    BOS = 1

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.words: dict[int, str] = {}

    def _id(self, word: str) -> int:
        if word not in self.vocab:
            self.vocab[word] = len(self.vocab) + 10
            self.words[self.vocab[word]] = word
        return self.vocab[word]

    def __call__(self, texts: list[str], add_special_tokens: bool) -> dict[str, list[list[int]]]:
        prefix = [self.BOS] if add_special_tokens else []
        return {"input_ids": [prefix + [self._id(w) for w in t.split()] for t in texts]}

    def apply_chat_template(
        self, messages: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool
    ) -> str:
        assert tokenize is False and add_generation_prompt is True
        return "<s> " + " ".join(f"{m['role']}: {m['content']}" for m in messages) + " assistant:"

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words.get(i, "<s>") for i in ids)


class FakeEngine:
    """Runs at most `max_num_seqs` requests at a time; each finishes after `steps` steps with
    `max_tokens` completion tokens and echoes the last words of its prompt.
    `on_step(step_number)` lets a test act between steps."""

    version = "fake-1.0"
    hardware = "fake CPU (2 cores)"

    def __init__(
        self,
        *,
        steps: int = 2,
        max_num_seqs: int = 4,
        max_model_len: int = FAKE_MAX_MODEL_LEN,
        on_step: Callable[[int], None] | None = None,
    ) -> None:
        self.tokenizer = WordTokenizer()
        self.steps, self.max_num_seqs, self.max_model_len = steps, max_num_seqs, max_model_len
        self.on_step = on_step or (lambda n: None)
        self.waiting: collections.OrderedDict[str, list[Any]] = collections.OrderedDict()
        self.running: dict[str, list[Any]] = {}
        self.prompts_added: list[str] = []
        self.seen_prompts: list[list[int]] = []  # the prefix cache: every prompt added
        self.aborted: list[str] = []
        self.step_count = 0
        self.task = "generate"  # the job's (FakeEngines.get sets it)

    def prepare(self, rows: list[InputRow], chat_template: str | None = None) -> list[Prepared]:
        prepared = prepare_prompts(self.tokenizer, rows, self.max_model_len)
        if self.task == "classify":  # a cross-encoder: one prompt per (query, document) pair
            return [
                _pairs(row, ids) if row.kind == "score" and isinstance(ids, list) else ids
                for row, ids in zip(rows, prepared, strict=True)
            ]
        return prepared

    def sampling_params(self, merged: dict[str, Any]) -> dict[str, Any]:
        return dict(merged)

    def add(
        self, request_id: str, token_ids: Any, params: Any, adapter: Adapter | None = None
    ) -> None:
        texts = token_ids if token_ids and isinstance(token_ids[0], list) else [token_ids]
        self.prompts_added.extend(self.tokenizer.decode(ids) for ids in texts)
        cached = max((_shared_prefix(token_ids, seen) for seen in self.seen_prompts), default=0)
        self.seen_prompts.append(list(token_ids))
        self.waiting[request_id] = [token_ids, params, self.steps, cached]

    def step(self) -> list[Finished]:
        self.step_count += 1
        self.on_step(self.step_count)
        while self.waiting and len(self.running) < self.max_num_seqs:
            request_id, state = self.waiting.popitem(last=False)
            self.running[request_id] = state
        done = []
        for request_id, state in list(self.running.items()):
            state[2] -= 1
            if state[2] == 0:
                ids, params, _, cached = self.running.pop(request_id)
                if self.task != "generate":
                    done.append(self._pooled(request_id, ids))
                    continue
                echo = " ".join(self.tokenizer.decode(ids).split()[-2:])
                done.append(
                    Finished(
                        request_id=request_id,
                        text=f"echo {echo}",
                        finish_reason="length",
                        prompt_tokens=len(ids),
                        completion_tokens=params["max_tokens"],
                        cached_tokens=cached,
                    )
                )
        return done

    def _pooled(self, request_id: str, ids: Any) -> Finished:
        if self.task == "classify" and ids and isinstance(ids[0], list):
            # a score row's pairs, as a cross-encoder scores them: its share of distinct words
            tokens = sum(len(i) for i in ids)
            scores = [len(set(i)) / max(len(i), 1) for i in ids]
            return Finished(request_id, "", "stop", tokens, 0, scores=scores)
        if self.task == "classify":
            odd = sum(i % 2 for i in ids)
            probs = [(len(ids) - odd + 1) / (len(ids) + 2), (odd + 1) / (len(ids) + 2)]
            label = FAKE_LABELS[probs[1] > probs[0]]
            return Finished(request_id, "", "stop", len(ids), 0, probs=probs, label=label)
        if ids and isinstance(ids[0], list):
            tokens = sum(len(i) for i in ids)
            vectors = [_bag_of_words(i) for i in ids]
            return Finished(request_id, "", "stop", tokens, 0, embeddings=vectors)
        return Finished(request_id, "", "stop", len(ids), 0, embedding=_bag_of_words(ids))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)
        for request_id in request_ids:
            self.waiting.pop(request_id, None)
            self.running.pop(request_id, None)

    def shutdown(self) -> None:
        pass


def _pairs(row: InputRow, texts: list[Any]) -> list[list[int]]:
    """A score row's (query, document) pairs as one prompt each, the document's BOS dropped."""
    shape = ScoreShape.of(row.overrides())
    queries, documents = texts[: shape.queries], texts[shape.queries :]
    if len(queries) == 1:
        queries = queries * len(documents)
    return [query + document[1:] for query, document in zip(queries, documents, strict=True)]


def _bag_of_words(ids: list[int]) -> list[float]:
    """Word counts folded into FAKE_DIMENSIONS (the BOS token left out)."""
    vector = [0.0] * FAKE_DIMENSIONS
    for i in ids:
        if i != WordTokenizer.BOS:
            vector[i % FAKE_DIMENSIONS] += 1.0
    return vector


def _shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    shared = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        shared += 1
    return shared


class FakeEngines:
    """Stands in for EngineCache: hands run_job the one fake engine."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine: FakeEngine | None = engine

    def get(self, spec: JobSpec, max_model_len: int) -> FakeEngine:
        assert self.engine is not None
        self.engine.max_model_len = max_model_len
        self.engine.task = spec.engine.task
        return self.engine

    def close(self) -> None:
        pass


_FILLER = (
    "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "
    "incididunt ut labore et dolore magna aliqua "
) * 64
_CHARS_PER_TOKEN = 4


def instant_text(max_tokens: int) -> str:
    """What the instant engine answers a request of `max_tokens`: a check of its rows (the
    third-party clients' suite, tests/clients) compares the text it got with this."""
    return _FILLER[: max_tokens * _CHARS_PER_TOKEN]


class _Params:
    """Stands in for vllm.SamplingParams: keeps the settings, checks nothing."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)


class InstantEngine:
    """An Engine whose generation answers at once: every request finishes at its max_tokens in
    the step after it was added. Preparation is the real one (the model's tokenizer and chat
    template, vllm_engine's sampling settings).

    `step_seconds` > 0 paces it instead: each step takes that long and gives every running
    request (at most `max_num_seqs`) one token, so a request finishes after max_tokens steps.
    A job then takes a time set by the clock, not by the machine: long enough for a test to
    cancel it, expire it or kill its worker part-way, on any machine.

    `token_seconds` > 0 gives it a token cost instead: a step takes that long for each prompt
    and output token of the requests it finishes, so engine time follows tokens served, as
    a real engine's does (a fleet simulation of fair share in tokens)."""

    version = "instant"
    hardware = "none (instant engine)"

    def __init__(
        self,
        *,
        tokenizer: Any,
        max_model_len: int,
        max_num_seqs: int = 256,
        step_seconds: float = 0.0,
        token_seconds: float = 0.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.step_seconds = step_seconds
        self.token_seconds = token_seconds
        self._queue: collections.deque[tuple[str, int, int]] = collections.deque()
        # request id -> [prompt tokens, max tokens, tokens generated]: paced requests only
        self._running: dict[str, list[int]] = {}
        self.prepare_seconds = 0.0  # tokenization, which vLLM does for text prompts too

    def prepare(self, rows: list[InputRow], chat_template: str | None = None) -> list[Prepared]:
        started = time.perf_counter()
        try:
            return prepare_prompts(self.tokenizer, rows, self.max_model_len, chat_template)
        finally:
            self.prepare_seconds += time.perf_counter() - started

    def sampling_params(self, merged: dict[str, Any]) -> _Params:
        return _Params(**sampling_values(merged))

    def add(self, request_id: str, token_ids: Any, params: Any, adapter: Any = None) -> None:
        self._queue.append((request_id, len(token_ids), params.max_tokens))

    def step(self) -> list[Finished]:
        if self.step_seconds > 0:
            return self._paced_step()
        done = []
        for _ in range(min(self.max_num_seqs, len(self._queue))):
            request_id, prompt_tokens, max_tokens = self._queue.popleft()
            done.append(_finished(request_id, prompt_tokens, max_tokens))
        if self.token_seconds > 0:
            served = sum(f.prompt_tokens + f.completion_tokens for f in done)
            time.sleep(served * self.token_seconds)
        return done

    def _paced_step(self) -> list[Finished]:
        time.sleep(self.step_seconds)
        while self._queue and len(self._running) < self.max_num_seqs:
            request_id, prompt_tokens, max_tokens = self._queue.popleft()
            self._running[request_id] = [prompt_tokens, max_tokens, 0]
        done = []
        for request_id, state in list(self._running.items()):
            state[2] += 1
            if state[2] >= state[1]:
                del self._running[request_id]
                done.append(_finished(request_id, state[0], state[1]))
        return done

    def has_unfinished(self) -> bool:
        return bool(self._queue or self._running)

    def abort(self, request_ids: list[str]) -> None:
        gone = set(request_ids)
        self._queue = collections.deque(q for q in self._queue if q[0] not in gone)
        for request_id in gone:
            self._running.pop(request_id, None)

    def shutdown(self) -> None:
        pass


def _finished(request_id: str, prompt_tokens: int, max_tokens: int) -> Finished:
    return Finished(
        request_id=request_id,
        finish_reason="length",
        text=instant_text(max_tokens),
        prompt_tokens=prompt_tokens,
        completion_tokens=max_tokens,
    )


class InstantEngines:
    """An EngineSource that hands out instant engines and notes when the job asked for one."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.asked_at: float | None = None
        self.engine: InstantEngine | None = None

    def get(self, spec: JobSpec, max_model_len: int) -> InstantEngine:
        self.asked_at = time.perf_counter()
        self.engine = InstantEngine(tokenizer=self.tokenizer, max_model_len=max_model_len)
        return self.engine

    def close(self) -> None:
        pass


def _satisfy_the_protocols(
    fake: FakeEngine, instant: InstantEngine, fakes: FakeEngines, instants: InstantEngines
) -> tuple[Engine, Engine, EngineSource, EngineSource]:
    """mypy (`make lint`) checks here that these engines satisfy the Engine Protocols."""
    return fake, instant, fakes, instants
