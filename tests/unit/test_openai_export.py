"""`batchllm export --format openai`: a job's rows as OpenAI batch output and error files, checked
against the `openai` package's own response types and vLLM's BatchRequestOutput."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

from batchllm.engine.protocol import Finished
from batchllm.errors import JobStateError
from batchllm.input.schemas import EngineOptions, JobSpec
from batchllm.output.openai_files import ERRORS_NAME, OUTPUT_NAME, export_openai
from batchllm.output.parts import part_name
from batchllm.storage import Storage
from batchllm.store import service
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus, utcnow
from batchllm.worker.local import run_job
from tests.support.cli import invoke
from tests.support.fake_runs import (
    MAX_MODEL_LEN,
    FakeEngine,
    FakeEngines,
    make_spec,
    small_commits,
)
from tests.support.output_rows import OutputRow, write_part

openai_types = pytest.importorskip("openai.types")
from openai.types import Completion, CreateEmbeddingResponse  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402
from openai.types.shared import ErrorObject  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


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


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(text) for text in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture
def exported(small_commits, tmp_path) -> tuple[Job, Path]:
    """A job of every line form run on the fake engine over two shards (12 rows each), its
    part files committed out of line order (the runner groups prompts), exported."""
    source = tmp_path / "in.jsonl"
    source.write_text(
        "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in LINES),
        encoding="utf-8",
    )
    job = run_job(source, make_spec(), settings=small_commits, engines=FakeEngines(LogprobEngine()))
    assert job.status is JobStatus.COMPLETED
    out = tmp_path / "export"
    counts = export_openai(job, out)
    assert (counts.output, counts.errors, counts.not_run) == (10, 5, 0)
    assert (counts.output_path, counts.errors_path) == (out / OUTPUT_NAME, out / ERRORS_NAME)
    return job, out


def test_ok_rows_go_to_the_output_file_and_error_rows_to_the_error_file_in_line_order(exported):
    _, out = exported
    output, errors = read_jsonl(out / OUTPUT_NAME), read_jsonl(out / ERRORS_NAME)
    order = list(EXPECTED)
    assert [x["custom_id"] for x in output] == [c for c in order if EXPECTED[c][0] == "output"]
    assert [x["custom_id"] for x in errors] == [c for c in order if EXPECTED[c][0] == "errors"]
    assert all(x["error"] is None and x["response"]["status_code"] == 200 for x in output)
    ids = [x["id"] for x in output + errors]
    assert all(i.startswith("batch_req_") for i in ids) and len(set(ids)) == len(ids)


def test_every_output_body_is_an_openai_completion_of_its_line_form(exported):
    job, out = exported
    for line in read_jsonl(out / OUTPUT_NAME):
        body = line["response"]["body"]
        kind = EXPECTED[line["custom_id"]][1]
        parsed = (ChatCompletion if kind == "chat.completion" else Completion).model_validate(body)
        assert parsed.object == kind
        assert parsed.id.startswith("chatcmpl-" if kind == "chat.completion" else "cmpl-")
        assert parsed.model == job.model
        assert line["response"]["request_id"].startswith("req_")
        usage = parsed.usage
        assert usage is not None and usage.prompt_tokens > 0
        assert usage.completion_tokens == sum(
            (5 if line["custom_id"] != "oa-cmpl" else 3) for _ in parsed.choices
        )
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert [c.index for c in parsed.choices] == list(range(len(parsed.choices)))


def test_n_samples_and_log_probabilities_in_the_chat_and_completions_forms(exported):
    _, out = exported
    bodies = {x["custom_id"]: x["response"]["body"] for x in read_jsonl(out / OUTPUT_NAME)}

    two = ChatCompletion.model_validate(bodies["chat-n2"])
    assert [c.message.content.split()[-1] for c in two.choices] == ["wörld", "wörld1"]
    assert all(c.message.role == "assistant" and c.logprobs is None for c in two.choices)

    chat = ChatCompletion.model_validate(bodies["oa-chat-lp"]).choices[0]
    assert chat.logprobs is not None and chat.logprobs.content is not None
    last = chat.logprobs.content[-1]
    assert last.token == " wörld" and last.bytes == list(" wörld".encode())
    assert [(t.token, t.logprob) for t in last.top_logprobs] == [
        (" wörld", last.logprob),
        (" alt", -9999.0),  # -inf is not JSON: OpenAI's "very unlikely"
    ]
    assert ChatCompletion.model_validate(bodies["oa-chat"]).choices[0].logprobs is None

    cmpl = Completion.model_validate(bodies["cmpl-n2-lp"])
    assert len(cmpl.choices) == 2
    for choice in cmpl.choices:
        lp = choice.logprobs
        assert lp is not None and lp.tokens and lp.text_offset and lp.top_logprobs
        assert "".join(lp.tokens) == " " + " ".join(choice.text.split())
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        assert lp.token_logprobs == [-0.5 * (i + 1) for i in range(len(lp.tokens))]
        assert lp.top_logprobs[0] == {lp.tokens[0]: -0.5, " alt": -9999.0}
    none_asked = Completion.model_validate(bodies["cmpl-lp0"]).choices[0].logprobs
    assert none_asked is not None and none_asked.top_logprobs == [{}] * len(none_asked.tokens or [])


def test_refused_lines_are_400s_naming_the_field_and_failed_requests_carry_an_error(exported):
    _, out = exported
    for line in read_jsonl(out / ERRORS_NAME):
        expected = EXPECTED[line["custom_id"]][1]
        if isinstance(expected, tuple):  # refused at validation
            assert line["error"] is None
            assert line["response"]["status_code"] == 400
            error = ErrorObject.model_validate(line["response"]["body"]["error"])
            assert (error.param, error.code, error.type) == (*expected, "invalid_request_error")
            assert error.message and not error.message.startswith("field '")
        else:  # ran, and the engine could not answer it
            assert line["response"] is None
            assert line["error"]["code"] == expected
            assert "max_model_len is 24" in line["error"]["message"]


# vLLM's models in a child process: its import takes seconds and configures logging and
# torch for the whole process, which the other tests in this one must not inherit.
_VLLM_CHECK = """
import json, sys
from vllm.entrypoints.launchers.run_batch import BatchRequestOutput
from vllm.entrypoints.openai.completion.protocol import CompletionResponse
results = {}
for path in sys.argv[1:]:
    for text in open(path, encoding="utf-8"):
        line = json.loads(text)
        result = results[line["custom_id"]] = {}
        try:
            parsed = BatchRequestOutput.model_validate(line)
            result["whole"] = type(parsed.response and parsed.response.body).__name__
        except Exception as exc:
            result["whole"] = "refused: " + str(exc).splitlines()[0]
        body = (line["response"] or {}).get("body")
        if line["response"] is not None:
            envelope = dict(line, response=dict(line["response"], body=None))
            result["envelope"] = BatchRequestOutput.model_validate(envelope).id == line["id"]
        if isinstance(body, dict) and body.get("object") == "text_completion":
            result["completion"] = CompletionResponse.model_validate(body).object
print(json.dumps(results))
"""


def vllm_check(*paths: Path) -> dict[str, dict]:
    pytest.importorskip("vllm")
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_LOGGING_LEVEL": "ERROR"}
    done = subprocess.run(
        [sys.executable, "-c", _VLLM_CHECK, *map(str, paths)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_every_line_validates_against_vllms_batch_request_output(exported, small_commits, tmp_path):
    _, out = exported
    embedded = export_openai(embedding_job(small_commits, tmp_path), tmp_path / "embeddings")
    # One child process for every file: vLLM's import is most of the test's time.
    results = vllm_check(out / OUTPUT_NAME, out / ERRORS_NAME, embedded.output_path)

    assert set(results) == set(EXPECTED) | {"line-1", "line-2"}
    for custom_id, result in results.items():
        kind = EXPECTED.get(custom_id, ("output", "embedding"))[1]
        if kind == "chat.completion":
            assert result["whole"] == "ChatCompletionResponse", custom_id
        elif kind == "embedding":
            assert result["whole"] == "EmbeddingResponse", custom_id
        elif kind == "context_length_exceeded":
            assert result["whole"] == "NoneType", custom_id  # response null, error set
        else:
            # vLLM 0.32's batch runner serves no /v1/completions (its response union lacks
            # CompletionResponse) and puts a 400's error beside the response, not in the body
            # as OpenAI does: the envelope is checked with the body apart, a text completion
            # body against vLLM's own CompletionResponse.
            assert result["envelope"] is True, (custom_id, result)
            if kind == "text_completion":
                assert result["completion"] == "text_completion", custom_id


def test_exporting_again_gives_the_same_bytes_and_needs_overwrite(exported):
    job, out = exported
    first = (out / OUTPUT_NAME).read_bytes(), (out / ERRORS_NAME).read_bytes()

    with pytest.raises(FileExistsError):
        export_openai(job, out)
    export_openai(job, out, overwrite=True)

    assert ((out / OUTPUT_NAME).read_bytes(), (out / ERRORS_NAME).read_bytes()) == first
    assert sorted(p.name for p in out.iterdir()) == [ERRORS_NAME, OUTPUT_NAME]  # no temp files


# -- jobs built by hand: embeddings, a cancelled job, a running one ---------------------------


def create(settings, tmp_path: Path, lines: list[dict], spec: JobSpec | None = None) -> str:
    source = tmp_path / "hand.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in lines))
    created = service.create_job(source, spec or make_spec(), shard_size=10, settings=settings)
    return created.job.id


def end(settings, job_id: str, status: JobStatus, rows: list[list[OutputRow]]) -> Job:
    """Write each list of rows as one part file of shard 0 and end the job in `status`."""
    storage = Storage(settings.resolved_storage)
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


def test_an_embedding_job_exports_openai_embedding_lists(settings, tmp_path):
    counts = export_openai(embedding_job(settings, tmp_path), tmp_path / "out")

    assert (counts.output, counts.errors) == (2, 0)
    lines = read_jsonl(counts.output_path)
    bodies = [CreateEmbeddingResponse.model_validate(x["response"]["body"]) for x in lines]
    assert [[d.embedding for d in b.data] for b in bodies] == [
        [[0.125, -1.0]],
        [[0.5, 0.25], [1.0, 0.0]],
    ]
    assert [[d.index for d in b.data] for b in bodies] == [[0], [0, 1]]
    assert [(b.model, b.usage.prompt_tokens, b.usage.total_tokens) for b in bodies] == [
        ("/models/embedder", 2, 2),
        ("/models/embedder", 4, 4),
    ]


def test_a_cancelled_job_exports_the_rows_it_has_and_counts_the_lines_never_run(settings, tmp_path):
    job_id = create(settings, tmp_path, [{"prompt": f"p{i}"} for i in range(5)])
    answer = OutputRow("line-2", 2, "ok", "two", "stop", 2, 1, adapter="my-lora")
    job = end(
        settings,
        job_id,
        JobStatus.CANCELLED,
        # The second part repeats line 2: left by a worker that died before its commit.
        [[answer, OutputRow("line-4", 4, "ok", "four", "length", 2, 1)], [answer]],
    )

    counts = export_openai(job, tmp_path / "out")

    assert (counts.output, counts.errors, counts.not_run) == (2, 0, 3)
    lines = read_jsonl(counts.output_path)
    assert [x["custom_id"] for x in lines] == ["line-2", "line-4"]
    assert lines[0]["response"]["body"]["model"] == "my-lora"  # the adapter, as vLLM answers
    assert lines[1]["response"]["body"]["created"] == int(job.finished_at.timestamp())


def test_an_expired_job_lists_the_lines_it_never_ran_as_batch_expired_errors(settings, tmp_path):
    job_id = create(settings, tmp_path, [{"prompt": f"p{i}"} for i in range(4)])
    job = end(
        settings, job_id, JobStatus.EXPIRED, [[OutputRow("line-3", 3, "ok", "three", "stop", 2, 1)]]
    )

    counts = export_openai(job, tmp_path / "out")

    assert (counts.output, counts.errors, counts.not_run) == (1, 3, 3)
    assert [x["custom_id"] for x in read_jsonl(counts.output_path)] == ["line-3"]
    errors = read_jsonl(counts.errors_path)
    assert [x["custom_id"] for x in errors] == ["line-1", "line-2", "line-4"]
    assert {x["error"]["code"] for x in errors} == {"batch_expired"}
    assert all(x["response"] is None for x in errors)


def test_the_command_refuses_an_unfinished_job_and_existing_files(settings, tmp_path):
    job_id = create(settings, tmp_path, [{"prompt": "a"}])

    running = invoke("export", job_id, "-o", str(tmp_path / "out"))

    assert running.exit_code == 1
    assert running.output.strip().splitlines() == [
        f"error: job {job_id} is queued; only a finished job (completed, cancelled or failed) "
        "can be exported"
    ]
    with pytest.raises(JobStateError):
        export_openai(service_job(settings, job_id), tmp_path / "out")
    assert not (tmp_path / "out").exists()

    end(settings, job_id, JobStatus.COMPLETED, [[OutputRow("line-1", 1, "ok", "b", "stop", 1, 1)]])
    done = invoke("export", job_id[:8], "-o", str(tmp_path / "out"))
    again = invoke("export", job_id, "-o", str(tmp_path / "out"))
    forced = invoke("export", job_id, "-o", str(tmp_path / "out"), "--force")

    assert done.exit_code == 0, done.output
    assert done.output.splitlines() == [
        f"{tmp_path / 'out' / OUTPUT_NAME}  1 lines",
        f"{tmp_path / 'out' / ERRORS_NAME}  0 lines",
    ]
    assert again.exit_code == 1
    assert "output.jsonl exists; pass --force to replace it" in again.output
    assert forced.exit_code == 0, forced.output


def service_job(settings, job_id: str) -> Job:
    with session_scope(settings) as session:
        return service.get_job(session, job_id)
