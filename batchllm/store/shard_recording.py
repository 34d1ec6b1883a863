"""Recording a job's shards as validation stores them, and releasing them to the fleet before
the whole file is validated.

With a `release` (the fleet's dispatch), the shards stored so far are committed `queued` and
released while validation goes on (a 10M-line file takes ~70 s here), a batch every half second
(the first at once) rather than a commit and broker round trip per shard. The job stays
`validating` until state_machine.end_validation fixes its counts; until then no shard's end can
finalize it (state_machine.after_last_shard). Without a release (`batchllm run`), under
--strict, and for an unsized job (sized from all its rows, execution/context/resolve.py) every shard is
recorded in the transaction that ends the validation; except an unsized job tokenized at submit
(execution/context/submit_pass.py): a shard goes once the job's max_model_len, which only grows,
covers it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sqlalchemy import update
from sqlalchemy.orm import Session

from batchllm.input.shards import ShardInput
from batchllm.settings import Settings
from batchllm.store.db import session_scope
from batchllm.store.models import Job, Shard, ShardStatus

log = logging.getLogger(__name__)

RELEASE_EVERY_SECONDS = 0.5

# The fleet's dispatch of a job's recorded shards: release(job_id, shard_ids).
ReleaseShards = Callable[[str, list[int]], None]


class ShardRecorder:
    def __init__(
        self,
        settings: Settings,
        job_id: str,
        release: ReleaseShards | None,
        *,
        stream: bool,
    ) -> None:
        self.settings, self.job_id, self.release, self.stream = settings, job_id, release, stream
        self._pending: list[ShardInput] = []
        self._unreleased: list[int] = []  # recorded at the end, released after its commit
        self._released_at: float | None = None

    def add(self, shard: ShardInput) -> None:
        """A shard validation just stored."""
        self._pending.append(shard)
        if not self.stream:
            return
        now = time.monotonic()
        if self._released_at is None or now - self._released_at >= RELEASE_EVERY_SECONDS:
            self._released_at = now
            with session_scope(self.settings) as session:
                ids = self._record(session, count_them=True)
            self._release(ids)

    def record_rest(self, session: Session) -> None:
        """Record the shards not recorded yet, in the caller's transaction (the one that ends
        the validation and sets the job's final counts)."""
        self._unreleased = self._record(session, count_them=False)

    def release_rest(self) -> None:
        """Release what record_rest recorded, once its transaction is committed."""
        ids, self._unreleased = self._unreleased, []
        self._release(ids)

    def _record(self, session: Session, *, count_them: bool) -> list[int]:
        shards = [
            Shard(
                job_id=self.job_id,
                index=shard.index,
                status=ShardStatus.QUEUED,
                input_path=shard.path,
                rows=shard.rows,
                first_line=shard.first_line,
                last_line=shard.last_line,
            )
            for shard in self._pending
        ]
        self._pending = []
        session.add_all(shards)
        session.flush()  # their ids
        if count_them and shards:
            # The job's progress shows the lines stored so far; end_validation sets the totals.
            session.execute(
                update(Job)
                .where(Job.id == self.job_id)
                .values(
                    shards_total=Job.shards_total + len(shards),
                    request_total=Job.request_total + sum(s.rows for s in shards),
                )
            )
        return [shard.id for shard in shards]

    def _release(self, ids: list[int]) -> None:
        if self.release is None or not ids:
            return
        self.release(self.job_id, ids)
