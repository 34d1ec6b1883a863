"""Ending a job tidies its output as part of the transaction that ends it, whoever ends it: no
caller calls a tidy of its own (output/commit.py registers it as a `before_commit` hook)."""

from __future__ import annotations

import posixpath
import subprocess
import sys

import pytest

from batchllm.output.parts import part_name
from batchllm.storage import Storage
from batchllm.store import service, state_machine
from batchllm.store.db import session_scope
from batchllm.store.models import Job, JobStatus
from tests.support.fake_runs import create_items_job


def _job_with_stray_part(settings, tmp_path) -> tuple[str, Storage, str]:
    """A queued job whose output holds a part file no checkpoint records (a worker died
    between writing it and committing it)."""
    job_id, shard_ids = create_items_job(settings, tmp_path, 4, shard_size=2)
    storage = Storage.of(settings)
    path = posixpath.join(storage.output_dir(job_id), part_name(shard_ids[0], 0))
    storage.write_bytes(path, b"not recorded")
    return job_id, storage, path


def test_failing_a_job_without_a_worker_removes_its_unrecorded_parts(settings, tmp_path):
    job_id, storage, path = _job_with_stray_part(settings, tmp_path)
    with session_scope(settings) as session:
        state_machine.fail_job(session, job_id, "recovery failed")
    with session_scope(settings) as session:
        assert session.get(Job, job_id).status is JobStatus.FAILED
    assert not storage.exists(path)


def test_a_rolled_back_end_keeps_the_job_and_its_files(settings, tmp_path):
    job_id, storage, path = _job_with_stray_part(settings, tmp_path)
    with pytest.raises(RuntimeError), session_scope(settings) as session:
        state_machine.fail_job(session, job_id, "recovery failed")
        raise RuntimeError("the transaction fails before its commit")
    with session_scope(settings) as session:
        assert session.get(Job, job_id).status is not JobStatus.FAILED
    assert storage.exists(path)


ENTRY_POINTS = ["batchllm.client", "batchllm.cli", "batchllm.api.app", "batchllm.worker.tasks"]


@pytest.fixture(scope="module")
def registered() -> dict[str, subprocess.CompletedProcess]:
    """What each entry point registers, each imported in a fresh process of its own; the four
    processes run at once (each spends seconds importing)."""
    procs = {}
    for entry in ENTRY_POINTS:
        code = (
            f"import importlib; importlib.import_module({entry!r}); import batchllm.cli.run\n"
            "from batchllm.store import db\n"
            "print(sorted(f.__name__ for f in db._BEFORE_COMMIT))"
        )
        if entry == "batchllm.cli":
            code = code.replace("; import batchllm.cli.run", "; from batchllm.client import Client")
        procs[entry] = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    done = {}
    for entry, proc in procs.items():
        out, err = proc.communicate(timeout=240)
        done[entry] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_entry_point_registers_the_tidy(entry, registered):
    out = registered[entry]
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "['tidy_ended_jobs']"
