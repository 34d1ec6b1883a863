"""A `batchllm run` read back as the engine suites check it: what it printed, the job as
`batchllm status --json` tells it, and the Parquet it wrote (tests/engine/conftest.py's
`run_here` runs both commands in this process on the session's engines)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
from click.testing import Result


def run_and_read(run_here: Callable[..., Result], *run_args: str, home: Path) -> dict[str, Any]:
    """`batchllm run RUN_ARGS` then `batchllm status JOB --json`, both succeeding: "run" (the
    run's Result), "job" (the status), "table" (the output) and "rows" (by custom_id)."""
    ran = run_here("run", *run_args, home=home)
    assert ran.exit_code == 0, ran.output[-4000:]
    job_id = ran.stdout.split("job        ", 1)[1].split()[0]
    status = run_here("status", job_id, "--json", home=home)
    assert status.exit_code == 0, status.output
    job = json.loads(status.stdout)
    table = ds.dataset(job["output_dir"], format="parquet").to_table()
    return {
        "run": ran,
        "job": job,
        "table": table,
        "rows": {r["custom_id"]: r for r in table.to_pylist()},
    }
