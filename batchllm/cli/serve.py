"""`batchllm serve` (the OpenAI-compatible Batch API) and `batchllm keys` (its API keys)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import click

from batchllm.cli import cli
from batchllm.cli.options import log_format_option
from batchllm.process.stopping import PARENT_MARK, cleanups_run_on_signals, stop_child


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option(
    "--no-auth",
    is_flag=True,
    help="Serve without API keys, as one tenant (for a single user on this machine).",
)
@click.option(
    "--require-served-model",
    is_flag=True,
    help="Accept batches only for models a live worker serves now (or BATCHLLM_SERVED_MODELS "
    "lists): a model whose workers stopped is refused at once. By default one served within "
    "BATCHLLM_SERVED_MODEL_RETENTION_SECONDS (7 days) is still accepted and waits for a "
    "worker; a model never served nor configured is refused either way.",
)
@click.option(
    "--worker",
    "worker_models",
    multiple=True,
    metavar="MODEL",
    help="Also run `batchllm worker --model MODEL` beside the server, with the worker's "
    "default engine settings (repeatable: one worker process per model); needs the broker "
    "like any worker. Run `batchllm worker` yourself for other engine settings.",
)
@click.option(
    "--workers",
    "processes",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="Server processes answering on the port (uvicorn's workers; they share the "
    "database and the broker). One process answers about a core's worth of requests; the "
    "expiry round runs once, in the parent process. Not to be confused with --worker.",
)
@log_format_option(
    "json: one object per line (time, level, logger, message) for log shippers; the "
    "--worker process logs the same way."
)
def serve(
    host: str,
    port: int,
    no_auth: bool,
    require_served_model: bool,
    worker_models: tuple[str, ...],
    processes: int,
    log_format: str,
) -> None:
    """Serve the OpenAI Batch API (/v1/files, /v1/batches, /v1/models) over this database,
    storage and fleet: the official `openai` client works with base_url
    http://HOST:PORT/v1 and a key from `batchllm keys create`.

    \b
    Example:
      batchllm keys create alice
      batchllm serve --port 8000 --worker ./tiny-model
    """
    import uvicorn

    from batchllm.api.app import WORKER_OPTIONS_ENV, create_app, expire_periodically_in_thread
    from batchllm.api.http import server_options
    from batchllm.settings import get_settings
    from batchllm.store.db import get_engine

    settings = get_settings()
    # A connection per request and poll thread: a smaller pool made threads wait for one, and its
    # overflow opened and closed a PostgreSQL connection per few dozen requests.
    pool = max(settings.db_pool_size, settings.api_threads + settings.api_poll_threads)
    settings = settings.model_copy(update={"db_pool_size": pool})
    get_engine(settings)  # refuse an unreachable or old database now, in one line
    options: dict[str, Any] = {
        "auth": not no_auth,
        "require_served_model": require_served_model,
        # Served before their worker announces them: the first batch need not wait for it.
        "own_models": list(worker_models),
        # Without keys, every job shows only to a dashboard no other machine can reach.
        "dashboard_sees_all": no_auth and is_local(host),
    }
    # One process runs the app built here; several build it themselves, by name.
    app: Any = create_app(settings, **options) if processes == 1 else "batchllm.api.app:worker_app"
    if processes > 1:
        # Spawned worker processes build the app by name from the environment (api/app.py).
        os.environ[WORKER_OPTIONS_ENV] = json.dumps(options)
        os.environ["BATCHLLM_DB_POOL_SIZE"] = str(pool)
        expire_periodically_in_thread(settings)
    auth = "no API keys (--no-auth)" if no_auth else "API keys required"
    click.echo(f"serving the Batch API on http://{host}:{port}/v1 ({auth})", err=True)
    click.echo(f"dashboard: http://{host}:{port}/ui", err=True)
    for warning in exposure_warnings(host, no_auth=no_auth):
        click.echo(f"warning: {warning}", err=True)
    log_config: dict[str, Any] | None = uvicorn.config.LOGGING_CONFIG
    if log_format == "json":
        from batchllm.process.log_format import use_json

        use_json()  # the root logger's handlers; uvicorn's loggers then propagate to them
        log_config = None
    with cleanups_run_on_signals():  # SIGTERM or SIGHUP must not leave the worker running
        workers = [_start_worker(model, log_format) for model in worker_models]
        try:
            uvicorn.run(
                app,
                factory=processes > 1,
                workers=processes,
                host=host,
                port=port,
                log_level="warning",
                log_config=log_config,
                **server_options(settings, processes=processes),
            )
        finally:
            for worker in workers:
                # A warm shutdown: its shard goes back to the queue, its engine is shut down.
                stop_child(worker, grace=120)


def _start_worker(model: str, log_format: str) -> subprocess.Popen:
    # The worker logs the way this server does.
    argv = [
        sys.executable,
        "-m",
        "batchllm",
        "worker",
        "--model",
        model,
        "--log-format",
        log_format,
    ]
    # The worker watches this process: a `kill -9` of serve (an OOM kill) must not leave it
    # taking tasks under PID 1.
    worker = subprocess.Popen(argv, env={**os.environ, PARENT_MARK: str(os.getpid())})
    click.echo(f"worker started (pid {worker.pid}) for {model}", err=True)
    return worker


def is_local(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


def exposure_warnings(host: str, *, no_auth: bool) -> list[str]:
    """What an operator must hear before the server takes requests: who can reach it."""
    local = is_local(host)
    warnings = []
    if no_auth:
        who = "anyone on this machine" if local else f"anyone who can reach {host}"
        seen = "; the dashboard (/ui) shows it every job" if local else ""
        warnings.append(f"--no-auth: {who} can read, create and delete every file and batch{seen}")
    if not local:
        warnings.append(
            f"listening on {host}, not only this machine: the API is plain HTTP; put a TLS "
            "proxy in front of it when it is reachable from other machines"
        )
    return warnings


@cli.group()
def keys() -> None:
    """API keys of `batchllm serve`: each key sees only its own files and batches."""


@keys.command("create")
@click.argument("name")
@click.option(
    "--webhook",
    metavar="URL",
    default=None,
    help="POST a signed event there when each of this key's batches ends (see `keys webhook`).",
)
@click.option(
    "--admin",
    is_flag=True,
    help="The dashboard (/ui) shows this key every job: other keys' and `submit`/`run` jobs.",
)
def create_key(name: str, webhook: str | None, admin: bool) -> None:
    """Create a key named NAME and print it (once: only its hash is stored).

    \b
    Example:
      batchllm keys create team-search --webhook https://search.example.com/batch-events
    """
    from batchllm.api.keys import create_key as make
    from batchllm.api.keys import set_webhook
    from batchllm.settings import get_settings
    from batchllm.store.db import session_scope

    with session_scope(get_settings()) as session:
        row, key = make(session, name, admin=admin)
        if webhook is not None:
            set_webhook(session, row.id, webhook)
        key_id, secret = row.id, row.webhook_secret
    click.echo(key)
    role = "admin key" if admin else "key"
    click.echo(f"{role} {key_id} ({name}) created; it is not shown again", err=True)
    if secret:
        click.echo(f"its webhook to {webhook} is signed with secret {secret}", err=True)


@keys.command("webhook")
@click.argument("key")
@click.argument("url", required=False)
@click.option("--clear", is_flag=True, help="Send this key's batches' events nowhere.")
def key_webhook(key: str, url: str | None, clear: bool) -> None:
    """Set the URL that the end of each batch of KEY (an id or name) is POSTed to, signed
    with a new secret, printed here (batch.completed, batch.failed, batch.cancelled, batch.expired events).

    \b
    Example:
      batchllm keys webhook team-search https://search.example.com/batch-events
    """
    from batchllm.api.keys import set_webhook
    from batchllm.settings import get_settings
    from batchllm.store.db import session_scope

    if (url is None) != clear:
        raise click.UsageError("give a URL, or --clear")
    with session_scope(get_settings()) as session:
        row = set_webhook(session, key, url)
        key_id, secret = row.id, row.webhook_secret
    if secret is None:
        click.echo(f"key {key_id}: no webhook")
    else:
        click.echo(f"key {key_id}: webhook {url}, signed with secret {secret}")


@keys.command("limits")
@click.argument("key")
@click.option(
    "--weight",
    type=float,
    default=None,
    help="The key's weight in the fair share of tokens served (default 1): weight 2 is "
    "served twice the tokens of weight 1 while both have work queued.",
)
@click.option(
    "--enqueued-tokens",
    type=int,
    default=None,
    help="The key's own limit of enqueued prompt tokens per model, instead of the server's "
    "BATCHLLM_API_MAX_ENQUEUED_TOKENS.",
)
@click.option(
    "--default-tokens",
    is_flag=True,
    help="Back to the server's BATCHLLM_API_MAX_ENQUEUED_TOKENS.",
)
def key_limits(
    key: str, weight: float | None, enqueued_tokens: int | None, default_tokens: bool
) -> None:
    """Set KEY's (an id or name) fair-share weight and enqueued-token limit; print them.

    \b
    Example:
      batchllm keys limits team-search --weight 2 --enqueued-tokens 50000000
    """
    from batchllm.api.keys import set_limits
    from batchllm.settings import get_settings
    from batchllm.store.db import session_scope

    if enqueued_tokens is not None and default_tokens:
        raise click.UsageError("give --enqueued-tokens N or --default-tokens, not both")
    settings = get_settings()
    with session_scope(settings) as session:
        row = set_limits(
            session,
            key,
            weight=weight,
            enqueued_tokens=enqueued_tokens,
            default_tokens=default_tokens,
        )
        key_id, share, own = row.id, row.share_weight, row.enqueued_token_limit
    limit = (
        f"{own:,}"
        if own is not None
        else f"{settings.api_max_enqueued_tokens:,} (BATCHLLM_API_MAX_ENQUEUED_TOKENS)"
    )
    click.echo(f"key {key_id}: weight {share:g}, enqueued-token limit {limit} per model")


@keys.command("list")
def list_keys() -> None:
    """Keys by id, name, creation and revocation time, webhook, whether the dashboard shows
    the key every job (admin), fair-share weight and own enqueued-token limit (`keys
    limits`); never the keys themselves."""
    from batchllm.api.keys import list_keys as rows
    from batchllm.cli.render import table
    from batchllm.settings import get_settings
    from batchllm.store.db import session_scope

    with session_scope(get_settings()) as session:
        lines = [
            [
                r.id,
                r.name,
                r.created_at.isoformat(timespec="seconds"),
                r.revoked_at.isoformat(timespec="seconds") if r.revoked_at else "-",
                r.webhook_url or "-",
                f"{r.share_weight:g}",
                f"{r.enqueued_token_limit:,}" if r.enqueued_token_limit is not None else "-",
                "yes" if r.admin else "-",
            ]
            for r in rows(session)
        ]
    headers = ["id", "name", "created", "revoked", "webhook", "weight", "token-limit", "admin"]
    click.echo(table(headers, lines))


@keys.command("revoke")
@click.argument("key")
def revoke_key(key: str) -> None:
    """Revoke the key with this id or name: its requests get 401 from now on."""
    from batchllm.api.keys import revoke_key as revoke
    from batchllm.settings import get_settings
    from batchllm.store.db import session_scope

    with session_scope(get_settings()) as session:
        row = revoke(session, key)
        key_id = row.id
    click.echo(f"key {key_id} revoked")
