"""A fresh SQLite database opened by several processes at once migrates exactly once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import sqlalchemy

REPO = Path(__file__).resolve().parents[2]
OPEN = (
    "import sys; from batchllm.store.db import upgrade; "
    "upgrade(f'sqlite:///{sys.argv[1]}'); print('ok')"
)


def test_processes_opening_a_fresh_database_together_all_succeed(tmp_path):
    database = tmp_path / "home" / "batchllm.db"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", OPEN, str(database)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    results = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0, 0], [err[-800:] for _, err in results]
    assert [out.strip() for out, _ in results] == ["ok"] * 4
    engine = sqlalchemy.create_engine(f"sqlite:///{database}")
    with engine.connect() as conn:
        versions = conn.execute(sqlalchemy.text("select version_num from alembic_version")).all()
        columns = {row[1] for row in conn.execute(sqlalchemy.text("pragma table_info(jobs)"))}
    engine.dispose()
    assert len(versions) == 1
    assert "expires_at" in columns
