"""Object storage: the s3:// URI and BATCHLLM_S3_ENDPOINT parsing, the write path without a
rename, input files given as s3:// URIs (streamed), and a whole job on the fake engine with
its storage in a bucket of a real S3-compatible server (moto's, started on 127.0.0.1)."""

from __future__ import annotations

import collections
import json
import posixpath
from datetime import timedelta
from pathlib import Path
from typing import Any

import click
import pyarrow.fs as pafs
import pytest
from sqlalchemy import update

from batchllm.errors import BatchLLMError, InputError, StorageError
from batchllm.execution.runner import Outcome, ShardRunner
from batchllm.input.files.lines import has_requests
from batchllm.input.formats.schemas import LineError
from batchllm.input.shards import store_input
from batchllm.input.validation.validate import infer_task
from batchllm.jobs.create import create_job
from batchllm.jobs.local import run_job
from batchllm.output import commit
from batchllm.output.parts import MANIFEST_NAME, SUCCESS_NAME, read_output, remove_unrecorded_parts
from batchllm.settings import Settings, get_settings
from batchllm.storage import Storage, endpoint_options, filesystem_for, is_uri
from batchllm.store import service
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus, Shard, utcnow
from tests.support.fake_runs import (
    FakeEngine,
    FakeEngines,
    crash_on_checkpoint,
    make_spec,
    write_items,
)
from tests.support.file_jobs import create_from_file, run_file
from tests.support.inputs import source_of
from tests.support.line_reader import read_requests
from tests.support.output_rows import OutputRow, write_part
from tests.support.s3server import ACCESS_KEY, REGION, SECRET_KEY, S3Server, moto_server

# -- parsing (no server) ----------------------------------------------------------------------


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Credentials and a region in the environment, as a user sets them, and no EC2 metadata
    look-up by the AWS SDK (its fallback when they are missing)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)


def s3_options(fs: pafs.FileSystem) -> dict[str, Any]:
    """The options an S3FileSystem was built with (pyarrow keeps them for pickling)."""
    _rebuild, (options,) = fs.__reduce__()
    return dict(options)


@pytest.mark.parametrize(
    ("endpoint", "options"),
    [
        ("http://127.0.0.1:9000", {"endpoint_override": "127.0.0.1:9000", "scheme": "http"}),
        (
            "https://minio.internal:9000/",
            {"endpoint_override": "minio.internal:9000", "scheme": "https"},
        ),
        ("minio.internal:9000", {"endpoint_override": "minio.internal:9000"}),
    ],
)
def test_an_endpoint_url_gives_pyarrow_its_host_and_scheme(endpoint, options):
    assert endpoint_options(endpoint) == options


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ("ftp://127.0.0.1:9000", "expected http://host:port"),
        ("http://127.0.0.1:9000/bucket", "no path"),
    ],
)
def test_an_endpoint_that_is_not_a_server_url_is_refused(endpoint, message):
    with pytest.raises(BatchLLMError, match=message):
        endpoint_options(endpoint)


def test_uris_are_told_from_paths():
    assert is_uri("s3://bucket/in/prompts.jsonl")
    assert not is_uri("prompts.jsonl")
    assert not is_uri("/data/prompts.jsonl")
    assert not is_uri(Path("s3://bucket/key"))  # a Path has lost the URI's second slash


def test_an_s3_uri_with_the_endpoint_setting_builds_one_filesystem_per_bucket(aws_env):
    fs, path = filesystem_for("s3://bucket/some/prefix/", s3_endpoint="http://127.0.0.1:9")
    again, other = filesystem_for("s3://bucket/else", s3_endpoint="http://127.0.0.1:9")

    assert isinstance(fs, pafs.S3FileSystem)
    assert (path, other) == ("bucket/some/prefix", "bucket/else")
    assert again is fs  # cached: an S3 client is built once
    options = s3_options(fs)
    assert (options["endpoint_override"], options["scheme"]) == ("127.0.0.1:9", "http")
    assert filesystem_for("s3://bucket", s3_endpoint="http://127.0.0.1:9")[1] == "bucket"


def test_the_endpoint_comes_from_the_settings_batchllm_s3_endpoint_unless_the_uri_names_one(
    aws_env, tmp_path
):
    given = Settings(home=tmp_path, storage="s3://bucket/prefix", s3_endpoint="http://127.0.0.1:19")

    assert s3_options(Storage.of(given).fs)["endpoint_override"] == "127.0.0.1:19"
    own, _ = filesystem_for(
        "s3://bucket/prefix?endpoint_override=127.0.0.1:29&scheme=http",
        s3_endpoint=given.resolved_s3_endpoint,
    )
    assert s3_options(own)["endpoint_override"] == "127.0.0.1:29"


def test_an_s3_storage_is_never_built_on_an_endpoint_it_was_not_given(aws_env):
    with pytest.raises(ValueError, match="needs its s3_endpoint"):
        Storage("s3://bucket/prefix")


def test_an_s3_uri_without_a_bucket_is_refused(aws_env):
    with pytest.raises(BatchLLMError, match="no bucket"):
        filesystem_for("s3:///prefix", s3_endpoint="http://127.0.0.1:9")


def test_s3_storage_paths_are_bucket_keys_shown_as_uris(aws_env):
    storage = Storage("s3://bucket/jobs/", s3_endpoint="http://127.0.0.1:9")

    assert storage.root == "bucket/jobs"
    assert storage.is_object_store
    assert storage.output_dir("job_1") == "bucket/jobs/job_1/output"
    assert storage.display(storage.output_dir("job_1")) == "s3://bucket/jobs/job_1/output"


# -- the write path: a rename on a filesystem, none on an object store -------------------------


class Recording:
    """Records the filesystem calls made through it, passing them on."""

    def __init__(self, fs: pafs.FileSystem) -> None:
        self._fs = fs
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._fs, name)
        if not callable(real):
            return real

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args))
            return real(*args, **kwargs)

        return call


def test_a_local_file_is_written_under_a_temporary_name_and_renamed(tmp_path):
    storage = Storage(str(tmp_path / "store"))
    assert not storage.is_object_store
    storage.makedirs(storage.root)
    recording = Recording(storage.fs)
    storage.fs = recording  # type: ignore[assignment]
    target = posixpath.join(storage.root, "part-1.parquet")

    storage.write_bytes(target, b"rows")

    calls = [c for c in recording.calls if c[0] in ("open_output_stream", "move")]
    assert [name for name, _ in calls] == ["open_output_stream", "move"]
    (tmp,) = calls[0][1]
    assert calls[1][1] == (tmp, target)
    # A hidden name of its own beside the target (two writers never share one).
    assert posixpath.dirname(tmp) == storage.root
    assert posixpath.basename(tmp).startswith(".part-1.parquet.") and tmp.endswith(".tmp")
    storage.write_bytes(target, b"rows again")
    assert recording.calls[-1][1][0] != tmp
    assert (tmp_path / "store" / "part-1.parquet").read_bytes() == b"rows again"
    assert [p.name for p in (tmp_path / "store").iterdir()] == ["part-1.parquet"]


# -- against a real S3-compatible server ------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> S3Server:
    with moto_server(tmp_path_factory.mktemp("moto")) as running:
        yield running


@pytest.fixture
def s3(server: S3Server, settings, monkeypatch: pytest.MonkeyPatch):
    """A new bucket on the server, the process's settings storing jobs in it (database:
    the test's SQLite), and a Storage on it."""
    for name, value in server.env(server.new_bucket()).items():
        monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    current = get_settings()
    assert current.resolved_storage.startswith("s3://")
    yield Storage.of(current)
    get_settings.cache_clear()


@pytest.fixture
def s3_settings(s3):
    """The settings of the `s3` fixture (those ShardRunner and run_job read too)."""
    current = get_settings()
    current.commit_rows = 5
    return current


def upload(server: S3Server, key: str, data: bytes) -> None:
    with server.filesystem().open_output_stream(key) as out:
        out.write(data)


def test_an_object_is_put_under_its_final_name_with_no_rename(server, s3):
    recording = Recording(s3.fs)
    s3.fs = recording  # type: ignore[assignment]
    target = posixpath.join(s3.output_dir("job_x"), "part-s00000-a001-00000.parquet")

    s3.write_bytes(target, b"rows")

    assert [c for c in recording.calls if c[0] in ("open_output_stream", "move")] == [
        ("open_output_stream", (target,))
    ]
    independent = server.filesystem()
    listed = independent.get_file_info(pafs.FileSelector(s3.root, recursive=True))
    assert [i.path for i in listed if i.type == pafs.FileType.File] == [target]
    with independent.open_input_stream(target) as src:
        assert src.read() == b"rows"


def test_directories_are_prefixes_listed_exists_and_deleted_on_s3(s3):
    out_dir = s3.output_dir("job_y")
    assert s3.listdir(out_dir) == []
    assert not s3.exists(out_dir)
    s3.makedirs(out_dir)
    s3.write_bytes(posixpath.join(out_dir, "b.parquet"), b"2")
    s3.write_bytes(posixpath.join(out_dir, "a.parquet"), b"1")
    s3.write_bytes(posixpath.join(out_dir, "deeper", "c.parquet"), b"3")

    assert s3.exists(out_dir) and s3.exists(s3.job_dir("job_y"))
    assert s3.listdir(out_dir) == ["a.parquet", "b.parquet"]  # files right under the prefix
    assert s3.read_bytes(posixpath.join(out_dir, "a.parquet")) == b"1"
    s3.delete(posixpath.join(out_dir, "a.parquet"))
    s3.delete(posixpath.join(out_dir, "never-written"))
    assert s3.listdir(out_dir) == ["b.parquet"]


def test_unrecorded_parts_are_removed_and_the_output_reads_one_row_per_line_on_s3(s3):
    out_dir = s3.output_dir("job_z")
    kept = write_part(s3, out_dir, "part-s00000-a001-00000.parquet", [OutputRow("a", 1, "ok")])
    write_part(s3, out_dir, "part-s00000-a001-00001.parquet", [OutputRow("a", 1, "ok")])
    other = write_part(s3, out_dir, "part-s00001-a001-00000.parquet", [OutputRow("b", 2, "ok")])

    removed = remove_unrecorded_parts(s3, out_dir, [kept], shard=0)

    assert removed == ["part-s00000-a001-00001.parquet"]
    assert sorted(read_output(s3, out_dir).column("line").to_pylist()) == [1, 2]
    assert remove_unrecorded_parts(s3, out_dir, [kept, other]) == []


# -- input files given as s3:// URIs ----------------------------------------------------------


def test_a_missing_object_or_a_prefix_is_refused_as_input(server, s3):
    bucket = s3.root.split("/")[0]
    upload(server, f"{bucket}/in/prompts.jsonl", b'{"prompt": "hi"}\n')

    found = source_of(f"s3://{bucket}/in/prompts.jsonl")
    assert (found.name, found.recorded, found.uri, found.format) == (
        f"s3://{bucket}/in/prompts.jsonl",
        f"s3://{bucket}/in/prompts.jsonl",
        True,
        "jsonl",
    )
    with pytest.raises(InputError, match=r"s3://.*/in/missing.jsonl: no such file"):
        source_of(f"s3://{bucket}/in/missing.jsonl")
    with pytest.raises(InputError, match="is a directory"):
        source_of(f"s3://{bucket}/in")


def test_an_s3_input_reads_exactly_as_the_same_local_file(server, s3, tmp_path):
    lines = [
        json.dumps({"prompt": "first"}),  # gets line-1, taken by line 4: moves on to line-1-2
        "",
        "{broken",
        json.dumps({"custom_id": "line-1", "prompt": "claims a default id"}),
        json.dumps({"custom_id": "line-1", "prompt": "a duplicate"}),
        json.dumps({"messages": [{"role": "user", "content": "chat"}]}),
    ]
    data = b"\xef\xbb\xbf" + "\n".join(lines).encode()  # a BOM, no final newline
    local = tmp_path / "prompts.jsonl"
    local.write_bytes(data)
    bucket = s3.root.split("/")[0]
    uri = f"s3://{bucket}/in/prompts.jsonl"
    upload(server, f"{bucket}/in/prompts.jsonl", data)

    def described(items: list) -> list:
        return [
            (i.line, i.custom_id, i.message if isinstance(i, LineError) else i.kind) for i in items
        ]

    from_s3 = list(read_requests(source_of(uri), settings=get_settings()))
    assert described(from_s3) == described(
        list(read_requests(source_of(local), settings=get_settings()))
    )
    assert [i.custom_id for i in from_s3] == ["line-1-2", "line-3", "line-1", "line-1", "line-6"]
    assert from_s3[1].file == uri  # errors name the URI
    assert (
        has_requests(source_of(uri), 1024)
        and infer_task(source_of(uri), settings=get_settings()) == "generate"
    )
    upload(server, f"{bucket}/in/embed.jsonl", b'{"input": "x"}\n')
    assert infer_task(source_of(f"s3://{bucket}/in/embed.jsonl"), get_settings()) == "embed"
    upload(server, f"{bucket}/in/blank.jsonl", b"\n  \n")
    assert not has_requests(source_of(f"s3://{bucket}/in/blank.jsonl"), 1024)


def test_an_s3_input_is_streamed_a_buffer_at_a_time(server, s3, monkeypatch):
    import io

    import batchllm.input.files.source as source_module

    fetched: list[int] = []

    class Counted(io.RawIOBase):
        """The object's stream, counting the bytes fetched from it."""

        def __init__(self, stream: Any) -> None:
            self.stream = stream

        def readable(self) -> bool:
            return True

        def readinto(self, buffer: Any) -> int:
            n = int(self.stream.readinto(buffer))
            fetched.append(n)
            return n

    real_filesystem_for = source_module.filesystem_for

    def counting_filesystem_for(uri: str, *, s3_endpoint: str) -> tuple[Any, str]:
        fs, path = real_filesystem_for(uri, s3_endpoint=s3_endpoint)
        wrapped = Recording(fs)
        wrapped.open_input_stream = lambda p, **kw: Counted(fs.open_input_stream(p, **kw))  # type: ignore[method-assign]
        return wrapped, path

    monkeypatch.setattr(source_module, "filesystem_for", counting_filesystem_for)
    monkeypatch.setattr(source_module, "_STREAM_BUFFER", 64 * 1024)
    bucket = s3.root.split("/")[0]
    line = json.dumps({"prompt": "x" * 100}).encode() + b"\n"
    upload(server, f"{bucket}/in/big.jsonl", line * 20_000)  # 2.2 MB

    with source_of(f"s3://{bucket}/in/big.jsonl").open() as handle:
        assert handle.readline() == line
        assert sum(fetched) <= 64 * 1024  # one buffer's read, not the whole object
        assert sum(1 for _ in iter(handle.readline, b"")) == 19_999
    assert max(fetched) <= 64 * 1024 and sum(fetched) == len(line) * 20_000
    assert has_requests(source_of(f"s3://{bucket}/in/big.jsonl"), 1024)


def test_the_cli_file_argument_takes_local_paths_and_checks_s3_uris(server, s3, tmp_path):
    from batchllm.cli.options import InputFile

    bucket = s3.root.split("/")[0]
    upload(server, f"{bucket}/in/prompts.jsonl", b'{"prompt": "hi"}\n')
    local = tmp_path / "prompts.jsonl"
    local.write_text('{"prompt": "hi"}\n')
    param = InputFile()

    resolved = param.convert(str(local), None, None)
    assert (resolved.name, resolved.uri, resolved.format) == (str(local), False, "jsonl")
    uri = f"s3://{bucket}/in/prompts.jsonl"
    resolved = param.convert(uri, None, None)
    assert (resolved.name, resolved.recorded, resolved.uri) == (uri, uri, True)
    with pytest.raises(click.BadParameter, match="no such file"):
        param.convert(f"s3://{bucket}/in/nope.jsonl", None, None)
    with pytest.raises(click.BadParameter, match="does not exist"):
        param.convert(str(tmp_path / "nope.jsonl"), None, None)


def test_an_s3_input_is_stored_as_shards_in_s3_storage(server, s3, tmp_path):
    bucket = s3.root.split("/")[0]
    source = write_items(tmp_path / "in.jsonl", 25, extra=["not json"])
    upload(server, f"{bucket}/in/items.jsonl", source.read_bytes())

    stored = store_input(
        source_of(f"s3://{bucket}/in/items.jsonl"),
        s3,
        "job_in",
        shard_size=10,
        settings=get_settings(),
    )

    assert (stored.total, stored.invalid) == (26, 1)
    assert [s.rows for s in stored.shards] == [10, 10, 6]
    assert s3.listdir(s3.input_dir("job_in")) == [
        "shard-00000.parquet",
        "shard-00001.parquet",
        "shard-00002.parquet",
    ]


# -- whole jobs on the fake engine, storage in the bucket -------------------------------------


def test_a_local_run_of_an_s3_input_writes_its_output_manifest_and_success_to_the_bucket(
    server, s3, s3_settings, tmp_path
):
    settings = s3_settings
    settings.shard_size = 12
    bucket = s3.root.split("/")[0]
    source = write_items(tmp_path / "in.jsonl", 30, extra=["[1, 2]"])
    upload(server, f"{bucket}/in/items.jsonl", source.read_bytes())

    job = run_file(
        f"s3://{bucket}/in/items.jsonl", make_spec(), settings, engines=FakeEngines(FakeEngine())
    )

    assert job.status is JobStatus.COMPLETED
    assert job.input_file == f"s3://{bucket}/in/items.jsonl"
    assert job.output_dir == f"s3://{s3.root}/{job.id}/output"
    out_dir = s3.output_dir(job.id)
    rows = read_output(s3, out_dir).to_pylist()
    assert sorted(r["line"] for r in rows) == list(range(1, 32))
    names = s3.listdir(out_dir)
    assert {MANIFEST_NAME, SUCCESS_NAME} <= set(names)
    assert not [n for n in names if n.startswith(".")]  # no temporary objects
    manifest = json.loads(s3.read_bytes(posixpath.join(out_dir, MANIFEST_NAME)))
    assert manifest["rows"] == {"total": 31, "ok": 30, "error": 1}


def test_a_crash_between_upload_and_checkpoint_leaves_no_duplicate_rows_in_the_bucket(
    s3, s3_settings, tmp_path
):
    settings = s3_settings
    source = write_items(tmp_path / "in.jsonl", 36, extra=["not json"])
    job_id = create_job(
        source_of(source, settings), make_spec(), shard_size=20, settings=settings
    ).job.id
    out_dir = s3.output_dir(job_id)
    with session_scope(settings) as session:
        shard_ids = [s.id for s in session.get(Job, job_id).shards]

    with pytest.MonkeyPatch.context() as patch, pytest.raises(KeyboardInterrupt):
        crash_on_checkpoint(patch, crash_at=3)
        ShardRunner(FakeEngine(), worker="dead", settings=settings).run(shard_ids)
    with session_scope(settings) as session:
        recorded = {c.path for sid in shard_ids for c in commit.checkpoints_of(session, sid)}
        session.execute(
            update(Shard)
            .where(Shard.job_id == job_id)
            .values(heartbeat_at=utcnow() - timedelta(hours=1))
        )
    objects = {posixpath.join(out_dir, n) for n in s3.listdir(out_dir)}
    assert objects - recorded, "the part uploaded before the crash is in the bucket"

    outcomes = ShardRunner(FakeEngine(), worker="alive", settings=settings).run(shard_ids)

    assert set(outcomes.values()) == {Outcome.COMPLETED}
    rows = read_output(s3, out_dir).to_pylist()
    assert collections.Counter(r["line"] for r in rows) == collections.Counter(range(1, 38))
    with session_scope(settings) as session:
        assert session.get(Job, job_id).status is JobStatus.COMPLETED
    assert s3.exists(posixpath.join(out_dir, SUCCESS_NAME))


def test_storage_that_cannot_be_written_fails_the_job_with_the_reason(
    server, s3, s3_settings, monkeypatch, tmp_path
):
    monkeypatch.setenv("BATCHLLM_STORAGE", "s3://no-such-bucket/jobs")
    get_settings.cache_clear()
    settings = get_settings()
    source = write_items(tmp_path / "in.jsonl", 3)

    with pytest.raises(StorageError, match=r"job storage s3://no-such-bucket/jobs: cannot write"):
        create_job(source_of(source, settings), make_spec(), shard_size=10, settings=settings)

    with session_scope(settings) as session:
        (job,) = service.list_jobs(session)
        assert job.status is JobStatus.FAILED
        assert "no-such-bucket" in job.error and job.finished_at is not None


def test_a_local_storage_path_that_cannot_be_made_fails_the_job_too(settings, tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    settings.storage = str(tmp_path / "a-file" / "jobs")

    with pytest.raises(StorageError, match="cannot write"):
        create_from_file(
            write_items(tmp_path / "in.jsonl", 3), make_spec(), settings, shard_size=10
        )

    with session_scope(settings) as session:
        (job,) = service.list_jobs(session)
        assert job.status is JobStatus.FAILED


def test_chat_lines_take_images_from_the_storage_s_bucket(s3: Storage) -> None:
    import io

    from PIL import Image

    from batchllm.input.parsing.line import parse_line
    from batchllm.input.parsing.problems import LineProblem

    encoded = io.BytesIO()
    Image.new("RGB", (12, 9)).save(encoded, "PNG")
    path = posixpath.join(s3.root, "images", "cat.png")
    s3.write_bytes(path, encoded.getvalue())

    def line(url: str) -> dict[str, Any]:
        content = [{"type": "text", "text": "?"}, {"type": "image_url", "image_url": {"url": url}}]
        return {"messages": [{"role": "user", "content": content}]}

    url = s3.display(path)
    assert url.startswith("s3://")
    request = parse_line(line(url), 1, settings=get_settings())
    assert request.messages is not None
    assert request.messages[0]["content"][1] == {"type": "image_url", "image_url": {"url": url}}
    with pytest.raises(LineProblem) as caught:
        parse_line(line(url.replace("cat.png", "dog.png")), 2, settings=get_settings())
    assert caught.value.field == "messages.0.content.1.image_url"
    assert caught.value.message.startswith("no such image object: s3://")
    # Only the storage's bucket (or BATCHLLM_IMAGE_S3_PREFIX): a line cannot make the worker
    # read any object its credentials reach.
    bucket = url.split("/")[2]
    with pytest.raises(LineProblem) as caught:
        parse_line(
            line(url.replace(f"s3://{bucket}/", "s3://someone-elses-bucket/")),
            3,
            settings=get_settings(),
        )
    assert "outside the allowed s3 prefix" in caught.value.message
