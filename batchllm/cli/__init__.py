"""The `batchllm` command. Each command is a thin layer over one library call.

Heavy modules (pyarrow, sqlalchemy, and above all vllm/torch) are imported inside commands, so
`batchllm --help` is instant and importing this package never loads vllm or torch.
"""

from __future__ import annotations

import logging
import os
import sys

import click

from batchllm import __version__
from batchllm.errors import BatchLLMError, JobInterrupted


class _Group(click.Group):
    """Turns deliberate batchllm errors and database failures into one clear line and exit
    code 1, not a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except BatchLLMError as exc:
            click.secho(f"error: {exc}", fg="red", err=True)
            _name_the_log()
            sys.exit(130 if isinstance(exc, JobInterrupted) else 1)  # 130: the shell's Ctrl-C
        except Exception as exc:
            message = _database_problem(exc)
            if message is None:
                raise
            click.secho(f"error: {message}", fg="red", err=True)
            sys.exit(1)


def _name_the_log() -> None:
    """After a failure in a quiet command, say where vLLM's full output is."""
    console = sys.modules.get("batchllm.cli.console")
    log = console.active_log() if console is not None else None
    if log is not None:
        click.echo(f"full log: {log}", err=True)


def _database_problem(exc: Exception) -> str | None:
    """One line for an error of the database driver (the server down, a wrong URL), else None."""
    # Commands import sqlalchemy lazily; when it is not loaded, the error cannot be one of its.
    sql_errors = sys.modules.get("sqlalchemy.exc")
    if sql_errors is None or not isinstance(exc, sql_errors.DBAPIError):
        return None
    from sqlalchemy.engine import make_url

    from batchllm.settings import get_settings

    url = make_url(get_settings().resolved_database_url).render_as_string(hide_password=True)
    lines = str(exc.orig).strip().splitlines()
    first = lines[0] if lines else type(exc.orig).__name__
    if isinstance(exc, sql_errors.OperationalError):
        return f"cannot reach the database at {url}: {first}"
    return f"database error at {url}: {first}"


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="batchllm")
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def cli(verbose: int) -> None:
    """Batch inference jobs over vLLM: JSONL prompts in, Parquet results out."""
    level = logging.WARNING - 10 * verbose
    # vLLM logs every engine detail at INFO to stdout; keep it quiet unless asked (-v).
    os.environ.setdefault("VLLM_LOGGING_LEVEL", logging.getLevelName(max(level, logging.DEBUG)))
    logging.basicConfig(
        level=max(level, logging.DEBUG),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def main() -> None:
    cli(prog_name="batchllm")


from batchllm.cli import (  # noqa: E402  (commands register on `cli`)
    admin,
    bench,
    doctor,
    ended_jobs,
    engine,
    fleet,
    inspect,
    pipeline,
    run,
    serve,
)

__all__ = [
    "admin",
    "bench",
    "cli",
    "doctor",
    "ended_jobs",
    "engine",
    "fleet",
    "inspect",
    "main",
    "pipeline",
    "run",
    "serve",
]
