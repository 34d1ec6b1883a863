"""Fresh BATCHLLM_HOMEs that open at once: seeded with a copy of a database the session migrated
once (the `migrated_database` fixture in tests/conftest.py)."""

from __future__ import annotations

import shutil
from pathlib import Path


def seed_home(home: Path, database: Path) -> Path:
    """`home` with a copy of the migrated database where batchllm looks for it."""
    home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(database, home / "batchllm.db")
    return home
