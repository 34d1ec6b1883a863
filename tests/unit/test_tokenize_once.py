"""Tokenization runs once per prompt and renders chat templates a batch at a time, with the
model's real tokenizer: the ids must equal transformers' own rendering and encoding."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from batchllm.engine import chat_batch
from batchllm.engine.prompts import prepare_prompts
from batchllm.engine.sizing import load_tokenizer
from batchllm.execution.context.resolve import resolve_max_model_len
from batchllm.input.formats.rows import InputRow
from batchllm.input.shards import iter_shard_rows
from batchllm.input.token_store import token_path
from batchllm.jobs.create import create_job
from batchllm.settings import get_settings
from batchllm.spec import JobSpec, SamplingDefaults
from batchllm.storage import Storage
from batchllm.store import service
from batchllm.store.db import session_scope
from batchllm.store.models import Job
from tests.support.inputs import source_of

WORDS = ["alpha", "beta", "gamma", "ünïcode", "日本語", "tab\there", "new\nline", "{{ x }}", "%"]


def chat_row(line: int, content: str, sampling: dict | None = None) -> InputRow:
    messages = [{"role": "user", "content": content}]
    if line % 3 == 0:
        messages.insert(0, {"role": "system", "content": f"system {line}"})
    return InputRow(
        line=line,
        custom_id=f"c{line}",
        kind="chat",
        messages=json.dumps(messages),
        sampling=json.dumps(sampling) if sampling else None,
    )


def reference_ids(tokenizer, row: InputRow, chat_template: str | None = None) -> list[int]:
    text = tokenizer.apply_chat_template(
        row.chat_messages(), tokenize=False, add_generation_prompt=True, chat_template=chat_template
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def some_rows(count: int, seed: int = 0) -> list[InputRow]:
    rng = random.Random(seed)
    return [
        chat_row(i, " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30))))
        for i in range(1, count + 1)
    ]


def test_a_batch_of_chats_renders_and_encodes_exactly_as_transformers_does(tokenizer):
    rows = some_rows(300)
    prepared = prepare_prompts(tokenizer, rows, None)
    assert chat_batch._COMPILED, "the demo model's template should render in batches"
    assert all(v is not None for v in chat_batch._COMPILED.values())
    for row, ids in zip(rows, prepared, strict=True):
        assert ids == reference_ids(tokenizer, row), row.line


def test_rows_with_template_options_render_on_their_own_with_those_options(tokenizer):
    rows = some_rows(20)
    rows[5] = chat_row(6, "go on", {"add_generation_prompt": False})
    prepared = prepare_prompts(tokenizer, rows, None)
    plain = tokenizer.apply_chat_template(
        rows[5].chat_messages(), tokenize=False, add_generation_prompt=False
    )
    assert prepared[5] == list(tokenizer(plain, add_special_tokens=False)["input_ids"])
    assert prepared[5] != reference_ids(tokenizer, rows[5])  # the option did change it
    assert prepared[4] == reference_ids(tokenizer, rows[4])


def test_a_template_reading_outside_its_scope_falls_back_to_one_render_per_row(tokenizer):
    # `loop` at a template's top level is undefined in transformers' render; inside the batch
    # loop it would be the batch's: the first/last comparison must catch that.
    template = "{{ messages[-1]['content'] }}|{{ loop.index if loop is defined else 'none' }}"
    rows = some_rows(10, seed=1)
    prepared = prepare_prompts(tokenizer, rows, None, template)
    assert template in chat_batch._COMPILED and chat_batch._COMPILED[template] is None
    for row, ids in zip(rows, prepared, strict=True):
        assert ids == reference_ids(tokenizer, row, template)


def test_a_template_that_raises_on_one_row_fails_only_that_row(tokenizer):
    template = (
        "{% if messages[-1]['content'] == 'bad' %}{{ raise_exception('no bad rows') }}{% endif %}"
        "<{{ messages[-1]['content'] }}>"
    )
    rows = some_rows(8, seed=2)
    rows[3] = chat_row(4, "bad")
    prepared = prepare_prompts(tokenizer, rows, None, template)
    assert prepared[3] == "chat template failed: no bad rows"
    for i in (0, 1, 2, 4, 5, 6, 7):
        assert prepared[i] == reference_ids(tokenizer, rows[i], template)


def test_a_message_holding_the_separator_still_renders_right(tokenizer):
    rows = some_rows(6, seed=3)
    rows[2] = chat_row(3, "before" + chat_batch._SEPARATOR + "after")
    prepared = prepare_prompts(tokenizer, rows, None)
    for row, ids in zip(rows, prepared, strict=True):
        assert ids == reference_ids(tokenizer, row)


def test_the_sizing_pass_stores_the_ids_and_the_feed_reads_them_back(
    tokenizer, tiny_model, settings, tmp_path
):
    source = tmp_path / "in.jsonl"
    rng = random.Random(4)
    with source.open("w") as out:
        for _ in range(250):
            words = " ".join(rng.choice(WORDS) for _w in range(rng.randint(1, 20)))
            out.write(json.dumps({"messages": [{"role": "user", "content": words}]}) + "\n")
        out.write("not json\n")
    spec = JobSpec(model=str(tiny_model), sampling=SamplingDefaults(max_tokens=8))
    created = create_job(source_of(source, settings), spec, shard_size=100, settings=settings)
    storage = Storage.of(settings)
    with session_scope(settings) as session:
        paths = [s.input_path for s in session.get(Job, created.job.id).shards]
    assert len(paths) == 3

    sized = resolve_max_model_len(created.job.id, settings=settings)
    assert sized >= 16

    seen = 0
    for path in paths:
        stored = pq.read_table(storage.fs.open_input_file(token_path(path)))
        rows = list(iter_shard_rows(storage, path, with_token_ids=True))
        assert stored.column("line").to_pylist() == [r.line for r in rows]
        for row in rows:
            if row.kind == "invalid":
                assert row.token_ids is None
                continue
            seen += 1
            assert row.token_ids == reference_ids(tokenizer, row)
        # Without the flag (or without a token file) the rows carry no ids.
        assert all(r.token_ids is None for r in iter_shard_rows(storage, path))
    assert seen == 250


def one_sized_shard(tiny_model, settings, tmp_path, prompts: list[str]) -> tuple[Storage, str]:
    """A one-shard job of these prompts, sized (so its token file is written); its shard."""
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    spec = JobSpec(model=str(tiny_model), sampling=SamplingDefaults(max_tokens=8))
    created = create_job(source_of(source, settings), spec, shard_size=100, settings=settings)
    storage = Storage.of(settings)
    resolve_max_model_len(created.job.id, settings=settings)
    with session_scope(settings) as session:
        (path,) = [s.input_path for s in session.get(Job, created.job.id).shards]
    return storage, path


def test_a_token_file_out_of_step_with_its_shard_is_ignored(
    tokenizer, tiny_model, settings, tmp_path
):
    storage, path = one_sized_shard(
        tiny_model, settings, tmp_path, [f"prompt number {i}" for i in range(50)]
    )
    # Another file's ids under this shard's name: the lines do not match, so none are used.
    table = pq.read_table(storage.fs.open_input_file(token_path(path)))
    shifted = table.set_column(0, "line", [[n + 1000 for n in table.column("line").to_pylist()]])
    with storage.fs.open_output_stream(token_path(path)) as out:
        pq.write_table(shifted, out)
    rows = list(iter_shard_rows(storage, path, with_token_ids=True))
    assert len(rows) == 50 and all(r.token_ids is None for r in rows)


def write_chat_lines(path: Path, count: int, bad: int = 0) -> Path:
    rng = random.Random(5)
    with path.open("w") as out:
        for i in range(count):
            words = " ".join(rng.choice(WORDS) for _w in range(rng.randint(1, 20)))
            out.write(json.dumps({"custom_id": f"r{i}", "prompt": words}) + "\n")
        for _ in range(bad):
            out.write('{"prompt": 5}\n')
    return path


def test_a_local_run_sizes_its_shards_while_validating_and_feeds_the_stored_ids(
    tiny_model, settings, tmp_path
):
    from batchllm.execution.context.passes import size_shards
    from batchllm.execution.stand_in_engines import InstantEngines
    from batchllm.jobs.local import run_job
    from batchllm.output.parts import read_output
    from batchllm.store.models import JobStatus

    settings = settings.model_copy(update={"shard_size": 40})
    source = write_chat_lines(tmp_path / "in.jsonl", 150, bad=2)
    spec = JobSpec(model=str(tiny_model), sampling=SamplingDefaults(max_tokens=8))
    engines = InstantEngines(load_tokenizer(str(tiny_model)))
    job = run_job(source_of(source, settings), spec, settings=settings, engines=engines)

    assert job.status is JobStatus.COMPLETED
    assert (job.request_completed, job.request_failed) == (150, 2)
    storage = Storage.of(settings)
    with session_scope(settings) as session:
        paths = [s.input_path for s in session.get(Job, job.id).shards]
    assert len(paths) == 4
    for path in paths:
        assert storage.exists(token_path(path)), path
    # The overlapped pass sized exactly what the one after validation would have.
    assert job.max_model_len == size_shards(spec, storage, paths, settings=settings)
    # The feed took the stored ids: the instant engine never tokenized a row.
    assert engines.engine is not None and engines.engine.prepare_seconds < 1.0
    output = read_output(storage, storage.output_dir(job.id))
    assert sorted(output.column("custom_id").to_pylist())[:3] == ["line-151", "line-152", "r0"]
    assert output.num_rows == 152


def test_a_refused_file_leaves_no_token_ids_behind(tiny_model, settings, tmp_path):
    from batchllm.errors import InputError
    from batchllm.jobs.local import run_job

    settings = settings.model_copy(update={"shard_size": 40})
    source = write_chat_lines(tmp_path / "in.jsonl", 100, bad=1)
    spec = JobSpec(model=str(tiny_model), sampling=SamplingDefaults(max_tokens=8))
    with pytest.raises(InputError, match="--strict refuses the file"):
        run_job(source_of(source, settings), spec, settings=settings, strict=True)
    stored = [p.name for p in Path(settings.resolved_storage).rglob("*.parquet")]
    assert not [name for name in stored if name.startswith("tokens-")], stored


def test_a_failed_sizing_pass_fails_the_created_job_with_the_reason(settings, tmp_path):
    from batchllm.errors import BatchLLMError
    from batchllm.jobs.local import run_job
    from batchllm.store.models import JobStatus

    source = write_chat_lines(tmp_path / "in.jsonl", 10)
    missing = tmp_path / "no-such-model"
    spec = JobSpec(model=str(missing), sampling=SamplingDefaults(max_tokens=8))
    with pytest.raises(BatchLLMError, match="failed"):
        run_job(source_of(source, settings), spec, settings=settings, engines=_NeverEngines())
    with session_scope(settings) as session:
        (job,) = session.query(Job).all()
        assert job.status is JobStatus.FAILED
        assert str(missing) in (job.error or ""), job.error


class _NeverEngines:
    def get(self, spec, max_model_len):
        raise AssertionError("no engine may start for a job whose sizing failed")

    def close(self) -> None:
        pass


def test_an_unreadable_token_file_means_tokenizing_not_a_failed_shard(
    tiny_model, settings, tmp_path
):
    storage, path = one_sized_shard(
        tiny_model, settings, tmp_path, [f"prompt {i}" for i in range(30)]
    )
    storage.write_bytes(token_path(path), b"PAR1 half a file")
    rows = list(iter_shard_rows(storage, path, with_token_ids=True))
    assert sorted(r.line for r in rows) == list(range(1, 31))  # stored in prompt order
    assert all(r.token_ids is None for r in rows)
