"""What `batchllm engine status` and `stop` ask of the kept engines."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from batchllm.errors import BatchLLMError
from batchllm.kept_engine import registry
from batchllm.kept_engine.client import RemoteEngine

log = logging.getLogger(__name__)

_STOP_WAIT = 60.0  # vLLM's shutdown takes seconds; a wedged engine gets SIGKILL after this


def engine_statuses(home: Path) -> list[dict[str, Any]]:
    """The kept engines of the batchllm home `home`, each asked for its live figures."""
    rows = []
    for record in registry.list_records(home):
        row: dict[str, Any] = {
            "id": record.id,
            "state": record.state,
            "model": record.model,
            "kind": record.kind,
            "pid": record.pid,
            "max_model_len": record.max_model_len,
        }
        if record.state == registry.READY:
            try:
                remote = RemoteEngine(record, keep_alive=None)
                live = remote.status()
                remote.shutdown()
            except BatchLLMError as exc:
                row["state"] = f"unreachable ({exc})"
            else:
                keep = live["keep_alive"]
                row.update(
                    runs=live["runs"] - 1,  # not this connection
                    in_flight=live["in_flight"],
                    runs_served=live["runs_served"] - 1,
                    idle_seconds=live["idle_seconds"],
                    keep_alive=None if keep == float("inf") else keep,
                )
        rows.append(row)
    return rows


def stop_engines(home: Path, prefix: str | None, *, force: bool) -> list[str]:
    """Stop the kept engines of `home` (one by id prefix, or every one): a line for each."""
    records = registry.list_records(home) if prefix is None else [registry.find(home, prefix)]
    lines = []
    for record in records:
        lines.append(_stop(home, record, force=force))
    return lines or ["no kept engines"]


def _stop(home, record: registry.EngineRecord, *, force: bool) -> str:
    if record.state == registry.READY:
        try:
            remote = RemoteEngine(record, keep_alive=None)
            answer = remote.stop(force=force)
            remote.shutdown()
        except BatchLLMError:
            answer = {"stopped": True, "runs": 0}
        if not answer["stopped"]:
            return (
                f"{record.id}: {answer['runs']} run(s) use it; it unloads when they end "
                "(--force: now)"
            )
    else:  # still starting: it cannot answer yet
        os.kill(record.pid, signal.SIGTERM)
    deadline = time.monotonic() + _STOP_WAIT
    while registry.alive(record.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if registry.alive(record.pid):
        log.warning("kept engine %s did not stop in %g s: killing it", record.id, _STOP_WAIT)
        os.kill(record.pid, signal.SIGKILL)
    registry.list_records(home)  # forgets it
    return f"{record.id}: unloaded ({record.model})"
