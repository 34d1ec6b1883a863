"""While an engine is built in the owning process, the building thread's writes to sys.stderr
go to the process's fd 2 (a quiet command's log file), other threads' to the console: vLLM's
progress bars stay out of a worker's or a run's console (process/engine_output.py)."""

from __future__ import annotations

import io
import sys
import threading

from batchllm.process.engine_output import engine_output_to_log


def test_the_building_threads_output_goes_to_the_log_and_other_threads_to_the_console(
    monkeypatch,
) -> None:
    console, log = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "__stderr__", log)
    monkeypatch.setattr(sys, "stderr", console)
    with engine_output_to_log():
        sys.stderr.write("Loading safetensors checkpoint shards\n")
        other = threading.Thread(target=lambda: sys.stderr.write("job created\n"))
        other.start()
        other.join()
    sys.stderr.write("done\n")
    assert log.getvalue() == "Loading safetensors checkpoint shards\n"
    assert console.getvalue() == "job created\ndone\n"
    assert sys.stderr is console  # restored


def test_nothing_changes_where_the_streams_were_not_made_quiet(monkeypatch) -> None:
    same = io.StringIO()
    monkeypatch.setattr(sys, "__stderr__", same)
    monkeypatch.setattr(sys, "stderr", same)
    with engine_output_to_log():
        assert sys.stderr is same
        sys.stderr.write("x")
    assert same.getvalue() == "x"
