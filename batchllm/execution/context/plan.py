"""How a job's max_model_len is settled: one policy, chosen once when the job is created.

- `given` (any front door, --max-model-len): nobody measures; shards go to the fleet as they are
  stored.
- `submit_exact` (`submit`, BATCHLLM_TOKENIZE_AT_SUBMIT=always): submit_pass.py tokenizes every
  prompt as shards are stored.
- `submit_bound` (`submit`, `auto`, a model this machine holds): submit_pass.py bounds short
  prompts by their bytes and tokenizes long ones; a job under AUTO_MIN_ROWS lines is left to
  its first worker.
- `beside_validation` (`run`): passes.BesideValidation, on a thread while validation stores
  shards.
- `on_kept_engine` (`run`, a kept engine up for the model): passes.AfterValidation, on the kept
  engine's loaded tokenizer.
- `at_first_worker` (`submit` of a model this machine does not hold, or `never`): resolve.py,
  the first worker sizes the job from all its rows.

A plan's `preparer` (a ShardPreparer) sees each shard as validation stores it, before the shard
is recorded; jobs/create.py asks the plan whether shards may be released as they are stored
(`given`), as they are sized (`submit_*`), or only once validation ends. Whatever the policy, a
process about to run the job reads (or, `at_first_worker`, makes) the size with
resolve.resolve_max_model_len.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from batchllm.execution.context import submit_pass
from batchllm.execution.context.passes import AfterValidation, BesideValidation
from batchllm.execution.context.submit_pass import SubmitTokens
from batchllm.input.shards import ShardInput
from batchllm.settings import Settings
from batchllm.spec import JobSpec
from batchllm.storage import Storage

log = logging.getLogger(__name__)


class ContextPolicy(enum.Enum):
    GIVEN = "given"
    SUBMIT_EXACT = "submit_exact"
    SUBMIT_BOUND = "submit_bound"
    BESIDE_VALIDATION = "beside_validation"
    ON_KEPT_ENGINE = "on_kept_engine"
    AT_FIRST_WORKER = "at_first_worker"


class ShardPreparer(Protocol):
    """Work on each stored shard before it is recorded and released: `stored` hands a shard
    over, `ready` returns the ones done since the last call (in order, without waiting),
    `finish` waits for the rest and gives the job's sized max_model_len or None,
    `sized_so_far` the max_model_len of the shards `ready` gave so far (None when it cannot
    size the job), `counted` (once `finish` returned) the exact prompt tokens of the job's rows
    when the pass tokenized every one (else None), `close` gives up (the job was not
    created)."""

    def stored(self, shard: ShardInput) -> None: ...

    def ready(self) -> list[ShardInput]: ...

    def finish(self) -> int | None: ...

    def sized_so_far(self) -> int | None: ...

    def counted(self) -> int | None: ...

    def close(self) -> None: ...


@dataclass
class ContextPlan:
    """`preparer`: the pass, or `starts` makes it once jobs/create.py knows the new job's
    storage (`start`): the one place a new job's storage is worked out."""

    policy: ContextPolicy
    preparer: ShardPreparer | None = None
    starts: Callable[[Storage], ShardPreparer] | None = None

    @property
    def has_pass(self) -> bool:
        return self.preparer is not None or self.starts is not None

    def start(self, storage: Storage) -> ShardPreparer | None:
        """The pass over the new job's shards, in `storage` (None: this plan has none)."""
        if self.preparer is None and self.starts is not None:
            self.preparer = self.starts(storage)
        return self.preparer

    @property
    def known_up_front(self) -> bool:
        """Shards may be released as soon as they are stored."""
        return self.policy is ContextPolicy.GIVEN

    @property
    def sized_as_stored(self) -> bool:
        """Shards may be released as the size measured so far covers them."""
        return self.policy in (ContextPolicy.SUBMIT_EXACT, ContextPolicy.SUBMIT_BOUND)

    def failure(self) -> BaseException | None:
        """The error of a pass whose failure fails the job (`run`'s), once `finish` returned."""
        return getattr(self.preparer, "error", None)


def plain_plan(spec: JobSpec) -> ContextPlan:
    """No pass at creation: the size given, or left to the job's first worker."""
    if spec.engine.max_model_len is not None:
        return ContextPlan(ContextPolicy.GIVEN)
    return ContextPlan(ContextPolicy.AT_FIRST_WORKER)


def plan_for_submit(spec: JobSpec, settings: Settings) -> ContextPlan:
    """`submit`'s plan: the token pass where this machine holds the model (a local directory
    with tokenizer.json and config.json) and BATCHLLM_TOKENIZE_AT_SUBMIT allows it. `always`
    stores every prompt's ids even for a job whose size is given."""
    mode = settings.tokenize_at_submit
    model = Path(spec.model)
    local = (model / "tokenizer.json").is_file() and (model / "config.json").is_file()
    given = spec.engine.max_model_len is not None
    if mode == "never" or not local or (mode == "auto" and given):
        return plain_plan(spec)
    if mode == "always":
        policy = ContextPolicy.GIVEN if given else ContextPolicy.SUBMIT_EXACT
        return ContextPlan(policy, starts=lambda storage: SubmitTokens(spec, storage, settings))
    return ContextPlan(
        ContextPolicy.SUBMIT_BOUND,
        starts=lambda storage: SubmitTokens(
            spec, storage, settings, min_rows=submit_pass.AUTO_MIN_ROWS, bound=True
        ),
    )


def plan_for_run(
    spec: JobSpec, settings: Settings, *, size_on_kept: Callable[[list[str]], int] | None = None
) -> ContextPlan:
    """`run`'s plan: sized beside validation, or after it on a kept engine up for the model
    (`size_on_kept(paths)`: its tokenizer is loaded, where this process would take seconds to
    load one, most of a small job's time)."""
    if spec.engine.max_model_len is not None:
        return ContextPlan(ContextPolicy.GIVEN)
    if size_on_kept is not None:
        return ContextPlan(ContextPolicy.ON_KEPT_ENGINE, AfterValidation(size_on_kept))
    return ContextPlan(
        ContextPolicy.BESIDE_VALIDATION,
        starts=lambda storage: BesideValidation(spec, storage, settings),
    )
