"""A job that waits for its follower, for the tests of `results --follow` and
`Client.iter_results(follow=True)`: rows must be seen while the job runs, whatever the machine's
pace, so the job pauses once a part is committed until the follower has read a row."""

from __future__ import annotations

import threading

from sqlalchemy import func, select

from batchllm.settings import Settings
from batchllm.store.db import session_scope
from batchllm.store.models import Checkpoint, Job, Shard


class HeldForFollower:
    """Pass `created` as the run's on_created and `progress` as its on_progress; call
    `follower_saw_a_row.set()` once the follower has a row (and in a `finally`)."""

    def __init__(self, settings: Settings, *, wait_seconds: float) -> None:
        self.settings = settings
        self.wait_seconds = wait_seconds
        self.created_ids: list[str] = []
        self.ready = threading.Event()
        self.follower_saw_a_row = threading.Event()

    @property
    def job_id(self) -> str:
        return self.created_ids[0]

    def created(self, job: Job) -> None:
        self.created_ids.append(job.id)
        self.ready.set()

    def progress(self, rows: int, tokens: int) -> None:
        if self.follower_saw_a_row.is_set():
            return
        with session_scope(self.settings) as session:
            committed = session.scalar(
                select(func.count())
                .select_from(Checkpoint)
                .join(Shard)
                .where(Shard.job_id == self.job_id)
            )
        if committed:
            self.follower_saw_a_row.wait(self.wait_seconds)
