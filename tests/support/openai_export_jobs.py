"""Finished jobs for the tests of the OpenAI export (`batchllm export --format openai`): a job of
every line form run on the fake engine, with samples and log probabilities, and an embedding
job written by hand. The unit tests check the files against the `openai` package's types, the
engine suite against vLLM's own BatchRequestOutput (importing vLLM takes most of a minute)."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import update

from batchllm.engine.protocol import Finished
from batchllm.jobs.create import create_job
from batchllm.jobs.local import run_job
from batchllm.output.openai_files import ERRORS_NAME, OUTPUT_NAME, export_openai
from batchllm.output.parts import part_name
from batchllm.settings import Settings
from batchllm.spec import EngineOptions, JobSpec
from batchllm.storage import Storage
from batchllm.store import service
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus, utcnow
from tests.support.fake_runs import MAX_MODEL_LEN, FakeEngine, FakeEngines, make_spec
from tests.support.inputs import source_of
from tests.support.output_rows import OutputRow, write_part


class LogprobEngine(FakeEngine):
    """The fake engine, also answering `n` samples and per-token log probabilities: one token
    per word of the answer, the word itself the likeliest alternative, the last one masked
    (-inf, as vLLM reports a token a constraint ruled out)."""

    def __init__(self) -> None:
        super().__init__()
        self.params: dict[str, dict] = {}

    def add(self, request_id, token_ids, params, adapter=None) -> None:
        super().add(request_id, token_ids, params, adapter)
        self.params[request_id] = params

    def step(self) -> list[Finished]:
        done = super().step()
        for out in done:
            params = self.params.pop(out.request_id)
            top_k, n = params.get("logprobs"), params.get("n") or 1
            samples = [
                {
                    "index": i,
                    "text": out.text + (f" wörld{i}" if i else " wörld"),
                    "finish_reason": "length",
                    "completion_tokens": out.completion_tokens,
                    "logprobs": None,
                }
                for i in range(n)
            ]
            if top_k is not None:
                for sample in samples:
                    sample["logprobs"] = [
                        {
                            "token": " " + word,
                            "logprob": -0.5 * (j + 1),
                            "top_logprobs": [
                                {"token": " " + word, "logprob": -0.5 * (j + 1)},
                                {"token": " alt", "logprob": float("-inf")},
                            ][:top_k],
                        }
                        for j, word in enumerate(sample["text"].split())
                    ]
            out.text, out.logprobs = samples[0]["text"], samples[0]["logprobs"]
            out.choices = samples if n > 1 else None
        return done


def chat_body(**extra: Any) -> dict:
    return {"messages": [{"role": "user", "content": "hello there"}], **extra}


# (custom_id, line) in file order; the kind each exports as is in EXPECTED below.
LINES: list[dict | str] = [
    {"custom_id": "oa-chat", "method": "POST", "url": "/v1/chat/completions", "body": chat_body()},
    {
        "custom_id": "oa-cmpl",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": "once upon a time", "max_tokens": 3},
    },
    {"custom_id": "plain-prompt", "prompt": "a plain prompt"},
    {"custom_id": "plain-chat", "messages": [{"role": "user", "content": "hi"}]},
    {
        "custom_id": "bad-max-tokens",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": chat_body(max_tokens=0),
    },
    {"custom_id": "bad-role", "messages": [{"role": "robot", "content": "beep"}]},
    {"custom_id": "chat-n2", "messages": [{"role": "user", "content": "two please"}], "n": 2},
    {"custom_id": "cmpl-n2-lp", "prompt": "two with logprobs", "n": 2, "logprobs": 2},
    {
        "custom_id": "oa-chat-lp",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": chat_body(logprobs=True, top_logprobs=2),
    },
    {"custom_id": "cmpl-lp0", "prompt": "logprobs without alternatives", "logprobs": 0},
    {"custom_id": "too-long", "prompt": " ".join(["long"] * (MAX_MODEL_LEN + 3))},
    "{broken json",
    {"custom_id": "typo", "prompt": "x", "temprature": 0.5},
    {"custom_id": "plain-prompt-2", "prompt": "another plain prompt"},
    {"custom_id": "plain-chat-2", "messages": [{"role": "user", "content": "again"}]},
]
# custom_id -> the file it lands in and its response object (or error param and code)
EXPECTED = {
    "oa-chat": ("output", "chat.completion"),
    "oa-cmpl": ("output", "text_completion"),
    "plain-prompt": ("output", "text_completion"),
    "plain-chat": ("output", "chat.completion"),
    "bad-max-tokens": ("errors", ("max_tokens", "invalid_value")),
    "bad-role": ("errors", ("messages.0.role", "invalid_value")),
    "chat-n2": ("output", "chat.completion"),
    "cmpl-n2-lp": ("output", "text_completion"),
    "oa-chat-lp": ("output", "chat.completion"),
    "cmpl-lp0": ("output", "text_completion"),
    "too-long": ("errors", "context_length_exceeded"),
    "line-12": ("errors", (None, "invalid_json")),
    "typo": ("errors", ("temprature", "unknown_parameter")),
    "plain-prompt-2": ("output", "text_completion"),
    "plain-chat-2": ("output", "chat.completion"),
}


def export_every_form(settings: Settings, tmp_path: Path) -> tuple[Job, Path]:
    """A job of every line form (LINES) run on the fake engine over two shards (12 rows each,
    with small_commits' settings), its part files committed out of line order (the runner
    groups prompts), exported."""
    source = tmp_path / "in.jsonl"
    source.write_text(
        "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in LINES),
        encoding="utf-8",
    )
    job = run_job(
        source_of(source, settings),
        make_spec(),
        settings=settings,
        engines=FakeEngines(LogprobEngine()),
    )
    assert job.status is JobStatus.COMPLETED
    out = tmp_path / "export"
    counts = export_openai(job, out, settings=settings)
    assert (counts.output, counts.errors, counts.not_run) == (10, 5, 0)
    assert (counts.output_path, counts.errors_path) == (out / OUTPUT_NAME, out / ERRORS_NAME)
    return job, out


def create(settings, tmp_path: Path, lines: list[dict], spec: JobSpec | None = None) -> str:
    source = tmp_path / "hand.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in lines))
    created = create_job(
        source_of(source, settings), spec or make_spec(), shard_size=10, settings=settings
    )
    return created.job.id


def end(settings, job_id: str, status: JobStatus, rows: list[list[OutputRow]]) -> Job:
    """Write each list of rows as one part file of shard 0 and end the job in `status`."""
    storage = Storage.of(settings)
    for seq, part in enumerate(rows):
        write_part(storage, storage.output_dir(job_id), part_name(0, seq, 1), part)
    with session_scope(settings) as session:
        session.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(status=status, finished_at=utcnow() + timedelta(seconds=5))
        )
        return session.get(Job, job_id)


def embedding_job(settings, tmp_path: Path) -> Job:
    """A finished embedding job of two lines: one text, a list of two."""
    spec = JobSpec(model="/models/embedder", engine=EngineOptions(task="embed"))
    job_id = create(settings, tmp_path, [{"input": "one"}, {"input": ["two", "three"]}], spec)
    return end(
        settings,
        job_id,
        JobStatus.COMPLETED,
        [
            [
                OutputRow("line-2", 2, "ok", prompt_tokens=4, embeddings=[[0.5, 0.25], [1.0, 0]]),
                OutputRow("line-1", 1, "ok", prompt_tokens=2, embedding=[0.125, -1.0]),
            ]
        ],
    )
