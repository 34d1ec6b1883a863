"""The failure reports' tail of a quiet worker's named log (tests/support/worker_logs.py)."""

from __future__ import annotations

from tests.support.worker_logs import named_log_tail


def test_the_log_the_console_names_is_tailed(tmp_path):
    named = tmp_path / "logs" / "worker-20261130-180000-42.log"
    named.parent.mkdir()
    named.write_text("".join(f"engine line {i}\n" for i in range(100)))
    console = (
        "2026-11-30 18:00:00 INFO batchllm.cli.fleet: "
        f"vLLM's output goes to {named} (-v shows it here)\n"
        "2026-11-30 18:00:05 INFO celery.worker: w1@test ready.\n"
    )
    tail = named_log_tail(console, lines=3)
    assert tail.splitlines() == [
        "",
        f"--- named log {named} (tail) ---",
        "engine line 97",
        "engine line 98",
        "engine line 99",
    ]


def test_a_console_naming_no_log_adds_nothing_and_a_missing_log_says_so(tmp_path):
    assert named_log_tail("w1@test ready.\n") == ""
    gone = tmp_path / "worker-gone.log"
    assert "unreadable" in named_log_tail(f"vLLM's output goes to {gone} (-v shows it here)")
