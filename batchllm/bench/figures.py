"""What one timed run measured, and the median and spread over a contender's repeats."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from batchllm.errors import BatchLLMError

if TYPE_CHECKING:
    from batchllm.store.models import Job


class BenchFailed(BatchLLMError):
    """A contender did not finish its work, so its figures would mean nothing."""


@dataclass
class Run:
    seconds: float  # wall time the user waits for this contender's work
    requests: int
    prompt_tokens: int
    output_tokens: int
    peak_rss: int  # bytes, the whole process tree
    failed: int = 0
    # End-to-end contenders start their own engine: the part of `seconds` spent generating.
    generation_seconds: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def job_run(
    job: Job,
    *,
    seconds: float,
    peak_rss: int,
    generation_seconds: float | None = None,
    **extra: Any,
) -> Run:
    """An ended batchllm job as a run: its requests (error rows among them, counted failed)
    and tokens as the job recorded them, and its id beside `extra`."""
    return Run(
        seconds=seconds,
        requests=job.request_completed + job.request_failed,
        prompt_tokens=job.prompt_tokens,
        output_tokens=job.completion_tokens,
        failed=job.request_failed,
        peak_rss=peak_rss,
        generation_seconds=generation_seconds,
        extra={"job_id": job.id, **extra},
    )


@dataclass
class Contender:
    key: str
    label: str
    runs: list[Run] = field(default_factory=list)
    end_to_end: bool = False  # a subprocess that pays for its own engine start-up

    def summary(self) -> dict[str, Any]:
        def spread(values: list[float]) -> dict[str, float]:
            return {"median": statistics.median(values), "min": min(values), "max": max(values)}

        runs = self.runs
        out = {
            "label": self.label,
            "end_to_end": self.end_to_end,
            "repeats": len(runs),
            "requests": runs[0].requests,
            "failed": max(r.failed for r in runs),
            "prompt_tokens": runs[0].prompt_tokens,
            "output_tokens": runs[0].output_tokens,
            "wall_seconds": spread([r.seconds for r in runs]),
            "requests_per_s": spread([r.requests / r.seconds for r in runs]),
            "output_tokens_per_s": spread([r.output_tokens / r.seconds for r in runs]),
            "total_tokens_per_s": spread(
                [(r.prompt_tokens + r.output_tokens) / r.seconds for r in runs]
            ),
            "peak_rss_bytes": max(r.peak_rss for r in runs),
            "runs": [asdict(r) for r in runs],
        }
        generation = [(r, seconds) for r in runs if (seconds := r.generation_seconds)]
        if generation:
            out["generation_seconds"] = spread([seconds for _, seconds in generation])
            out["generation_output_tokens_per_s"] = spread(
                [r.output_tokens / seconds for r, seconds in generation]
            )
        return out
