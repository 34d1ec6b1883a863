"""`batchllm run`: a whole job in this process, no broker needed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import click

from batchllm.cli import cli
from batchllm.cli.engine import keep_alive_option, kept_engines
from batchllm.cli.engine_flags import require_hardware_for
from batchllm.cli.options import (
    echo_webhook_secret,
    engine_kind_options,
    job_input,
    job_options,
    notify_option,
    require_local_model,
    require_requests,
    spec_from_flags,
)

if TYPE_CHECKING:  # pyarrow stays out of `batchllm --help`'s imports
    from batchllm.client import Job
    from batchllm.input.files.source import InputSource
    from batchllm.kept_engine.client import KeptEngines
    from batchllm.spec import JobSpec


@cli.command()
@job_options
@click.option(
    "--output",
    "-o",
    type=click.Path(path_type=Path),
    default=None,
    help="Also copy the finished Parquet dataset into this new or empty directory.",
)
@notify_option
@keep_alive_option(
    "How long the engine stays loaded after this run, in a background process the next run "
    "with the same model and engine flags reuses: 300, 90s, 5m, 1h; -1 until `batchllm engine "
    "stop`; 0 keeps none (the engine is built in this process and unloaded at its end). "
    "[default: BATCHLLM_KEEP_ALIVE, 5m]"
)
@engine_kind_options(
    "instant: SIMULATION ONLY, no vLLM and no generation; every request answers with "
    "filler text at its max_tokens (the job records the hardware 'none (instant engine)'). "
    "Checks a job's input, options and output end to end in seconds on any machine.",
    "With --engine instant: each engine step takes this long and gives every running "
    "request one token (0: answers at once), so a simulated job lasts a set time.",
)
def run(
    file: InputSource | None,
    from_job: str | None,
    from_status: str,
    output: Path | None,
    strict: bool,
    dry_run: bool,
    notify: str | None,
    keep_alive: float | None,
    engine_kind: str,
    instant_step_seconds: float,
    **flags,
) -> None:
    """Run the prompts in FILE (JSONL, or a Parquet/CSV table with --prompt-column: a local
    path or an s3:// URI) to the end in this process and print where the results are. Exit
    code 0 when the job completed, also when some lines became error rows.

    \b
    Example:
      batchllm run prompts.jsonl --model ./tiny-model --max-tokens 64
      batchllm run docs.parquet --prompt-column text --id-column doc_id --model ./tiny-model
      batchllm run questions.jsonl --prompt-template 'Q: {question}' --model ./tiny-model
      batchllm run --from job_1a2b --prompt-template 'Is "{text}" right? {prompt}' \\
        --choice yes,no --model ./tiny-model
      batchllm run prompts.jsonl --model ./tiny-model --dry-run
      batchllm run prompts.jsonl --model ./tiny-model --engine instant
    """
    from batchllm.process.stopping import cleanups_run_on_signals

    with job_input(file, from_job, from_status, flags) as source:
        spec = spec_from_flags(flags, source)
        require_local_model(spec.model)
        if dry_run:
            from batchllm.cli.render import echo_estimate
            from batchllm.client import Client

            require_requests(source)
            echo_estimate(Client().dry_run_spec(source, spec), spec.model)
            return
        if engine_kind != "instant":  # the instant engine holds no GPU: nothing to check
            require_hardware_for(spec.engine)
        engines = kept_engines(keep_alive, engine_kind, instant_step_seconds)
        if output is not None:
            _require_usable_output(output)
        require_requests(source)
        # SIGTERM or SIGHUP while the engine is built (or the job created) unwinds, so vLLM
        # shuts its engine processes down: its default action would leave an EngineCore that
        # had not finished its handshake waiting 5 minutes under PID 1
        # (process/parent_watch.py). While the shards run, SIGTERM stops the run as Ctrl-C does.
        with cleanups_run_on_signals():
            ended = _run_job(source, spec, strict, notify, engines)
        _report(ended, output)


def _run_job(
    file: InputSource, spec: JobSpec, strict: bool, notify: str | None, engines: KeptEngines
) -> Job:
    """The job run to its end here, with a progress bar; the engines closed after it."""
    from batchllm.cli.console import quiet_unless_verbose
    from batchllm.cli.progress import Progress
    from batchllm.client import Client

    quiet_unless_verbose("run")
    progress: list[Progress] = []

    def created(job: Job) -> None:
        click.echo(f"job {job.id}: {job.total:,} requests for {spec.model}", err=True)
        echo_webhook_secret(job.notify_secret, notify)
        progress.append(Progress(job.total))

    try:
        ended = Client().run_spec(
            file,
            spec,
            strict=strict,
            engines=engines,
            on_created=created,
            on_progress=lambda rows, tokens: progress[0].advance(rows, tokens),
            notify=notify,
        )
    finally:
        engines.close()  # a kept engine stays loaded; one built in this process unloads
    if progress:
        progress[0].close()
    return ended


def _report(ended: Job, output: Path | None) -> None:
    """Copy a completed job's output to --output, show the job, and exit 1 unless it
    completed."""
    from batchllm.cli.render import echo_job, job_row

    row = job_row(ended.id)
    if output is not None and ended.status == "completed":
        from batchllm.output.export import copy_output
        from batchllm.settings import get_settings

        try:
            copy_output(row, output, settings=get_settings())
        except OSError as exc:  # the destination changed since the check before the job
            raise click.ClickException(
                f"job {row.id} completed (its results are in {row.output_dir}), but copying "
                f"them to --output {output} failed: {exc}"
            ) from None
        click.echo(f"copied the output to {output}", err=True)
    echo_job(row)
    if ended.status != "completed":
        raise SystemExit(1)


def _require_usable_output(output: Path) -> None:
    """Refuse, before the job runs, a destination the copy would fail on at the end or whose
    files would mix with the job's dataset (it is read as one table)."""
    if output.exists() and not output.is_dir():
        raise click.ClickException(f"--output {output}: exists and is not a directory")
    if output.is_dir() and any(output.iterdir()):
        raise click.ClickException(
            f"--output {output}: the directory is not empty (the job's "
            "dataset would mix with its files); give a new or empty one"
        )
    parent = next(p for p in output.absolute().parents if p.exists())
    if not parent.is_dir():
        raise click.ClickException(f"--output {output}: {parent} is not a directory")
    _require_writable(output)


def _require_writable(output: Path) -> None:
    """Create the directory and a file in it now, as the copy will once the job is done.
    Permission bits do not tell: root ignores them, while a read-only mount or an immutable
    directory refuses root too. What the probe created is removed again, so a job that fails
    leaves nothing behind."""
    created = [p for p in (output.absolute(), *output.absolute().parents) if not p.exists()]
    probe = output / f".batchllm-write-probe-{os.getpid()}"
    try:
        output.mkdir(parents=True, exist_ok=True)
        probe.touch()
        probe.unlink()
    except OSError as exc:
        where = exc.filename or output
        raise click.ClickException(
            f"--output {output}: cannot write {where}: {exc.strerror or exc}"
        ) from None
    finally:
        for directory in created:  # deepest first
            try:
                directory.rmdir()
            except OSError:
                break
