"""A job's input is resolved once where it comes in (input/files/source.py): what a resolved source
says about a local file, the refusals, and a whole `Client.run`, `submit`-free, that resolves
its file exactly once however many layers read it. (s3:// sources: test_storage_s3.py.)"""

from __future__ import annotations

import pytest

from batchllm import Client
from batchllm.errors import InputError
from batchllm.input.files import source as source_module
from batchllm.input.files.source import InputSource, resolve_input
from tests.support.fake_runs import FakeEngine, FakeEngines, small_commits, write_items


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("in.jsonl", "jsonl"),
        ("in.parquet", "parquet"),
        ("in.PQ", "parquet"),
        ("in.csv", "csv"),
        ("in.txt", "jsonl"),
    ],
)
def test_a_local_file_is_resolved_with_its_format_and_both_its_names(
    tmp_path, monkeypatch, name, fmt
):
    (tmp_path / name).write_text("x\n")
    monkeypatch.chdir(tmp_path)

    found = resolve_input(name, s3_endpoint="")

    assert (found.name, found.recorded, found.uri, found.format) == (
        name,
        str(tmp_path / name),
        False,
        fmt,
    )
    assert found.table_format == (None if fmt == "jsonl" else fmt)
    with found.open() as handle:
        assert handle.read() == b"x\n"
    assert resolve_input(found, s3_endpoint="other") is found  # resolved once, kept


def test_a_missing_file_or_a_directory_is_refused_by_name(tmp_path):
    with pytest.raises(InputError, match=r"nothere.jsonl: no such file"):
        resolve_input(tmp_path / "nothere.jsonl", s3_endpoint="")
    with pytest.raises(InputError, match="is a directory, not an input file"):
        resolve_input(tmp_path, s3_endpoint="")


def test_a_run_resolves_its_input_once(small_commits, tmp_path, monkeypatch):
    resolved: list[str] = []
    real_format = source_module._format

    def counting(name: str) -> str:
        resolved.append(name)
        return real_format(name)

    monkeypatch.setattr(source_module, "_format", counting)
    path = write_items(tmp_path / "in.jsonl", 12)

    job = Client(small_commits).run(
        path, model="/models/fake", max_model_len=64, engines=FakeEngines(FakeEngine())
    )

    assert job.status == "completed" and job.total == 12
    assert resolved == [str(path)]
    assert isinstance(resolve_input(path, s3_endpoint=""), InputSource)
