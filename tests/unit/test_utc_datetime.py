"""Every timestamp column reads back as an aware UTC datetime, SQLite included (which stores
none), while the stored format stays what the migrations create."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sqlalchemy import create_engine, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session

from batchllm.store.models import Base, Job, JobStatus, UTCDateTime


def test_sqlite_timestamps_read_back_aware_in_utc_and_compare_with_now():
    engine = create_engine("sqlite://")
    Base.metadata.create_all(engine)
    started = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    with Session(engine) as session:
        session.add(
            Job(
                id="job_1",
                status=JobStatus.QUEUED,
                model="m",
                spec={},
                input_file="in.jsonl",
                storage_root="/tmp",
                output_dir="/tmp/job_1/output",
                started_at=started,
            )
        )
        session.commit()
        stored = session.execute(text("SELECT started_at FROM jobs")).scalar_one()
    with Session(engine) as session:
        job = session.get(Job, "job_1")
        assert job is not None
        assert job.started_at == started
        assert job.started_at.tzinfo is not None
        assert job.created_at < datetime.now(timezone.utc) + timedelta(seconds=1)
    assert stored == "2026-01-02 03:04:05.000000"  # SQLite's own format, unchanged


def test_the_column_type_is_the_migrations_timezone_aware_datetime():
    assert UTCDateTime().compile(dialect=postgresql.dialect()) == "TIMESTAMP WITH TIME ZONE"
    for column in Job.__table__.columns:
        if column.name.endswith("_at"):
            assert isinstance(column.type, UTCDateTime), column.name
