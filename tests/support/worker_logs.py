"""A quiet `batchllm worker`'s console and named log: the tail of that log for failure reports,
and the checks that each holds what it should.

A worker's console keeps only batchllm's and Celery's lines; vLLM's output, its engine
processes' output and tracebacks printed by libraries go to the log file the console names in
its first lines ("vLLM's output goes to PATH"). A failing test shows both tails."""

from __future__ import annotations

import os
import re
from pathlib import Path

_NAMED = re.compile(r"vLLM's output goes to (\S+\.log)")


def named_log_tail(console: str, lines: int = 40) -> str:
    """The last `lines` of the log file named in this console output, with a heading; empty
    when the console names none (a `-v` worker shows everything on its console)."""
    found = _NAMED.search(console)
    if found is None:
        return ""
    path = Path(found.group(1))
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"\n--- named log {path}: unreadable ({exc}) ---"
    tail = "\n".join(text.splitlines()[-lines:])
    return f"\n--- named log {path} (tail) ---\n{tail}"


# -- the quiet console's checks (test_worker_console's instant workers, test_fleet_lora's vLLM
# worker): the console holds whole batchllm and Celery lines, the named log everything else.

# A whole console line in the text format: time, level, and a batchllm or Celery logger.
TEXT_LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) "
    r"(batchllm|celery)(\.[\w.]+)?: "
)
NOTICE = re.compile(r"vLLM's output goes to (\S+\.log) \(-v shows it here\)")
# What vLLM and the interpreter write, which the console must not show and the file must hold.
ENGINE_PROCESS_LINE = "(EngineCore pid="
VLLM_OWN_LINE = re.compile(r"\((MainProcess|EngineCore) pid=\d+\) (INFO|WARNING) ")


def named_log(console: str, *, home: Path, pid: int) -> Path:
    """The log file the console names: the worker's own, under the home's logs folder."""
    found = NOTICE.search(console)
    assert found, console
    log = Path(found.group(1))
    assert log.parent == home / "logs"
    assert re.fullmatch(rf"worker-\d{{8}}-\d{{6}}-{pid}\.log", log.name), log.name
    return log


def assert_celery_output_in(log: Path) -> str:
    text = log.read_text(errors="replace")
    if os.geteuid() == 0:  # Celery warns about running as root: an interpreter warning
        assert "py.warnings" in text and "SecurityWarning" in text
    assert "[queues]" in text  # Celery's banner: sys.__stdout__, fd 1
    return text


def assert_vllm_output_in(log: Path) -> str:
    text = assert_celery_output_in(log)
    assert VLLM_OWN_LINE.search(text), text[-3000:]
    # vLLM's engine core writes from the worker's own process by default (MainProcess), from
    # an EngineCore process with VLLM_ENABLE_V1_MULTIPROCESSING=1: either lands here.
    assert "Loading safetensors checkpoint shards" in text  # the engine's stderr
    return text


def assert_quiet_vllm_console(console: str, *, name: str, home: Path, pid: int) -> str:
    """A text-format vLLM worker's console (its whole run, stopped): batchllm's and Celery's
    lines only, vLLM's and its engine processes' output in the named log. Returns that log."""
    strays = [line for line in console.splitlines() if not TEXT_LINE.match(line)]
    assert strays == [], "\n".join(strays)
    assert "batchllm.engine.vllm_engine: building vLLM" in console
    assert f"celery.apps.worker: {name} ready." in console
    assert "succeeded in" in console  # Celery's line for the task
    assert ENGINE_PROCESS_LINE not in console and not VLLM_OWN_LINE.search(console)
    return assert_vllm_output_in(named_log(console, home=home, pid=pid))
