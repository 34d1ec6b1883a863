"""batchllm: batch inference jobs over vLLM, JSONL in, Parquet out, throughput in SQL.

`from batchllm import Client` is the Python API (batchllm/client.py); importing it loads
neither vllm nor torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from batchllm.client import Client, Job
    from batchllm.input.job_rows import JobRows

__all__ = ["Client", "Job", "JobRows", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy: `batchllm --help` imports this package and must stay instant.
    if name in ("Client", "Job"):
        from batchllm import client

        return getattr(client, name)
    if name == "JobRows":  # another job's rows as a job's input (`--from`)
        from batchllm.input.job_rows import JobRows

        return JobRows
    raise AttributeError(name)
