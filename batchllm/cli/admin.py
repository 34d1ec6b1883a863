"""Setup commands: `db upgrade`, `demo-model`."""

from __future__ import annotations

from pathlib import Path

import click

from batchllm.cli import cli


@cli.group()
def db() -> None:
    """Database schema management."""


@db.command()
def upgrade() -> None:
    """Apply all migrations to BATCHLLM_DATABASE_URL (SQLite does this by itself)."""
    from batchllm.jobs.db import upgrade as run_upgrade
    from batchllm.settings import get_settings

    url = get_settings().resolved_database_url
    run_upgrade(url)
    click.echo("database is at the newest schema")


@cli.command("demo-model")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--seed", type=int, default=0, show_default=True)
def demo_model(directory: Path, seed: int) -> None:
    """Build a tiny random-weight Llama model with its tokenizer in DIRECTORY (no download).

    Its output is gibberish; it exists to exercise the whole path on any machine.
    """
    from batchllm.engine.demo_model import build_demo_model

    path = build_demo_model(directory, seed=seed)
    click.echo(f"demo model written to {path}")
