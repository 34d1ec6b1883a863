"""All configuration in one place: environment variables prefixed BATCHLLM_ (or a .env file).

Nothing else in batchllm reads the environment. Only the entry points ask `get_settings()`:
the CLI's commands, the API's app, the Client (without settings of its caller's) and a Celery
task or worker signal; they hand the Settings down, and library code uses what it is given.
"""

from __future__ import annotations

import ipaddress
import math
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BATCHLLM_", env_file=".env", extra="ignore")

    home: Path = Field(
        default=Path("~/.batchllm"),
        description="Root for the embedded database and the default storage.",
    )
    database_url: str | None = Field(
        default=None,
        description="SQLAlchemy URL. Default: SQLite at HOME/batchllm.db. "
        "For a fleet: postgresql+psycopg://user@host/db.",
    )
    db_pool_size: int = Field(
        default=5,
        ge=1,
        description="Database connections a process keeps open for reuse (SQLAlchemy's "
        "pool; `serve` raises it to BATCHLLM_API_THREADS). A worker uses at most three at "
        "once (its shard, heartbeat and reconciler; measured: two), so a fleet of N workers "
        "holds about 2N-3N whatever this is: raise PostgreSQL's max_connections past 3N, or "
        "put PgBouncer in front, past ~30 workers.",
    )
    db_max_overflow: int = Field(
        default=10,
        ge=0,
        description="Connections a process may open beyond db_pool_size in a burst (`serve` "
        "under concurrent requests), closed again after it.",
    )
    storage: str | None = Field(
        default=None,
        description="Where job inputs and outputs live: a local path or a pyarrow.fs URI "
        "shared by the fleet. Default: HOME/jobs.",
    )
    s3_endpoint: str | None = Field(
        default=None,
        description="Endpoint of an S3-compatible store (MinIO, Ceph, ...) for s3:// storage "
        "and input URIs, e.g. http://127.0.0.1:9000 (http:// for a plain-HTTP one). Default: "
        "AWS S3 (or AWS_ENDPOINT_URL). Credentials and region come from the standard AWS "
        "variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, ...).",
    )
    broker_url: str = Field(
        default="redis://localhost:6379/0", description="Celery broker for `submit` and `worker`."
    )
    shard_size: int = Field(default=10_000, ge=1, description="Rows per shard for `submit`.")
    place_prefixes: bool = Field(
        default=True,
        description="Write a generation job's shards in prompt order across the whole file, so "
        "lines sharing a prefix (a system prompt, a document) land in the fewest shards and "
        "its prefill is paid once per job, not once per shard (input/shards.py). The rows' "
        "order must be known before the first shard is written, so a job's shards are queued "
        "once its whole file is read; false (or a job's --no-group-prefixes): each shard "
        "queued as it is stored, in file order.",
    )
    placement_memory_mb: int = Field(
        default=256,
        ge=1,
        description="Arrow data (MiB) placement sorts in memory before it spills a sorted run "
        "to a temporary file (TMPDIR) and merges the runs: a job's intake stays within about "
        "twice this, whatever the file's size.",
    )
    tokenize_at_submit: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="When `submit` sizes the job's context (and tokenizes the prompts) while it "
        "validates them, so no worker does: `auto` for a job without --max-model-len of 10,000 "
        "lines or more (one pass must read every row before any runs; at submit it overlaps "
        "the validation), short prompts sized from their bytes and left to the workers to "
        "tokenize, long ones tokenized; `always` tokenizes every job's prompts and stores their "
        "ids (the workers' CPU per row falls by half or more, the submit takes several times as "
        "long); `never`. Only where the model is a local directory (execution/context/submit_pass.py).",
    )
    max_line_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=1,
        description="Longest input line in bytes (without its newline). A longer line becomes "
        "an error row without being parsed: decoding and validating one huge line takes many "
        "times its size in memory and minutes of CPU.",
    )
    commit_rows: int = Field(
        default=2_000, ge=1, description="Finished rows per Parquet part file and checkpoint."
    )
    commit_seconds: float = Field(
        default=10.0, gt=0, description="Longest time finished rows wait before a checkpoint."
    )
    visibility_timeout: int = Field(
        default=6 * 3600,
        description="Seconds before Redis redelivers an unacknowledged shard; must exceed the "
        "longest shard, or a slow shard would run twice.",
    )

    first_wave: int = Field(
        default=8,
        ge=0,
        description="Requests a local run (`batchllm run`, the Client) puts in the engine until "
        "the first one finishes, so its first answers come within a second or two, not when "
        "the shortest answer of a full batch ends (a full batch shares each step among all its "
        "requests); then the whole window. 0: the whole window at once. Fleet workers never "
        "hold back.",
    )
    keep_alive: str = Field(
        default="5m",
        description="How long `batchllm run` (and the Client's local runs) keep their engine "
        "loaded after the last job on it ended, in a background process of this user's that "
        "the next run with the same model and engine settings reuses instead of starting vLLM "
        "again (as Ollama keeps a model): a duration such as 300, 90s, 5m or 1h; -1 keeps it "
        "until `batchllm engine stop`; 0 keeps none (each run builds its engine in its own "
        "process and unloads it at its end; a kept engine already up is still used).",
    )
    warm_runs: bool = Field(
        default=True,
        description="A kept engine's process starts a warm runner after its first run: a "
        "process with batchllm, pyarrow and SQLAlchemy imported, which the next `batchllm "
        "run`s of this checkout hand themselves to (it forks a child that runs the command "
        "with the caller's terminal, directory and environment), skipping a second of "
        "imports. false: no runner is started, and the `batchllm` command runs every command "
        "in its own process (the command reads this variable itself, before any import).",
    )
    lease_seconds: float = Field(
        default=120.0,
        gt=0,
        description="A running shard whose worker has not sent a heartbeat for this long is "
        "taken over by the worker its task is redelivered to.",
    )
    max_shard_attempts: int = Field(
        default=8,
        ge=1,
        description="A shard whose engine died this many times (counting every run of it) "
        "fails instead of going back to the queue: a request that kills the engine must not "
        "loop forever.",
    )
    served_models: list[str] | None = Field(
        default=None,
        description="Model names this deployment serves whether or not a worker of theirs is "
        "up, as a JSON list ('[\"/models/llama-8b\"]'): `serve` accepts a batch for one of "
        "them, or for a model a live worker serves or one served within "
        "served_model_retention_seconds, and refuses any other name at create (400, "
        "model_not_found, naming the models it serves). Set it for a fresh deployment whose "
        "first batches come before any worker started, and for models scaled to zero for "
        "longer than the retention.",
    )
    served_model_retention_seconds: float = Field(
        default=7 * 24 * 3600.0,
        ge=0,
        description="How long `serve` keeps accepting batches for a model after its last "
        "worker stopped (the registry remembers when each model was last served): a fleet "
        "scaled to zero overnight or over a weekend still takes batches for its models, which "
        "wait until a worker starts. 0: only models a live worker serves (and "
        "served_models).",
    )
    max_shard_failures: int = Field(
        default=3,
        ge=1,
        description="A shard whose run failed with an error no single row explains (its "
        "sizing, its storage, a bug) this many times ends: the rows it has not committed "
        "become error rows (error_code shard_failed) and its job ends with its other results. "
        "Each failure is recorded on the shard (`status` shows it) and retried after a backoff.",
    )
    shard_retry_seconds: float = Field(
        default=10.0,
        gt=0,
        description="The wait before a failed shard runs again; it doubles after each failure "
        "(up to 10 minutes). Meanwhile the shard's queue runs other shards.",
    )
    reconcile_seconds: float = Field(
        default=30.0,
        gt=0,
        description="How often each worker's reconciler moves stuck states on: re-sends the "
        "task of a queued shard that the broker lost, re-queues shards whose lease ran out, "
        "ends cancelled jobs whose workers died, finalizes jobs left finalizing.",
    )

    priority_aging_seconds: float = Field(
        default=600.0,
        gt=0,
        description="A job's priority rises one level (low -> normal -> high) for each this "
        "long it has waited since it was submitted, so low-priority work always progresses.",
    )
    fair_share_window_seconds: float = Field(
        default=300.0,
        gt=0,
        description="Fair share between tenants counts the prompt and output tokens each was "
        "served (over its key's weight) within this window: the tenant served least goes "
        "first. It also bounds how long a tenant new to the queue may take every turn to "
        "catch up with one that was served all along.",
    )
    instant_token_seconds: float = Field(
        default=0.0,
        ge=0,
        description="Simulation only: a fleet worker's instant engine (`worker --engine "
        "instant`) takes this many seconds per prompt and output token it serves, so the "
        "simulated engine's time follows tokens as a real one's does (0: answers at once).",
    )
    webhook_secret: str | None = Field(
        default=None,
        description="The secret that signs the webhooks of your `submit --notify` and `run "
        "--notify` jobs; unset, each such job gets a new one, which the command prints.",
    )
    webhook_timeout_seconds: float = Field(
        default=5.0,
        gt=0,
        description="A webhook receiver that has not answered in this long counts as a failed "
        "attempt (retried later): a slow receiver never holds a reconciler up for long.",
    )
    webhook_retry_seconds: float = Field(
        default=10.0,
        gt=0,
        description="The wait after a failed webhook attempt; it doubles after each failure "
        "up to an hour.",
    )
    webhook_max_attempts: int = Field(
        default=25,
        ge=1,
        description="Webhook attempts per job before giving up (about a day with the defaults).",
    )
    retain_days: float | None = Field(
        default=None,
        gt=0,
        description="Delete ended jobs (rows and files, as `batchllm delete`) this many days "
        "after they ended; the reconciler does it. Default: keep every job until deleted.",
    )

    max_n: int = Field(
        default=16,
        ge=1,
        description="Most samples a request may ask for with `n` (a line over it is an "
        "error row): every sample costs as much engine time as a request.",
    )
    min_lora_rank: int | None = Field(
        default=None,
        ge=1,
        description="Smallest max_lora_rank of the LoRA engines this process builds "
        "(`worker --max-lora-rank`): jobs with smaller adapters then share its warm engine.",
    )
    api_max_file_bytes: int = Field(
        default=200 * 1024 * 1024,
        ge=1,
        description="Largest upload `batchllm serve` takes on /v1/files (413 above it).",
    )
    api_max_file_lines: int = Field(
        default=50_000,
        ge=1,
        description="Most lines of an upload to `batchllm serve` (413 above it), as OpenAI.",
    )
    api_header_timeout: float = Field(
        default=15.0,
        gt=0,
        description="Seconds `batchllm serve` waits for a request's headers, from a new "
        "connection or the end of the previous response; a slower or idle connection is "
        "closed, so slow clients cannot hold the server's sockets.",
    )
    api_body_timeout: float = Field(
        default=30.0,
        gt=0,
        description="Seconds a request body may take before BATCHLLM_API_MIN_BODY_RATE applies "
        "to it: a body that falls behind grace + bytes/rate is answered 408 and its "
        "connection closed, so slow bodies cannot hold the server's sockets.",
    )
    api_min_body_rate: int = Field(
        default=16 * 1024,
        ge=1,
        description="Bytes a second a request body must average after BATCHLLM_API_BODY_TIMEOUT "
        "(a 200 MB upload may take about 3.5 hours at the default).",
    )
    api_login_max_failures: int = Field(
        default=10,
        ge=1,
        description="Failed dashboard logins one client address may make within "
        "BATCHLLM_API_LOGIN_WINDOW seconds; more are answered 429 without trying the key.",
    )
    api_login_window: float = Field(
        default=300.0,
        gt=0,
        description="Seconds a failed dashboard login counts against its client address.",
    )
    api_max_header_bytes: int = Field(
        default=16 * 1024,
        ge=1024,
        description="Largest request line plus headers `batchllm serve` reads (431 above it).",
    )
    api_max_in_flight: int = Field(
        default=64,
        ge=1,
        description="Requests one `batchllm serve` process works on or holds at once; one more "
        "is answered 503 with Retry-After at once (the openai SDK and other clients retry it) "
        "instead of waiting in a queue with no bound (500 clients at once had answers take 4 s "
        "and the server run requests whose clients had left). /health and /metrics are never "
        "refused. Above the request threads (16), the rest wait for one.",
    )
    api_threads: int = Field(
        # Not anyio's 40: the requests are mostly Python under one GIL, and more threads only
        # took turns slower. Polled by 100 clients (SQLite, this 2-core machine): 40 threads
        # p99 0.45-0.47 s, 16 threads 0.29-0.31 s, 8 threads 0.21-0.27 s, answered/s alike;
        # on PostgreSQL 8 and 40 alike. 16 keeps room for slow requests (uploads, a big
        # file's create) beside the polls.
        default=16,
        ge=1,
        description="Threads one `batchllm serve` process answers requests on (each holds "
        "one database connection while it works: the process's pool is at least this big). "
        "Fewer answer polls with a shorter tail (8: p99 0.21-0.27 s against 0.29-0.31 s at "
        "16, measured); more let more slow requests (uploads, creates of big files) run "
        "beside them.",
    )
    api_poll_threads: int = Field(
        default=4,
        ge=1,
        description="Threads one `batchllm serve` process answers polls on (GET of a batch and "
        "of a page of batches), apart from BATCHLLM_API_THREADS, which the other routes share: "
        "a poll never waits behind uploads or creates, and few threads taking turns under the "
        "GIL keep the slowest poll short (api/polls.py). Each holds a database connection "
        "while it works.",
    )
    api_key_cache_seconds: float = Field(
        default=5.0,
        ge=0,
        description="How long `batchllm serve` trusts an API key it has looked up before it "
        "looks again: a revoked key is refused within this many seconds (0: every request "
        "looks it up).",
    )
    api_max_active_batches: int = Field(
        default=100,
        ge=1,
        description="Most batches one API key may have unfinished at once (429 above it).",
    )
    api_max_enqueued_rows: int = Field(
        default=1_000_000,
        ge=1,
        description="Most request lines one API key may have enqueued (not yet finished) across "
        "its unfinished batches; a batch that would go over it is refused at create (429, with "
        "the numbers). GET /v1/batches shows the key's count in its x-batchllm-enqueued-rows "
        "headers.",
    )
    api_max_enqueued_tokens: int = Field(
        default=1_000_000_000,
        ge=1,
        description="Most prompt tokens one API key may have enqueued per model, as OpenAI "
        "limits an organization's enqueued tokens per model: each unfinished batch's prompt "
        "tokens as estimated at create (api/token_limit.py), released as its rows finish and "
        "whole when it ends. A batch that would go over it is created `failed` with the error "
        "code token_limit_exceeded and the numbers, as on OpenAI. `batchllm keys limits` sets "
        "a key's own. GET /v1/batches shows the key's figures in x-batchllm-enqueued-tokens "
        "headers.",
    )
    api_max_stored_bytes: int = Field(
        default=10 * 1024**3,
        ge=1,
        description="Most bytes of uploaded files one API key may keep stored (429 above it; "
        "deleting files frees room).",
    )
    image_root: Path | None = Field(
        default=None,
        description="The directory chat lines may name local images under (a path in an "
        "image_url part; on a fleet, a directory every worker sees at the same path). "
        "Unset: local image paths are refused.",
    )
    image_s3_prefix: str | None = Field(
        default=None,
        description="The s3:// prefix chat lines may name images under. Unset: the bucket of "
        "an s3:// BATCHLLM_STORAGE (the job's storage); with other storage, s3:// images are "
        "refused, so a line cannot make a worker read any object its credentials reach.",
    )
    allow_http_images: bool = Field(
        default=False,
        description="Let chat lines name images by http(s) URL, fetched when the line is "
        "validated and again when it runs. Off: only data: URLs, local paths under "
        "BATCHLLM_IMAGE_ROOT and s3:// objects. Only public addresses are fetched (see "
        "image_http_allow_networks).",
    )
    image_http_allow_networks: str = Field(
        default="",
        description="Comma-separated networks (CIDR, e.g. 10.1.2.0/24,127.0.0.1/32) that "
        "http(s) images may be fetched from besides public addresses: for a private "
        "deployment's image server or a test's local one. Empty: public addresses only "
        "(loopback, private, link-local, shared, multicast and reserved addresses refused). "
        "Cloud metadata addresses are refused even inside these networks.",
    )
    image_fetch_timeout: float = Field(
        default=20.0,
        gt=0,
        description="Seconds one http(s) image fetch may take, redirects and body included.",
    )
    image_fetch_deadline: float = Field(
        default=120.0,
        gt=0,
        description="Seconds the validation of one input file may wait for its http(s) "
        "images in all (its other work does not count); once spent, the file's remaining "
        "http(s) images are error rows.",
    )
    image_fetch_workers: int = Field(
        default=4,
        ge=1,
        le=32,
        description="http(s) images of one input file fetched at once at validation.",
    )
    max_image_bytes: int = Field(
        default=20 * 1024 * 1024,
        ge=1,
        description="Largest encoded image a chat line may give (an image over it is an "
        "error row).",
    )
    max_image_pixels: int = Field(
        default=50_000_000,
        ge=1,
        description="Most pixels (width x height) of one image; checked from its header "
        "before it is decoded, so a small file cannot expand to gigabytes.",
    )
    allow_unsupported_vllm: bool = Field(
        default=False,
        description="Run engines on a vLLM release other than the one batchllm supports "
        "(batchllm.engine.versions.SUPPORTED_VLLM) instead of refusing to start them.",
    )

    @field_validator("image_http_allow_networks")
    @classmethod
    def _networks(cls, value: str) -> str:
        for item in filter(None, (part.strip() for part in value.split(","))):
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError as exc:
                raise ValueError(
                    f"{item!r} is not a network (CIDR, e.g. 10.0.0.0/8): {exc}"
                ) from None
        return value

    @field_validator("keep_alive")
    @classmethod
    def _duration(cls, value: str) -> str:
        duration_seconds(value)  # refuses what it cannot read
        return value

    @property
    def keep_alive_seconds(self) -> float:
        return duration_seconds(self.keep_alive)

    @model_validator(mode="after")
    def _expand_home(self) -> Settings:
        self.home = self.home.expanduser()
        return self

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'batchllm.db'}"

    @property
    def resolved_storage(self) -> str:
        return self.storage or str(self.home / "jobs")

    @property
    def resolved_s3_endpoint(self) -> str:
        """The S3-compatible server of s3:// storage and inputs; "": AWS S3's own."""
        return self.s3_endpoint or ""


_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def duration_seconds(text: str) -> float:
    """Seconds of a keep-alive duration: `300`, `90s`, `5m`, `1h`, `1d`; a negative number is
    forever (math.inf). A ValueError that quotes the text for anything else."""
    value = text.strip().lower()
    number, unit = value.rstrip("smhd"), value[len(value.rstrip("smhd")) :]
    try:
        amount = float(number)
    except ValueError:
        amount = math.nan
    if unit not in _UNITS or math.isnan(amount):
        raise ValueError(
            f"{text!r} is not a duration: give seconds (300), or a number with s, m, h or d "
            "(90s, 5m, 1h); -1 for forever, 0 for none"
        )
    return math.inf if amount < 0 else amount * _UNITS[unit]


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
