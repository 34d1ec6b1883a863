"""`submit`'s token pass (execution/context/submit_pass.py): the prompts' ids stored beside each shard before
the shard is released, an unsized job's context sized there, nothing lost when the pass fails;
and the feed's check of stored ids against its own engine's tokenizer (execution/runner.py)."""

from __future__ import annotations

import io
import json
import logging
import shutil
import time
from pathlib import Path

import pyarrow.parquet as pq

from batchllm.engine.sizing import config_limit
from batchllm.execution.context import submit_pass as submit_tokens_module
from batchllm.execution.context.passes import size_shards
from batchllm.execution.context.plan import ContextPlan, ContextPolicy, plan_for_submit
from batchllm.execution.context.submit_pass import SubmitTokens
from batchllm.execution.runner import Outcome, ShardRunner
from batchllm.execution.stand_in_engines import InstantEngine
from batchllm.input.token_store import TokenFileWriter, token_path
from batchllm.jobs.create import CreatedJob, create_job
from batchllm.output.parts import read_output
from batchllm.spec import EngineOptions, JobSpec, SamplingDefaults
from batchllm.storage import Storage
from batchllm.store import service, shard_recording
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus, Shard
from tests.support.inputs import source_of


def write_chats(path: Path, count: int, bad: int = 0) -> Path:
    with path.open("w") as out:
        for i in range(count):
            words = " ".join(["tea", "ünïcode", "river", "日本語"][: 1 + i % 4])
            messages = [{"role": "user", "content": f"{i}: {words}"}]
            out.write(json.dumps({"custom_id": f"r{i}", "messages": messages}) + "\n")
        for _ in range(bad):
            out.write('{"prompt": 5}\n')
    return path


def exact(spec: JobSpec, preparer: SubmitTokens) -> ContextPlan:
    """`always`'s plan around a given pass (submit's own plan, plan_for_submit, builds one)."""
    given = spec.engine.max_model_len is not None
    return ContextPlan(ContextPolicy.GIVEN if given else ContextPolicy.SUBMIT_EXACT, preparer)


def shards_of(settings, job_id: str) -> list[Shard]:
    with session_scope(settings) as session:
        shards = session.get(Job, job_id).shards
        return sorted(shards, key=lambda s: s.index)


def test_each_shard_is_released_only_once_its_ids_are_stored_and_the_context_is_sized(
    tiny_model, tokenizer, settings, tmp_path
):
    source = write_chats(tmp_path / "in.jsonl", 230, bad=2)
    spec = JobSpec(model=str(tiny_model), sampling=SamplingDefaults(max_tokens=8))
    storage = Storage.of(settings)
    released: list[int] = []

    def release(job_id: str, shard_ids: list[int]) -> None:
        # A worker may take a shard the moment it is released: its ids must be there.
        with session_scope(settings) as session:
            for shard_id in shard_ids:
                path = session.get(Shard, shard_id).input_path
                assert storage.exists(token_path(path)), path
        released.extend(shard_ids)

    # `always`: `auto` would wait for AUTO_MIN_ROWS rows before starting (another test).
    plan = plan_for_submit(spec, settings.model_copy(update={"tokenize_at_submit": "always"}))
    assert plan.has_pass
    created = create_job(
        source_of(source, settings),
        spec,
        shard_size=50,
        settings=settings,
        release=release,
        context=plan,
    )
    shards = shards_of(settings, created.job.id)
    assert len(shards) == 5 and sorted(released) == sorted(s.id for s in shards)
    # The size is the one a worker's sizing pass (AutoTokenizer) gives for the same rows.
    paths = [s.input_path for s in shards]
    assert created.job.max_model_len == size_shards(spec, storage, paths, settings)
    for shard in shards:
        ids = pq.read_table(storage.fs.open_input_file(token_path(shard.input_path)))
        assert ids.num_rows == shard.rows
    # ...whose ids the submit's equal (the sizing pass above rewrote the files: compare one).
    first = pq.read_table(storage.fs.open_input_file(token_path(paths[0])))
    messages = [{"role": "user", "content": "0: tea"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (
        first.column("token_ids")[0].as_py()
        == tokenizer(text, add_special_tokens=False)["input_ids"]
    )


def test_a_job_given_its_context_keeps_it_and_gets_the_ids(tiny_model, settings, tmp_path):
    source = write_chats(tmp_path / "in.jsonl", 60)
    spec = JobSpec(
        model=str(tiny_model),
        engine=EngineOptions(max_model_len=512),
        sampling=SamplingDefaults(max_tokens=8),
    )
    preparer = SubmitTokens(spec, Storage.of(settings), settings)
    created = create_job(
        source_of(source, settings),
        spec,
        shard_size=25,
        settings=settings,
        release=lambda *a: None,
        context=exact(spec, preparer),
    )
    assert created.job.max_model_len == 512
    storage = Storage.of(settings)
    for shard in shards_of(settings, created.job.id):
        assert storage.exists(token_path(shard.input_path))


def test_a_pass_that_fails_loses_no_shard_and_leaves_the_sizing_to_the_workers(
    tiny_model, settings, tmp_path, caplog
):
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model, broken)
    (broken / "tokenizer.json").write_text("{not a tokenizer")
    source = write_chats(tmp_path / "in.jsonl", 120)
    spec = JobSpec(model=str(broken), sampling=SamplingDefaults(max_tokens=8))
    released: list[int] = []
    preparer = SubmitTokens(spec, Storage.of(settings), settings)
    with caplog.at_level(logging.WARNING, logger="batchllm.execution.context.submit_pass"):
        created = create_job(
            source_of(source, settings),
            spec,
            shard_size=50,
            settings=settings,
            release=lambda _job, ids: released.extend(ids),
            context=exact(spec, preparer),
        )
    shards = shards_of(settings, created.job.id)
    assert len(shards) == 3 and sorted(released) == sorted(s.id for s in shards)
    assert created.job.request_total == 120 and created.job.max_model_len is None
    assert "tokenizing at submit stopped" in caplog.text


def test_the_pass_runs_when_its_mode_says_and_the_model_is_a_local_directory(
    tiny_model, settings, tmp_path
):
    unsized, sized = (
        JobSpec(model=str(tiny_model)),
        JobSpec(model=str(tiny_model), engine=EngineOptions(max_model_len=512)),
    )
    always = settings.model_copy(update={"tokenize_at_submit": "always"})
    never = settings.model_copy(update={"tokenize_at_submit": "never"})
    # `auto` (the default): only a job without a context length, which must be sized.
    assert settings.tokenize_at_submit == "auto"
    assert plan_for_submit(sized, settings).has_pass is False
    assert (
        plan_for_submit(unsized, never).has_pass is False
        and plan_for_submit(sized, never).has_pass is False
    )
    assert plan_for_submit(JobSpec(model="org/some-model"), always).has_pass is False
    assert plan_for_submit(JobSpec(model=str(tmp_path / "missing")), always).has_pass is False
    storage = Storage.of(settings)
    for spec, mode in ((unsized, settings), (sized, always)):
        preparer = plan_for_submit(spec, mode).start(storage)
        assert preparer is not None
        preparer.close()
    config = json.loads((tiny_model / "config.json").read_text())
    assert config_limit(tiny_model) == config.get("max_position_embeddings")
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 8}}))
    assert config_limit(tmp_path) is None


def test_auto_starts_once_the_job_is_big_enough_and_leaves_a_small_one_to_its_worker(
    tiny_model, settings, tmp_path, monkeypatch
):
    spec = JobSpec(model=str(tiny_model), sampling=SamplingDefaults(max_tokens=8))
    storage = Storage.of(settings)
    monkeypatch.setattr(submit_tokens_module, "AUTO_MIN_ROWS", 100)

    def submitted(name: str, lines: int) -> CreatedJob:
        return create_job(
            source_of(write_chats(tmp_path / f"{name}.jsonl", lines), settings),
            spec,
            shard_size=40,
            settings=settings,
            context=plan_for_submit(spec, settings),
        )

    small = submitted("small", 99)
    shards = shards_of(settings, small.job.id)
    assert len(shards) == 3 and small.job.max_model_len is None
    assert not [s for s in shards if storage.exists(token_path(s.input_path))]

    big = submitted("big", 100)
    shards = shards_of(settings, big.job.id)
    # Sized at submit, every shard (those stored before the job reached 100 rows too), from
    # its bytes: these prompts are short, so the workers tokenize them (no ids stored).
    assert len(shards) == 3 and big.job.max_model_len == 256
    assert not [s for s in shards if storage.exists(token_path(s.input_path))]


def test_stored_ids_that_differ_from_the_engines_tokenizer_are_dropped_for_its_own(
    tiny_model, tokenizer, settings, tmp_path, caplog
):
    """A submit's tokenizer (loaded without torch) could differ from a worker's: the feed checks
    each shard's first stored ids and tokenizes the shard itself on a difference."""
    source = write_chats(tmp_path / "in.jsonl", 40)
    spec = JobSpec(
        model=str(tiny_model),
        engine=EngineOptions(max_model_len=512),
        sampling=SamplingDefaults(max_tokens=4),
    )
    created = create_job(source_of(source, settings), spec, shard_size=100, settings=settings)
    storage = Storage.of(settings)
    (shard,) = shards_of(settings, created.job.id)
    # Ids with one token too many on every row, as another tokenizer's might be.
    writer = TokenFileWriter(storage, shard.input_path)
    own = [
        tokenizer(
            tokenizer.apply_chat_template(
                json.loads(line)["messages"], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )["input_ids"]
        for line in source.read_text().splitlines()
    ]
    # In the shard's stored order (placed by prompt, not by line), as the sizing pass writes.
    stored_lines = pq.read_table(shard.input_path, columns=["line"]).column("line").to_pylist()
    writer.write(stored_lines, [[*own[line - 1], 7] for line in stored_lines])
    writer.close()

    engine = InstantEngine(tokenizer=tokenizer, max_model_len=512, max_num_seqs=16)
    with caplog.at_level(logging.WARNING, logger="batchllm.execution.runner"):
        outcome = ShardRunner(engine, worker="w1", settings=settings).run([shard.id])
    assert outcome == {shard.id: Outcome.COMPLETED}
    assert "differ from this engine's tokenizer" in caplog.text
    rows = read_output(storage, storage.output_dir(created.job.id)).to_pylist()
    by_line = {row["line"]: row["prompt_tokens"] for row in rows}
    assert by_line == {line: len(ids) for line, ids in enumerate(own, start=1)}


def test_stored_ids_equal_to_the_engines_are_used_as_they_are(
    tiny_model, tokenizer, settings, tmp_path, caplog
):
    source = write_chats(tmp_path / "in.jsonl", 30)
    spec = JobSpec(
        model=str(tiny_model),
        engine=EngineOptions(max_model_len=512),
        sampling=SamplingDefaults(max_tokens=4),
    )
    created = create_job(
        source_of(source, settings),
        spec,
        shard_size=100,
        settings=settings,
        context=exact(spec, SubmitTokens(spec, Storage.of(settings), settings)),
    )
    (shard,) = shards_of(settings, created.job.id)
    engine = InstantEngine(tokenizer=tokenizer, max_model_len=512, max_num_seqs=16)
    untokenized: list[int] = []  # rows the engine was given without ids
    prepare = engine.prepare

    def counting(rows, chat_template=None):
        untokenized.extend(row.line for row in rows if row.token_ids is None)
        return prepare(rows, chat_template)

    engine.prepare = counting  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="batchllm.execution.runner"):
        outcome = ShardRunner(engine, worker="w1", settings=settings).run([shard.id])
    assert outcome == {shard.id: Outcome.COMPLETED}
    assert "differ" not in caplog.text
    # Only the check's one row was tokenized by the engine; the 30 ran on the stored ids.
    assert untokenized == [1]
    rows = read_output(Storage.of(settings), Storage.of(settings).output_dir(created.job.id))
    assert rows.num_rows == 30


class PacedTokens(SubmitTokens):
    """The pass kept level with validation: each stored shard is tokenized before the next is
    read, so it is ready (and released) while validation goes on, as on a big file."""

    def stored(self, shard) -> None:
        super().stored(shard)
        deadline = time.monotonic() + 60
        while self._done.empty() and self._thread is not None and time.monotonic() < deadline:
            time.sleep(0.01)


def write_growing_chats(path: Path, shards: int, per_shard: int) -> Path:
    """Each shard's prompts longer than the last one's: the job's size grows shard by shard."""
    with path.open("w") as out:
        for i in range(shards * per_shard):
            words = " ".join(["tea", "river"] * (1 + 40 * (i // per_shard)))
            messages = [{"role": "user", "content": f"{i}: {words}"}]
            out.write(json.dumps({"custom_id": f"r{i}", "messages": messages}) + "\n")
    return path


def stored_need(storage: Storage, shard: Shard, max_tokens: int) -> int:
    ids = pq.read_table(storage.fs.open_input_file(token_path(shard.input_path)))
    return max(len(row) for row in ids.column("token_ids").to_pylist()) + max_tokens


def submit_growing(
    spec: JobSpec, settings, tmp_path: Path
) -> tuple[CreatedJob, list[tuple[int, JobStatus, int | None]]]:
    """A 5-shard job of growing prompts through the paced pass; each released shard with the
    job's status and recorded max_model_len at its release."""
    seen: list[tuple[int, JobStatus, int | None]] = []

    def release(job_id: str, shard_ids: list[int]) -> None:
        with session_scope(settings) as session:
            job = session.get(Job, job_id)
            seen.extend((shard_id, job.status, job.max_model_len) for shard_id in shard_ids)

    created = create_job(
        source_of(write_growing_chats(tmp_path / "in.jsonl", shards=5, per_shard=20), settings),
        spec,
        shard_size=20,
        settings=settings,
        release=release,
        context=exact(spec, PacedTokens(spec, Storage.of(settings), settings)),
    )
    return created, seen


def test_an_unsized_job_streams_its_shards_each_covered_by_the_size_recorded_before_it(
    tiny_model, settings, tmp_path, monkeypatch
):
    """Issue 37: an unsized job's workers used to wait for the submit's whole pass. Now each
    shard is released once measured, after the job's max_model_len was raised to cover it."""
    monkeypatch.setattr(shard_recording, "RELEASE_EVERY_SECONDS", 0.0)
    spec = JobSpec(model=str(tiny_model), sampling=SamplingDefaults(max_tokens=8))
    storage = Storage.of(settings)
    created, seen = submit_growing(spec, settings, tmp_path)
    shards = {s.id: s for s in shards_of(settings, created.job.id)}
    assert sorted(shard_id for shard_id, _, _ in seen) == sorted(shards)  # each once
    streamed = [entry for entry in seen if entry[1] is JobStatus.VALIDATING]
    assert len(streamed) >= 3  # released while the file was still being validated
    sizes = [size for _, _, size in seen]
    assert all(size is not None for size in sizes)
    assert sizes == sorted(sizes) and len(set(sizes)) >= 3  # raised as the shards came
    for shard_id, _, size in seen:
        assert stored_need(storage, shards[shard_id], 8) <= size
    # The end: the size of every row, as a worker's own pass over the job gives it.
    paths = [s.input_path for s in sorted(shards.values(), key=lambda s: s.index)]
    assert created.job.max_model_len == size_shards(spec, storage, paths, settings)


def test_a_pass_that_stops_after_shards_streamed_leaves_the_whole_job_to_a_worker(
    tiny_model, settings, tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(shard_recording, "RELEASE_EVERY_SECONDS", 0.0)
    passes = 0
    real_size_shard = submit_tokens_module.size_shard

    def failing_third(sizer, storage, path) -> None:
        nonlocal passes
        passes += 1
        if passes == 3:
            raise RuntimeError("the tokenizer broke")
        real_size_shard(sizer, storage, path)

    monkeypatch.setattr(submit_tokens_module, "size_shard", failing_third)
    spec = JobSpec(model=str(tiny_model), sampling=SamplingDefaults(max_tokens=8))
    with caplog.at_level(logging.WARNING, logger="batchllm.execution.context.submit_pass"):
        created, seen = submit_growing(spec, settings, tmp_path)
    shards = shards_of(settings, created.job.id)
    assert sorted(shard_id for shard_id, _, _ in seen) == sorted(s.id for s in shards)
    # The two measured shards went while validating; the rest after, with no size recorded:
    # a size of part of the rows would be too short for the longer ones further down.
    early = {shard_id for shard_id, status, _ in seen if status is JobStatus.VALIDATING}
    assert early == {shards[0].id, shards[1].id}
    assert created.job.max_model_len is None
    assert "tokenizing at submit stopped" in caplog.text


def test_auto_sizes_short_prompts_by_their_bytes_and_tokenizes_only_the_shards_of_long_ones(
    tiny_model, settings, tmp_path, monkeypatch, caplog
):
    """Issue 37: an exact pass at submit was the one thread an unsized job's workers waited
    on. `auto` sizes a shard of short prompts from its bytes (an upper bound on its tokens,
    engine/token_bound.py) and leaves its tokenizing to the workers; a shard whose bound asks
    for more than BOUND_CEILING is tokenized and its ids stored, as before."""
    monkeypatch.setattr(submit_tokens_module, "AUTO_MIN_ROWS", 1)
    spec = JobSpec(model=str(tiny_model), sampling=SamplingDefaults(max_tokens=8))
    storage = Storage.of(settings)
    source = tmp_path / "in.jsonl"
    with source.open("w") as out:
        for i in range(90):
            # Line 75 is long: its bytes bound it over 1,024 tokens, its real ids far fewer.
            words = "tea river sky " * (120 if i == 75 else 1)
            messages = [{"role": "user", "content": f"{i}: {words}"}]
            out.write(json.dumps({"custom_id": f"r{i}", "messages": messages}) + "\n")
    with caplog.at_level(logging.INFO, logger="batchllm.engine.sizing"):
        created = create_job(
            source_of(source, settings),
            spec,
            shard_size=30,
            settings=settings,
            release=lambda *a: None,
            context=plan_for_submit(spec, settings),
        )
    shards = shards_of(settings, created.job.id)
    with_ids = [s.index for s in shards if storage.exists(token_path(s.input_path))]
    assert with_ids == [2]  # the long line's shard only
    # The job's size: the long line's exact need (its shard was tokenized), above every
    # bound of the short ones, and what an exact pass over all rows gives.
    exact = size_shards(spec, storage, [s.input_path for s in shards], settings)
    long_need = stored_need(storage, shards[2], 8)
    assert long_need > 256 and created.job.max_model_len >= exact >= long_need
    assert "max_model_len sized to" in caplog.text


def test_a_job_of_short_prompts_is_sized_from_bytes_at_or_above_its_exact_size(
    tiny_model, tokenizer, settings, tmp_path, monkeypatch
):
    monkeypatch.setattr(submit_tokens_module, "AUTO_MIN_ROWS", 1)
    spec = JobSpec(model=str(tiny_model), sampling=SamplingDefaults(max_tokens=8))
    source = write_chats(tmp_path / "in.jsonl", 120, bad=1)
    created = create_job(
        source_of(source, settings),
        spec,
        shard_size=50,
        settings=settings,
        context=plan_for_submit(spec, settings),
    )
    storage = Storage.of(settings)
    shards = shards_of(settings, created.job.id)
    exact = size_shards(spec, storage, [s.input_path for s in shards], settings)
    # A bound is rounded to a power of two from 256 (ContextSizer.sized says why).
    assert exact < 256 and created.job.max_model_len == 256
    assert created.job.request_total == 121


def test_the_byte_bound_covers_the_real_ids_and_holds_only_for_byte_level_bpe(tokenizer):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from batchllm.engine.prompts import batch_encoder
    from batchllm.engine.token_bound import byte_bound_encoder

    bound, encode = byte_bound_encoder(tokenizer), batch_encoder(tokenizer)
    assert bound is not None
    texts = ["", "tea", "ünïcode 日本語 🎉🎉", "<s>user: hi</s>", "  \n\t x" * 9, "a" * 500]
    texts += ["".join(chr(c) for c in range(start, start + 60)) for start in (33, 0x400, 0x4E00)]
    for special in (True, False):
        for text, bounded, ids in zip(texts, bound(texts, special), encode(texts, special)):
            assert len(bounded) >= len(ids), text
    # A normalizer may expand a character (NFKC: one 3-byte ligature, 18 characters): none.
    vocab = {"[UNK]": 0, "a": 1}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    word_level.normalizer = normalizers.NFKC()
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    assert byte_bound_encoder(PreTrainedTokenizerFast(tokenizer_object=word_level)) is None


def test_a_job_whose_every_prompt_was_tokenized_records_its_exact_prompt_tokens(
    tiny_model, tokenizer, settings, tmp_path
):
    """What its key's enqueued-token limit then holds (api/enqueued.py), in place of the
    estimate from the file's bytes: the sum of the ids stored beside its shards."""
    source = write_chats(tmp_path / "in.jsonl", 120, bad=1)
    spec = JobSpec(model=str(tiny_model), sampling=SamplingDefaults(max_tokens=8))
    plan = plan_for_submit(spec, settings.model_copy(update={"tokenize_at_submit": "always"}))
    created = create_job(
        source_of(source, settings), spec, shard_size=50, settings=settings, context=plan
    )
    storage = Storage.of(settings)
    stored = 0
    for shard in shards_of(settings, created.job.id):
        table = pq.read_table(io.BytesIO(storage.read_bytes(token_path(shard.input_path))))
        stored += sum(len(ids) for ids in table.column("token_ids").to_pylist() if ids)
    assert stored > 120 and created.job.prompt_tokens_estimate == stored

    # A pass that bounds short prompts by their bytes counts nothing exact.
    bounded = SubmitTokens(spec, storage, settings, bound=True)
    created = create_job(
        source_of(source, settings),
        spec,
        shard_size=50,
        settings=settings,
        context=exact(spec, bounded),
    )
    assert created.job.prompt_tokens_estimate is None
