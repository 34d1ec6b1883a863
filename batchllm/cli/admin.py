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
@click.option(
    "--lora",
    "adapters",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Also write this many tiny random LoRA adapters to DIRECTORY/adapters/lora-<i>.",
)
def demo_model(directory: Path, seed: int, adapters: int) -> None:
    """Build a tiny random-weight Llama model with its tokenizer in DIRECTORY (no download).

    Its output is gibberish; it exists to exercise the whole path on any machine.

    \b
    Example:
      batchllm demo-model ./tiny-model --lora 2
    """
    from batchllm.engine.demo_model import build_demo_adapters, build_demo_model

    path = build_demo_model(directory, seed=seed)
    click.echo(f"demo model written to {path}")
    for adapter in build_demo_adapters(directory, adapters, seed=seed):
        click.echo(f"LoRA adapter written to {adapter}")
