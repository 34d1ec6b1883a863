"""What a bench part that starts an engine of its own (features, embed) is run with, after the
shared engine is gone: the model, the repeats and seed, the bench's home, a folder of its own,
and where it tells its progress."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from batchllm.settings import Settings

Say = Callable[[str], None]


@dataclass(frozen=True)
class OwnEnginePart:
    model: str
    repeats: int  # timed repeats of each of the part's contenders
    seed: int
    settings: Settings  # the bench's home (bench_settings)
    workdir: Path  # the part's own folder
    say: Say
    # No torch.compile at the engine's start (`bench --enforce-eager`).
    enforce_eager: bool = False
