"""`batchllm pipeline run|submit|status FILE.toml`: stages of jobs, each reading a file or an
earlier stage's rows (batchllm/pipeline.py, docs/pipelines.md)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from batchllm.cli import cli
from batchllm.cli.engine_flags import float_option
from batchllm.cli.options import engine_kind_options

if TYPE_CHECKING:
    from batchllm.client import Job
    from batchllm.pipeline import StageState

_PIPELINE_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)


@cli.group()
def pipeline() -> None:
    """Pipelines: stages of jobs in a TOML file, each reading a file or an earlier stage's
    rows (`from`); run again, completed stages are not run again."""


@pipeline.command("run")
@click.argument("file", type=_PIPELINE_FILE)
@engine_kind_options(
    "instant: SIMULATION ONLY, no vLLM; every request answers with filler text (checks a "
    "pipeline's files, templates and joins in seconds).",
    "With --engine instant: each engine step takes this long.",
)
def run_command(file: Path, engine_kind: str, instant_step_seconds: float) -> None:
    """Run FILE's stages here, one after the other (vLLM in this process, an engine kept up
    between stages with the same model and engine settings), skipping those that completed
    before with the same settings and parent job.

    \b
    Example:
      batchllm pipeline run qa.toml
    """
    from batchllm.client import Client
    from batchllm.pipeline import load_pipeline, run_pipeline

    loaded = load_pipeline(file)
    engines = None
    if engine_kind == "instant":
        from batchllm.execution.instant import InstantEngines

        engines = InstantEngines(step_seconds=instant_step_seconds)
    from batchllm.cli.console import quiet_unless_verbose

    quiet_unless_verbose("pipeline")
    with Client(keep_engine=engines is None) as client:
        states = run_pipeline(client, loaded, fleet=False, report=_report, engines=engines)
    _echo_states(states)


@pipeline.command("submit")
@click.argument("file", type=_PIPELINE_FILE)
@float_option(
    "--poll", least=0.1, default=2.0, help="Seconds between looks at a running stage's job."
)
def submit_command(file: Path, poll: float) -> None:
    """Submit FILE's stages to the worker fleet: a stage reading a file goes out at once, one
    reading an earlier stage's rows once that stage completed (this command waits for it).
    Stopped (Ctrl-C) and run again, it resumes: completed stages are kept, running ones
    waited for, failed ones submitted anew.

    \b
    Example:
      batchllm pipeline submit qa.toml
    """
    from batchllm.client import Client
    from batchllm.pipeline import load_pipeline, run_pipeline

    loaded = load_pipeline(file)
    states = run_pipeline(Client(), loaded, fleet=True, report=_report, poll=poll)
    _echo_states(states)


@pipeline.command("status")
@click.argument("file", type=_PIPELINE_FILE)
def status_command(file: Path) -> None:
    """Show each stage of FILE: its latest job, its state and rows, and whether it is
    current (made with the stage's settings and parent job of now) or would run again."""
    from batchllm.client import Client
    from batchllm.pipeline import load_pipeline, stage_states

    _echo_states(stage_states(Client(), load_pipeline(file)))


def _report(stage: str, what: str, job: Job) -> None:
    click.echo(f"stage {stage}: job {job.id} {what} ({job.status})", err=True)


def _echo_states(states: list[StageState]) -> None:
    """Each stage's latest job and what running the pipeline again does with it."""
    from batchllm.cli.render import table

    rows = []
    for state in states:
        job = state.job
        if job is None:
            rows.append([state.stage.name, "-", "not run", "-", "runs"])
            continue
        done = f"{job.completed:,} ok, {job.failed:,} error / {job.total:,}"
        rows.append([state.stage.name, job.id, job.status, done, _next(state)])
    click.echo(table(["stage", "job", "status", "rows", "next time"], rows))


def _next(state: StageState) -> str:
    job = state.job
    if job is None or not state.current:
        return "runs again"
    if job.status == "completed":
        return "kept"
    return "waited for" if not job.done else "runs again"
