"""The OpenAI export's files (tests/unit/test_openai_export.py) checked against vLLM's own
BatchRequestOutput: a line vLLM's batch runner would write must read back as one. Here, not in
the unit suite, because importing vLLM (and torch) takes most of a minute; the engine suite's
process has imported it already."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchllm.output.openai_files import ERRORS_NAME, OUTPUT_NAME, export_openai
from tests.support.fake_runs import small_commits
from tests.support.openai_export_jobs import EXPECTED, embedding_job, export_every_form


def vllm_check(*paths: Path) -> dict[str, dict]:
    """Each line of the files read by vLLM's BatchRequestOutput (and its CompletionResponse):
    custom_id -> what parsed ("whole"), whether the envelope did, the completion body's type."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.run_batch import BatchRequestOutput
    from vllm.entrypoints.openai.completion.protocol import CompletionResponse

    results: dict[str, dict] = {}
    for path in paths:
        for text in path.read_text(encoding="utf-8").splitlines():
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
    return results


def test_every_line_validates_against_vllms_batch_request_output(small_commits, tmp_path):
    _, out = export_every_form(small_commits, tmp_path)
    embedded = export_openai(
        embedding_job(small_commits, tmp_path), tmp_path / "embeddings", settings=small_commits
    )
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
