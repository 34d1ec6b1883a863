"""A cold `run`'s engine process started by the console script before the CLI is imported
(batchllm/kept_engine/early.py): when it is started (only where the run would start a spare
itself), and that one the run never adopts ends when the run's pipe closes, leaving no file.
Its adoption by a real run is tests/engine/test_kept_engine_vllm.py's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from batchllm.kept_engine.early import CONFIG_ON_STDIN, wanted
from tests.support.cli import REPO


@pytest.mark.parametrize(
    ("argv", "env_keep_alive", "expected"),
    [
        (["run", "f.jsonl", "--model", "m"], None, True),
        (["-v", "run", "f.jsonl", "--model", "m", "--keep-alive", "10m"], "0", True),
        (["run", "f.jsonl", "--model", "m", "--engine", "vllm"], None, True),
        (["run", "f.jsonl", "--model", "m"], "0", False),
        (["run", "f.jsonl", "--model", "m", "--keep-alive", "0"], None, False),
        (["run", "f.jsonl", "--model", "m", "--keep-alive=0s"], None, False),
        (["run", "f.jsonl", "--model", "m", "--keep-alive", "soon"], None, False),
        (["run", "f.jsonl", "--model", "m", "--engine", "instant"], None, False),
        (["run", "f.jsonl", "--model", "m", "--engine=instant"], None, False),
        (["run", "f.jsonl", "--model", "m", "--dry-run"], None, False),
        (["run", "--help"], None, False),
    ],
)
def test_it_is_wanted_only_where_the_run_would_start_a_spare(
    argv: list[str],
    env_keep_alive: str | None,
    expected: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if env_keep_alive is None:
        monkeypatch.delenv("BATCHLLM_KEEP_ALIVE", raising=False)
    else:
        monkeypatch.setenv("BATCHLLM_KEEP_ALIVE", env_keep_alive)
    assert wanted(argv, tmp_path) is expected


def test_not_wanted_while_a_kept_engine_of_the_home_is_up_or_starting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BATCHLLM_KEEP_ALIVE", raising=False)
    argv = ["run", "f.jsonl", "--model", "m"]
    assert wanted(argv, tmp_path)
    (tmp_path / "eng_0123abcd.json").write_text(json.dumps({"state": "starting"}))
    assert not wanted(argv, tmp_path)


def test_one_never_adopted_ends_when_the_pipe_closes_and_removes_its_log(tmp_path: Path) -> None:
    log = tmp_path / "early-1.log"
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "batchllm.kept_engine.server", CONFIG_ON_STDIN, str(log)],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    assert process.stdin is not None  # closed at once: before or during its import, it ends
    process.stdin.close()
    try:
        code = process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert code == 0
    assert not log.exists()
