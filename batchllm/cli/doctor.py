"""`doctor`: what to check before a run, or before filing a bug."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click

from batchllm.cli import cli

if TYPE_CHECKING:  # the library is imported when the command runs
    from batchllm.doctor.diagnose import Report

_KEY_WIDTH_CAP = 24  # a longer key pushes only its own value to the right


@cli.command()
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object: sections, problems, warnings."
)
@click.option(
    "--model",
    metavar="PATH",
    default=None,
    help="A local model directory: check its config.json and read the dtype it was saved in.",
)
@click.option(
    "--fleet",
    is_flag=True,
    help="Check for submit/worker too: an unreachable broker is then a problem.",
)
@click.option(
    "--startup",
    is_flag=True,
    help="Also build --model's engine once, as `run` would, and time each phase of its start "
    "and a first answer (takes as long as a cold start).",
)
@click.option(
    "--enforce-eager",
    is_flag=True,
    help="With --startup: build the engine without torch.compile, as `run --enforce-eager`.",
)
def doctor(
    as_json: bool, model: str | None, fleet: bool, startup: bool, enforce_eager: bool
) -> None:
    """Check this machine and the configuration before a run or a bug report.

    Takes a few seconds: no engine is started (unless --startup) and nothing is changed.
    Reports Python and
    the platform; torch's build; the vLLM build and whether it is the release batchllm
    supports; the GPUs, processes holding GPU memory and vLLM engine processes (orphaned ones
    with the command that ends them); the dtype `--dtype auto` picks; the database
    (reachable, schema current; never upgraded); the broker (reachable, tasks waiting per
    queue); whether storage is writable; and every setting with where it came from (env,
    .env or default). Passwords in URLs are shown as ***.

    Exit code 0 when everything `batchllm run` needs is there, 1 otherwise. Each problem is
    one `problem:` line on stderr, each warning one `warning:` line. `run` needs no broker,
    so an unreachable broker is a warning (it is needed only for submit/worker) unless
    BATCHLLM_BROKER_URL is set (in the environment or .env) or --fleet is given.

    With --startup and --model, the engine is built once and each phase of its start is
    shown (importing vLLM, building the engine, a first answer): where a slow start goes on
    this machine and GPU.

    \b
    Examples:
      batchllm doctor
      batchllm doctor --model ./tiny-model --json
      batchllm doctor --fleet
      batchllm doctor --model ./tiny-model --startup
    """
    if startup and model is None:
        raise click.UsageError("--startup needs --model: the engine it builds")
    if startup:  # vLLM runs in this process: its output to a log file, as `run`'s
        from batchllm.cli.console import quiet_unless_verbose

        quiet_unless_verbose("doctor")
    from batchllm.doctor.diagnose import diagnose
    from batchllm.settings import get_settings

    report = diagnose(
        model=model,
        fleet=fleet,
        settings=get_settings(),
        startup=startup,
        enforce_eager=enforce_eager,
    )
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2, default=str))
    else:
        _print_sections(report)
    for problem in report.problems:
        click.secho(f"problem: {problem}", fg="red", err=True)
    for warning in report.warnings:
        click.secho(f"warning: {warning}", fg="yellow", err=True)
    if not as_json:
        _print_verdict(len(report.problems), len(report.warnings))
    if not report.ok:
        raise SystemExit(1)


def _print_sections(report: Report) -> None:
    """Sections as aligned `key  value[  note]` lines, one key column for the whole report."""
    keys = [row[0] for section in report.sections for row in section.rows]
    key_width = min(max(map(len, keys), default=0), _KEY_WIDTH_CAP)
    for number, section in enumerate(report.sections):
        if number:
            click.echo()
        marker = "" if section.status.value == "ok" else f"  [{section.status.value}]"
        click.secho(section.title + marker, bold=True)
        # Middle columns (the settings' values) align within their section.
        middle = [len(v) for row in section.rows if len(row) > 2 for v in row[1:2]]
        value_width = max(middle, default=0)
        for key, *values in section.rows:
            cells = [f"{key:<{key_width}}"]
            if len(values) > 1:
                cells.append(f"{values[0]:<{value_width}}")
                values = values[1:]
            cells += values
            click.echo(("  " + "  ".join(cells)).rstrip())


def _print_verdict(problems: int, warnings: int) -> None:
    def count(n: int, word: str) -> str:
        return f"{n} {word}" + ("" if n == 1 else "s")

    click.echo()
    if problems:
        click.secho(f"not ready: {count(problems, 'problem')} (see above)", fg="red")
    elif warnings:
        click.secho(f"ready for `batchllm run`, with {count(warnings, 'warning')}", fg="yellow")
    else:
        click.secho("ready for `batchllm run`", fg="green")
