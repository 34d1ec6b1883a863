"""`batchllm engine start|status|stop`: the kept engines that `batchllm run` reuses."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

import click

from batchllm.cli import cli
from batchllm.cli.engine_flags import (
    choice_option,
    float_option,
    worker_engine_from_flags,
    worker_engine_options,
)

if TYPE_CHECKING:
    from batchllm.kept_engine.client import KeptEngines


def keep_alive_option(help: str):
    """--keep-alive DURATION, checked as BATCHLLM_KEEP_ALIVE is."""

    def seconds(_ctx: click.Context, _param: click.Parameter, value: str | None) -> float | None:
        if value is None:
            return None
        from batchllm.settings import duration_seconds

        try:
            return duration_seconds(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None

    return click.option(
        "--keep-alive", metavar="DURATION", default=None, callback=seconds, help=help
    )


def kept_engines(
    keep_alive: float | None, engine_kind: str, instant_step_seconds: float
) -> KeptEngines:
    """The kept engines a command uses, as its flags ask, saying what they do on stderr."""
    from batchllm.kept_engine.client import KeptEngines
    from batchllm.settings import get_settings

    return KeptEngines(
        get_settings(),
        keep_alive=keep_alive,
        kind=engine_kind,
        step_seconds=instant_step_seconds,
        on_status=lambda text: click.echo(text, err=True),
    )


@cli.group()
def engine() -> None:
    """Kept engines: a model loaded in a background process of yours that `batchllm run`
    reuses instead of starting vLLM again, until idle for BATCHLLM_KEEP_ALIVE (5m)."""


@engine.command("start")
@click.option("--model", required=True, help="Model path or name, as vLLM loads it.")
@worker_engine_options
@keep_alive_option(
    "How long the engine stays loaded after its last run: 300, 90s, 5m, 1h; -1 until "
    "`batchllm engine stop`. [default: BATCHLLM_KEEP_ALIVE, 5m]"
)
@choice_option(
    "--engine",
    "engine_kind",
    choices=["vllm", "instant"],
    default="vllm",
    help="instant: SIMULATION ONLY, no vLLM (as `run --engine instant`).",
)
@float_option(
    "--instant-step-seconds",
    default=0.0,
    help="With --engine instant: each step's time (as `run --instant-step-seconds`; a run "
    "uses this engine only with the same value).",
)
def start(
    model: str,
    keep_alive: float | None,
    engine_kind: str,
    instant_step_seconds: float,
    **flags,
) -> None:
    """Load MODEL now, so the next `batchllm run` with the same model and engine flags starts
    generating at once. Without --max-model-len the engine takes the longest context its
    memory holds (a job that needs more gets an engine of its own)."""
    from batchllm.spec import EngineOptions, JobSpec

    options = worker_engine_from_flags(flags)
    source = click.get_current_context().get_parameter_source("gpu_memory_utilization")
    if source is not click.core.ParameterSource.COMMANDLINE:
        # A fleet worker's default share is not a run's: the engine must match what `run`
        # asks for with the same flags, or no run would ever use it.
        options = options.model_copy(
            update={"gpu_memory_utilization": EngineOptions().gpu_memory_utilization}
        )
    if keep_alive == 0:
        raise click.BadParameter("0 keeps no engine: give a duration", param_hint="--keep-alive")
    engines = kept_engines(keep_alive, engine_kind, instant_step_seconds)
    started = time.monotonic()
    remote = engines.get(JobSpec(model=model, engine=options), options.max_model_len or -1)
    click.echo(
        f"kept engine {remote.id} ready in {time.monotonic() - started:.1f} s: {model}, "
        f"max_model_len {remote.max_model_len}, pid {remote.pid}"
    )
    engines.close()


@engine.command("status")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per engine.")
def status(as_json: bool) -> None:
    """The kept engines: model, context, runs using each, idle time, when it unloads."""
    from batchllm.kept_engine.control import engine_statuses
    from batchllm.settings import get_settings

    rows = engine_statuses(get_settings().home)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no kept engines")
        return
    for row in rows:
        click.echo(_describe(row))


def _describe(row: dict) -> str:
    if row["state"] != "ready":
        return f"{row['id']}  {row['state']:8}  {row['model']}  pid {row['pid']}"
    keep = row["keep_alive"]
    if row["runs"]:
        when = f"serving {row['runs']} run(s), {row['in_flight']} requests in flight"
    elif keep is None:
        when = "idle, kept until stopped"
    else:
        when = f"idle {row['idle_seconds']:.0f} s, unloads in {max(keep - row['idle_seconds'], 0):.0f} s"
    return (
        f"{row['id']}  ready     {row['model']}  max_model_len {row['max_model_len']}  "
        f"pid {row['pid']}  {when}"
    )


@engine.command("stop")
@click.argument("engine_id", required=False)
@click.option("--all", "stop_all", is_flag=True, help="Every kept engine of yours.")
@click.option("--force", is_flag=True, help="Unload now even while runs use it.")
def stop(engine_id: str | None, stop_all: bool, force: bool) -> None:
    """Unload the kept engine ENGINE_ID (an id prefix will do), or every one with --all. One
    that runs are using unloads when they end (--force: now; their runs start a new one)."""
    from batchllm.kept_engine.control import stop_engines
    from batchllm.settings import get_settings

    if not engine_id and not stop_all:
        raise click.UsageError("give an ENGINE_ID (see `batchllm engine status`) or --all")
    home = get_settings().home
    for line in stop_engines(home, None if stop_all else engine_id, force=force):
        click.echo(line)
