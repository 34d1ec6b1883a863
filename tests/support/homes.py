"""Fresh BATCHLLM_HOMEs that open at once: seeded with a copy of a database the session migrated
once (the `migrated_database` fixture in tests/conftest.py); and a home's newest job, read from
outside the `batchllm run` that writes it."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path


def seed_home(home: Path, database: Path) -> Path:
    """`home` with a copy of the migrated database where batchllm looks for it."""
    home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(database, home / "batchllm.db")
    return home


def latest_job(home: Path) -> dict | None:
    """The newest job row in the home's SQLite database, read straight from the file (WAL:
    readable while a run writes it); None before the run has created its database or job."""
    db = home / "batchllm.db"
    if not db.exists():
        return None
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=2) as conn:
            conn.row_factory = sqlite3.Row
            row = conn.execute("SELECT * FROM jobs ORDER BY created_at DESC LIMIT 1").fetchone()
            return dict(row) if row else None
    except sqlite3.Error:
        return None
