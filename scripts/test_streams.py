"""`make test`: the suite as three pytest sessions at once, their output interleaved by line.

Why: on a 2-core machine the fleet suites (tests/integration, tests/faults) spend much of their
time waiting - for a lease to expire, a Redis or PostgreSQL restart, a worker's engine build in
another process, a poll - while the engine, unit, security and smoke suites keep the cores busy.
Run one after the other they took ~70 minutes here; side by side the waits overlap the work.
The sessions share nothing a test relies on: the fleet tests use their own Redis databases,
PostgreSQL databases and private servers, the others SQLite homes in their own tmp dirs, and
every test ends only the processes it started.

Each line is prefixed with its stream's name ([fleet], [local], [unit], or [lint] for `make
lint`, which runs beside them); each stream prints its own
summary and slowest tests. The exit code is non-zero when any session failed.
Extra arguments go to every pytest session (e.g. `-x`, `-k name`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

BUILDS_LINE = "engine builds: "
# Balanced by measurement: the fault tests of `batchllm run` (SQLite, no broker) and of `serve
# --worker`'s signals (a private redis-server of their own, SQLite) need none of the fleet's
# services and run beside the unit and engine suites, where they shorten the fleet session, the
# long pole (test_run_interrupt's two engines: ~2-3 minutes; test_serve_signals' three cases:
# ~1.4). A fresh clone on a quiet machine, 2026-12-03, before serve_signals moved: fleet
# 19:09, local 12:09; after: fleet 17:50, local 13:58. Then the local session lost two engine
# builds (the embedding jobs on the bench's engine) and these two moved as well, each on
# databases of its own: test_real_model_api (its session's `fleet_env`, a PostgreSQL and a
# Redis database no other session uses; ~1.5-3 minutes, two engines, and the SmolLM2
# conversion test_real_models pays for in this session anyway) and test_warm_start (a SQLite
# home and a Redis database the bench's warm part claims for itself; ~1-1.3 minutes).
MOVED_TO_LOCAL = [
    "tests/faults/test_run_interrupt.py",
    "tests/faults/test_run_killed.py",
    "tests/faults/test_run_sigterm.py",  # ~15 s: SIGTERM to `run` (SQLite, no service)
    "tests/integration/test_real_model_api.py",
    "tests/integration/test_warm_start.py",
]
# The engine-free suites (unit, security, smoke) are a third session: a fresh clone, 2026-12-04,
# with two sessions: fleet 17:51, local (those suites in it) 18:49, a quarter of the two cores
# idle; with them apart: unit 3:43, local 15:12, fleet 17:31. So the third session then takes
# these from the other two (each on services of its own, as above): ~3.5 minutes of fleet
# tests that run on instant workers, and serve's signal cases (~2 minutes, a private
# redis-server of their own). Measured with them: unit 11:21, local 14:25, fleet 16:32 (the fault
# suite's engine builds and outages, one after the other, are its long pole); so test_fleet_lora
# (one engine build, ~2 minutes under load) moved too.
MOVED_TO_UNIT = [
    "tests/integration/test_fleet_lora.py",
    "tests/integration/test_instant_worker.py",
    "tests/integration/test_priority_webhooks.py",
    "tests/integration/test_pipeline_fleet.py",
    "tests/integration/test_dashboard_browser.py",
    "tests/faults/test_serve_signals.py",
    # Kept engines on the instant engine (~2 minutes, SQLite homes of their own, no services).
    "tests/integration/test_kept_engine.py",
    # The chaos harness's quick run (~2 minutes): its own private Redis and PostgreSQL and
    # instant workers, so it need not lengthen the fleet session, the long pole.
    "tests/faults/test_chaos.py",
]
STREAMS = {
    "fleet": [
        "tests/integration",
        "tests/faults",
        *(f"--ignore={path}" for path in MOVED_TO_LOCAL + MOVED_TO_UNIT),
    ],
    "local": ["tests/engine", *MOVED_TO_LOCAL],
    "unit": ["tests/unit", "tests/security", "tests/smoke", *MOVED_TO_UNIT],
}


def pump(
    name: str, proc: subprocess.Popen[str], lock: threading.Lock, builds: dict[str, int]
) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        # Each session's closing lines count its engine builds (tests/conftest.py).
        if line.startswith(BUILDS_LINE):
            builds[name] = int(line.removeprefix(BUILDS_LINE))
        with lock:
            sys.stdout.write(f"[{name}] {line}")
            sys.stdout.flush()


def main(extra: list[str]) -> int:
    lock = threading.Lock()
    started = time.monotonic()
    procs: dict[str, subprocess.Popen[str]] = {}
    builds: dict[str, int] = {}
    threads = []
    # `make lint` (ruff, mypy: ~1-1.5 minutes here, mypy's cache empty in a fresh clone) runs
    # beside the sessions instead of before them; it fails `make test` all the same.
    commands = {"lint": ["make", "--no-print-directory", "lint"]}
    for name, paths in STREAMS.items():
        # -v: one line per test, so interleaved output still says which test each line is.
        # no cacheprovider: the sessions would all write .pytest_cache at their end.
        commands[name] = [
            *(sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider"),
            *paths,
            *extra,
        ]
    for name, command in commands.items():
        procs[name] = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        thread = threading.Thread(target=pump, args=(name, procs[name], lock, builds), daemon=True)
        thread.start()
        threads.append(thread)
    codes = {name: proc.wait() for name, proc in procs.items()}
    for thread in threads:
        thread.join()
    minutes = (time.monotonic() - started) / 60
    summary = ", ".join(f"{name} exit {code}" for name, code in codes.items())
    counted = ", ".join(f"{name} {count}" for name, count in builds.items())
    print(f"test streams: {summary}; {minutes:.1f} min in all")
    print(f"engine builds: {sum(builds.values())} in all ({counted})")
    # pytest's 5 is "no tests collected": a stream filtered empty by -k is not a failure.
    passed = all(code == 0 or (code == 5 and name != "lint") for name, code in codes.items())
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
