"""`batchllm export --format openai`: a job's rows as OpenAI batch output and error files, checked
against the `openai` package's own response types (vLLM's BatchRequestOutput: in the engine
suite, tests/engine/test_openai_export_vllm.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchllm.errors import JobStateError
from batchllm.output.openai_files import ERRORS_NAME, OUTPUT_NAME, export_openai
from batchllm.store import service
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus
from tests.support.cli import invoke
from tests.support.fake_runs import small_commits
from tests.support.openai_export_jobs import (
    EXPECTED,
    create,
    embedding_job,
    end,
    export_every_form,
)
from tests.support.output_rows import OutputRow

openai_types = pytest.importorskip("openai.types")
from openai.types import Completion, CreateEmbeddingResponse  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402
from openai.types.shared import ErrorObject  # noqa: E402


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(text) for text in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture
def exported(small_commits, tmp_path) -> tuple[Job, Path]:
    return export_every_form(small_commits, tmp_path)


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
def test_exporting_again_gives_the_same_bytes_and_needs_overwrite(exported, small_commits):
    job, out = exported
    first = (out / OUTPUT_NAME).read_bytes(), (out / ERRORS_NAME).read_bytes()

    with pytest.raises(FileExistsError):
        export_openai(job, out, settings=small_commits)
    export_openai(job, out, settings=small_commits, overwrite=True)

    assert ((out / OUTPUT_NAME).read_bytes(), (out / ERRORS_NAME).read_bytes()) == first
    assert sorted(p.name for p in out.iterdir()) == [ERRORS_NAME, OUTPUT_NAME]  # no temp files


# -- jobs built by hand: embeddings, a cancelled job, a running one ---------------------------


def test_an_embedding_job_exports_openai_embedding_lists(settings, tmp_path):
    counts = export_openai(embedding_job(settings, tmp_path), tmp_path / "out", settings=settings)

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


def test_a_cancelled_job_exports_its_rows_and_the_lines_never_run_as_cancelled_errors(
    settings, tmp_path
):
    job_id = create(settings, tmp_path, [{"prompt": f"p{i}"} for i in range(5)])
    answer = OutputRow("line-2", 2, "ok", "two", "stop", 2, 1, adapter="my-lora")
    job = end(
        settings,
        job_id,
        JobStatus.CANCELLED,
        # The second part repeats line 2: left by a worker that died before its commit.
        [[answer, OutputRow("line-4", 4, "ok", "four", "length", 2, 1)], [answer]],
    )

    counts = export_openai(job, tmp_path / "out", settings=settings)

    assert (counts.output, counts.errors, counts.not_run) == (2, 3, 3)
    lines = read_jsonl(counts.output_path)
    assert [x["custom_id"] for x in lines] == ["line-2", "line-4"]
    errors = read_jsonl(counts.errors_path)
    assert [x["custom_id"] for x in errors] == ["line-1", "line-3", "line-5"]
    assert {x["error"]["code"] for x in errors} == {"cancelled"}
    assert all(x["response"] is None for x in errors)
    assert lines[0]["response"]["body"]["model"] == "my-lora"  # the adapter, as vLLM answers
    assert lines[1]["response"]["body"]["created"] == int(job.finished_at.timestamp())


def test_an_expired_job_lists_the_lines_it_never_ran_as_batch_expired_errors(settings, tmp_path):
    job_id = create(settings, tmp_path, [{"prompt": f"p{i}"} for i in range(4)])
    job = end(
        settings, job_id, JobStatus.EXPIRED, [[OutputRow("line-3", 3, "ok", "three", "stop", 2, 1)]]
    )

    counts = export_openai(job, tmp_path / "out", settings=settings)

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
        export_openai(service_job(settings, job_id), tmp_path / "out", settings=settings)
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
