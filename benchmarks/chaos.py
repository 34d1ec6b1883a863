"""The chaos run (issue 52): K tenants' jobs and a poison tenant's through N instant-engine
workers on a private Redis and PostgreSQL, a fault every F seconds, then Jepsen-style checks.

The harness starts its own services (batchllm/process/services.py,
benchmarks/private_postgres.py: never the machine's), its workers (`batchllm worker --engine
instant`, paced so that a run lasts minutes; execution/instant.py) and submits the jobs with
the package's submit API (what `batchllm submit` calls). Once they are queued, it injects one
fault every F seconds, drawn in a seeded random order from benchmarks/chaos_faults.py's kinds,
until 90% of the lines are committed (--quiet-after), then
lets the fleet drain until every job is final (Jepsen's heal-then-drain), while a sampler
records the rows the fleet committed (twice a second) and each shard's progress; every job
must be final within --final-within seconds of the last fault. Then it ends its workers and
services, looks for any process of the run left behind, writes `run.json`, and the checker
(benchmarks/chaos_check.py) reads every job's Parquet output and writes `report.json`, a
one-screen summary and `rows.png`. The exit code says whether every check passed.

    python -m benchmarks.chaos                      # the quick run: ~2-3 minutes here
    python -m benchmarks.chaos --lines 1000000 --workers 4 --every 20   # the long one

The workers reach Redis, PostgreSQL and the S3 server through TCP proxies the harness owns
(benchmarks/chaos_proxy.py), so that it can delay or cut their connections (net-delay,
net-partition, s3-errors); the harness itself (the submit, the sampler, the checker) talks to
the services directly. With `--storage s3` (the default) the job storage is a bucket on a
moto S3 server of the run, copied to `storage/` before the server ends; `--storage dir` keeps
it in a local directory (no s3-errors then).

With `--vllm-workers 1` a real vLLM worker (the tiny model, its own engine) takes shards beside
the instant ones, and engine-kill kills its EngineCore. Not injected (issue 52): a full disk
under a local output directory (the run's default output is S3, whose outage s3-errors is).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import batchllm
from batchllm.process.services import RedisServer
from benchmarks import chaos_check
from benchmarks.chaos_disk import SmallDisk, can_mount
from benchmarks.chaos_faults import (
    DIR_ONLY,
    FAULT_KINDS,
    S3_ONLY,
    Injector,
    NoVictim,
    Schedule,
    Workers,
    available_kinds,
)
from benchmarks.chaos_metrics import Scraper
from benchmarks.chaos_proxy import TcpProxy
from benchmarks.chaos_s3 import MotoServer
from benchmarks.chaos_workload import TenantJob, write_tenants
from benchmarks.private_postgres import PostgresCluster

Say = Callable[[str], None]
_REPO = Path(batchllm.__file__).resolve().parents[1]
MAX_MODEL_LEN = 512
FINAL = ("completed", "failed", "cancelled", "expired")
# What the harness owns in its --output directory (removed before a run; the model is kept).
OWNED = (
    "inputs",
    "storage",
    "disk",
    "home",
    "logs",
    "redis",
    "run.json",
    "report.json",
    "rows.png",
)


@dataclass
class Config:
    lines: int = 4000
    workers: int = 2
    vllm_workers: int = 0  # real vLLM workers beside (engine-kill's victims); tiny model
    every: float = 12.0
    tenants: int = 3
    seed: int = 1
    output: Path = Path(".demo/chaos")  # .demo/ is git-ignored (the Makefile's DEMO)
    faults: list[str] | None = None  # default: every kind the storage allows
    storage: str = "s3"  # s3: a bucket on a moto server of the run; dir: a local directory
    poison_lines: int | None = None  # default: lines // 20, at least 22 (each bad kind twice)
    shard_size: int = 100
    step_seconds: float = 0.05  # the instant engine's pace: one token a request per step
    max_tokens: tuple[int, int] = (16, 64)
    lease_seconds: float = 10.0
    reconcile_seconds: float = 3.0
    outage_seconds: float = 5.0
    net_seconds: float = 6.0  # how long a net-delay or net-partition lasts
    net_delay: tuple[float, float] = (0.2, 0.5)  # a chunk's delay under net-delay, seconds
    s3_seconds: float = 6.0  # how long s3-errors lasts
    disk_seconds: float = 6.0  # how long disk-full lasts
    disk_mb: int = 2048  # the small disk's size (--storage dir with disk-full): holds the output
    stop_seconds: float | None = None  # default: a lease, two reconciles and 2 s
    quiet_after: float = 0.9  # no fault once this share of the lines is committed
    final_within: float = 120.0
    timeout: float = 1200.0
    model: str | None = None
    command: str | None = None  # the command line, for the report

    def resolved_poison_lines(self) -> int:
        return self.poison_lines if self.poison_lines is not None else max(22, self.lines // 20)

    def resolved_faults(self) -> list[str]:
        if self.storage not in ("s3", "dir"):
            raise ValueError(f"storage {self.storage!r}: expected s3 or dir")
        if self.faults is None:
            return available_kinds(self.storage, self.vllm_workers)
        unknown = sorted(set(self.faults) - set(FAULT_KINDS))
        if unknown:
            raise ValueError(f"unknown fault kinds {unknown}; known: {', '.join(FAULT_KINDS)}")
        if self.storage != "s3" and set(self.faults) & set(S3_ONLY):
            raise ValueError(f"{', '.join(S3_ONLY)} need the S3 output (--storage s3)")
        if set(self.faults) & set(DIR_ONLY) and not (self.storage == "dir" and can_mount()):
            raise ValueError(
                f"{', '.join(DIR_ONLY)} needs --storage dir and root (to mount the run's small "
                "disk, a tmpfs)"
            )
        if "engine-kill" in self.faults and not self.vllm_workers:
            raise ValueError("engine-kill needs a vLLM worker (--vllm-workers 1)")
        return list(self.faults)

    def resolved_stop_seconds(self) -> float:
        if self.stop_seconds is not None:
            return self.stop_seconds
        return self.lease_seconds + 2 * self.reconcile_seconds + 2

    def worker_settings(self) -> dict[str, str]:
        # Redis's own redelivery is an hour away: a recovery seen is batchllm's (leases, the
        # reconciler), not the broker's.
        return {
            "BATCHLLM_LEASE_SECONDS": str(self.lease_seconds),
            "BATCHLLM_RECONCILE_SECONDS": str(self.reconcile_seconds),
            "BATCHLLM_COMMIT_ROWS": "50",
            "BATCHLLM_COMMIT_SECONDS": "1",
            "BATCHLLM_SHARD_RETRY_SECONDS": "1",
            "BATCHLLM_VISIBILITY_TIMEOUT": "3600",
        }


def chaos_postgres() -> PostgresCluster:
    """The run's cluster (PostgresCluster.disposable: fast, and quick to notice a dead client)."""
    return PostgresCluster.disposable(database="batchllm_chaos")


class Sampler:
    """Twice a second: the rows committed over the run's jobs (None while the database is
    away), each shard's progress when it changes, and when each job was first seen final."""

    def __init__(self, postgres: PostgresCluster, job_ids: list[str], t0: float) -> None:
        self.postgres, self.job_ids, self.t0 = postgres, job_ids, t0
        self.timeline: list[list[Any]] = []
        self.shard_progress: dict[str, list[list[Any]]] = {}
        self.final_at: dict[str, float] = {}
        self.statuses: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._conn: Any = None

    def all_final(self) -> bool:
        return len(self.final_at) == len(self.job_ids)

    def committed(self) -> int:
        return next((c for _, c in reversed(self.timeline) if c is not None), 0)

    def _poll(self) -> None:
        if self._conn is None:
            self._conn = self.postgres.connect()
        jobs = self._conn.execute(
            "SELECT id, status, request_completed + request_failed FROM jobs WHERE id = ANY(%s)",
            (self.job_ids,),
        ).fetchall()
        shards = self._conn.execute(
            "SELECT id, status, rows_ok + rows_failed FROM shards WHERE job_id = ANY(%s)",
            (self.job_ids,),
        ).fetchall()
        now = round(time.monotonic() - self.t0, 2)
        self.timeline.append([now, sum(done for _, _, done in jobs)])
        for job_id, status, _ in jobs:
            self.statuses[job_id] = status
            if status in FINAL:
                self.final_at.setdefault(job_id, now)
        for shard_id, status, done in shards:
            seen = self.shard_progress.setdefault(str(shard_id), [])
            if not seen or seen[-1][1:] != [done, status]:
                seen.append([now, done, status])

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self._poll()
            except Exception:
                self.timeline.append([round(time.monotonic() - self.t0, 2), None])
                self._close()

    def _close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:
                pass
            self._conn = None

    def held(self, worker: str) -> list[dict[str, Any]] | None:
        """The shards `worker` runs now, from a connection of its own."""
        try:
            with self.postgres.connect() as conn:
                rows = conn.execute(
                    "SELECT id, rows_ok + rows_failed FROM shards WHERE status = 'running' "
                    "AND worker = %s AND job_id = ANY(%s)",
                    (worker, self.job_ids),
                ).fetchall()
        except Exception:
            return None
        return [{"id": shard_id, "done": done} for shard_id, done in rows]

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            self._poll()  # the last word, if the database is there
        except Exception:
            pass
        self._close()


def _prepare(config: Config, say: Say) -> str:
    config.output.mkdir(parents=True, exist_ok=True)
    for name in OWNED:
        path = config.output / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    (config.output / "logs").mkdir()
    if config.model:
        return config.model
    from batchllm.engine.models.demo_model import build_demo_model

    model = config.output / "model"
    if not (model / "config.json").exists():
        say("chaos: building the tiny demo model (its tokenizer is what the workers use)")
        build_demo_model(model)
    return str(model)


class Services:
    """The run's private Redis, PostgreSQL and (S3 output) moto server, and a proxy in front
    of each that the workers connect through. `direct` settings are the harness's own."""

    def __init__(self, config: Config) -> None:
        self.redis = RedisServer(work_dir=config.output.resolve() / "redis")
        self.postgres = chaos_postgres()
        self.s3 = (
            MotoServer(log_path=config.output / "logs" / "moto.log")
            if config.storage == "s3"
            else None
        )
        self.proxies = {
            "redis": TcpProxy(name="redis", target_port=self.redis.port),
            "postgres": TcpProxy(name="postgres", target_port=self.postgres.port),
        }
        if self.s3 is not None:
            self.proxies["s3"] = TcpProxy(name="s3", target_port=self.s3.port)
        self.local_storage = str(config.output.resolve() / "storage")
        # disk-full's victim: the job storage on a tmpfs of the run's (copied out at the end).
        self.disk = (
            SmallDisk(config.output.resolve() / "disk", config.disk_mb)
            if "disk-full" in config.resolved_faults()
            else None
        )

    def start(self) -> None:
        self.redis.start()
        self.postgres.start_new()
        if self.s3 is not None:
            self.s3.start()
        if self.disk is not None:
            self.disk.mount()
        for proxy in self.proxies.values():
            proxy.start()

    def stop(self) -> None:
        for proxy in self.proxies.values():
            proxy.stop()
        self.redis.stop()
        self.postgres.destroy()
        if self.s3 is not None:
            self.s3.stop()
        if self.disk is not None:
            self.disk.unmount()

    def pids(self) -> dict[int, str]:
        found = {}
        if self.redis.proc is not None:
            found[self.redis.proc.pid] = "redis-server"
        if self.postgres.pid:
            found[self.postgres.pid] = "postgres"
        if self.s3 is not None and self.s3.proc is not None:
            found[self.s3.proc.pid] = "moto.server"
        return found

    def proxied(self, service: str, url: str, port: int) -> str:
        """`url` with the service's port swapped for its proxy's."""
        return url.replace(f":{port}/", f":{self.proxies[service].port}/", 1)

    @property
    def storage(self) -> str:
        if self.s3 is not None:
            return self.s3.storage
        return str(self.disk.path / "jobs") if self.disk is not None else self.local_storage

    @contextlib.contextmanager
    def credentials(self) -> Iterator[None]:
        """The S3 server's keys in this process's environment (where the AWS SDK reads them)
        for the harness's own S3 calls (the submit), as they were afterwards."""
        if self.s3 is None:
            yield
            return
        keys = {k: v for k, v in self.s3.env("").items() if k.startswith("AWS_")}
        saved = {k: os.environ.get(k) for k in keys}
        os.environ.update(keys)
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def direct(self, home: Path) -> dict[str, Any]:
        """Settings for the harness: every service directly, not through the proxies."""
        return {
            "home": home,
            "database_url": self.postgres.url,
            "broker_url": self.redis.url,
            "storage": self.storage,
            "s3_endpoint": self.s3.endpoint if self.s3 is not None else None,
        }

    def mirror(self, jobs: list[dict[str, Any]]) -> None:
        """S3 output (or the small disk's): copy it to the local storage directory before the
        server ends (the disk is unmounted), and point each job's `checked_root` and
        `checked_output_dir` at the copy."""
        if self.s3 is not None:
            self.s3.mirror(Path(self.local_storage))
        elif self.disk is not None:
            shutil.copytree(self.storage, self.local_storage, dirs_exist_ok=True)
        else:
            return
        for job in jobs:
            job["checked_root"] = self.local_storage
            job["checked_output_dir"] = str(
                Path(self.local_storage, job["output_dir"].removeprefix(self.storage).strip("/"))
            )


def _env(config: Config, services: Services) -> dict[str, str]:
    """The workers' environment: every service through its proxy."""
    redis, postgres = services.redis, services.postgres
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BATCHLLM_", "AWS_"))}
    env.update(config.worker_settings())
    env.update(
        {
            "PYTHONPATH": os.pathsep.join([str(_REPO), *filter(None, [os.getenv("PYTHONPATH")])]),
            "BATCHLLM_HOME": str(config.output.resolve() / "home"),
            "BATCHLLM_DATABASE_URL": services.proxied("postgres", postgres.url, postgres.port),
            "BATCHLLM_BROKER_URL": services.proxied("redis", redis.url, redis.port),
            "BATCHLLM_STORAGE": services.storage,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if services.s3 is not None:
        env.update(services.s3.env(f"http://127.0.0.1:{services.proxies['s3'].port}"))
    return env


def _submit(jobs: list[TenantJob], model: str, config: Config, direct: dict[str, Any]) -> list[str]:
    """Each tenant's job, the way `batchllm submit` sends it (jobs/submit.py), on the
    services directly (`direct`: Services.direct's settings)."""
    from batchllm.input.files.source import resolve_input
    from batchllm.jobs.submit import submit_job
    from batchllm.settings import Settings
    from batchllm.spec import EngineOptions, JobSpec, SamplingDefaults
    from batchllm.store.db import get_engine

    settings = Settings(**direct)
    spec = JobSpec(
        model=model,
        engine=EngineOptions(max_model_len=MAX_MODEL_LEN),
        sampling=SamplingDefaults(max_tokens=config.max_tokens[1], ignore_eos=True),
    )
    try:
        return [
            submit_job(
                resolve_input(job.source, s3_endpoint=settings.resolved_s3_endpoint),
                spec,
                shard_size=config.shard_size,
                settings=settings,
            ).id
            for job in jobs
        ]
    finally:
        get_engine(settings).dispose()  # the harness's connections are not the fleet's


def _job_rows(postgres: PostgresCluster, job_ids: list[str]) -> dict[str, dict[str, Any]]:
    with postgres.connect() as conn:
        rows = conn.execute(
            "SELECT id, storage_root, output_dir, status, request_total, request_completed, "
            "request_failed, error, prompt_tokens, completion_tokens FROM jobs WHERE id = ANY(%s)",
            (job_ids,),
        ).fetchall()
    keys: tuple[str, ...] = ("status", "request_total", "request_completed", "request_failed")
    keys += ("error", "prompt_tokens", "completion_tokens")
    return {
        r[0]: {"storage_root": r[1], "output_dir": r[2], **dict(zip(keys, r[3:]))} for r in rows
    }


def _keep_database(postgres: PostgresCluster, job_ids: list[str], into: Path, say: Say) -> None:
    """The run's shards and checkpoints as CSV files in `into`, before the cluster is destroyed:
    what a failed check is traced back with (which attempt recorded which part file, when)."""
    if not all(re.fullmatch(r"job_[0-9a-f]+", job_id) for job_id in job_ids):
        raise ValueError(f"unexpected job ids {job_ids}")  # they are inlined in COPY below
    ids = ", ".join(f"'{job_id}'" for job_id in job_ids)
    queries = {
        "shards": f"SELECT * FROM shards WHERE job_id IN ({ids}) ORDER BY id",
        "checkpoints": "SELECT c.* FROM checkpoints c JOIN shards s ON s.id = c.shard_id "
        f"WHERE s.job_id IN ({ids}) ORDER BY c.id",
    }
    into.mkdir(exist_ok=True)
    try:
        with postgres.connect() as conn, conn.cursor() as cursor:
            for name, query in queries.items():
                copy_out = cursor.copy(f"COPY ({query}) TO STDOUT WITH CSV HEADER")
                with (into / f"{name}.csv").open("wb") as out, copy_out as copy:
                    for chunk in copy:
                        out.write(chunk)
    except Exception as exc:  # the run's verdict must not depend on this copy
        say(f"chaos: could not keep the database's shards and checkpoints: {exc}")


def _fault_loop(
    config: Config,
    sampler: Sampler,
    injector: Injector,
    workers: Workers,
    *,
    t0: float,
    lines: int,
    say: Say,
) -> list[dict[str, Any]]:
    """A fault every `config.every` seconds (after the previous one is over) until
    `config.quiet_after` of the `lines` are committed; then the fleet drains in peace until
    every job is final (or the run's timeout). Dead workers nobody killed are replaced as they
    are seen, as a supervisor would."""
    kinds = config.resolved_faults()
    schedule = Schedule(kinds, random.Random(config.seed))
    faults: list[dict[str, Any]] = []
    next_at = t0 + config.every
    while not sampler.all_final():
        now = time.monotonic()
        if now - t0 > config.timeout:
            say(f"chaos: jobs not final after {config.timeout:.0f} s: {sampler.statuses}")
            break
        for worker in workers.all:
            worker.note_end()
        gone = workers.replace_unplanned()
        if gone:
            say(f"chaos: UNPLANNED exit of {gone}: replaced")
        quiet = sampler.committed() >= config.quiet_after * lines
        if kinds and now >= next_at and not quiet:
            kind = schedule.next()
            try:
                fault = injector.inject(kind)
            except NoVictim as exc:
                say(f"chaos: t={now - t0:.0f}s {kind} postponed: {exc}")
                schedule.bag.append(kind)
                next_at = time.monotonic() + 5
                continue
            fault["began"] = round(fault["began"] - t0, 2)
            fault["restored"] = round(fault["restored"] - t0, 2)
            faults.append(fault)
            say(
                f"chaos: t={fault['began']:.0f}s {kind} {fault.get('victim') or ''} "
                f"({fault['restored'] - fault['began']:.1f} s) {fault.get('note', '')}".rstrip()
            )
            next_at = max(next_at + config.every, time.monotonic() + 1)
        time.sleep(0.2)
    return faults


def run(config: Config, say: Say = print) -> dict[str, Any]:
    """One chaos run into `config.output`; returns the checker's report."""
    config.resolved_faults()  # refuses unknown kinds before anything starts
    model = _prepare(config, say)
    jobs = write_tenants(
        config.output / "inputs",
        tenants=config.tenants,
        lines=config.lines,
        poison_lines=config.resolved_poison_lines(),
        seed=config.seed,
        max_tokens=config.max_tokens,
    )
    services = Services(config)
    redis, postgres = services.redis, services.postgres
    tag = f"chaos-{uuid.uuid4().hex[:6]}"
    env = _env(config, services)
    engine_args = ["--engine", "instant", "--max-model-len", str(MAX_MODEL_LEN)]
    engine_args += ["--instant-step-seconds", str(config.step_seconds)]
    workers = Workers(
        model=model, env=env, log_dir=config.output / "logs", engine_args=engine_args, tag=tag
    )
    started = time.monotonic()
    t0 = started
    record: dict[str, Any] = {"config": _config_json(config), "tag": tag, "faults": []}
    service_pids: dict[int, str] = {}
    try:
        services.start()
        from batchllm.store.db import upgrade

        upgrade(postgres.url)
        say(
            f"chaos: Redis :{redis.port}, PostgreSQL :{postgres.port}, storage "
            f"{services.storage}; workers through proxies "
            + ", ".join(f"{name} :{p.port}" for name, p in services.proxies.items())
            + f"; {config.workers} workers, {config.vllm_workers} of vLLM"
        )
        workers.start(config.workers)
        if config.vllm_workers:
            vllm_args = ["--engine", "vllm", "--max-model-len", str(MAX_MODEL_LEN)]
            workers.start(config.vllm_workers, vllm_args)
        t0 = time.monotonic()
        with services.credentials():
            job_ids = _submit(jobs, model, config, services.direct(Path(env["BATCHLLM_HOME"])))
        say(f"chaos: {len(job_ids)} jobs submitted in {time.monotonic() - t0:.1f} s: {job_ids}")
        lines = sum(len(chaos_check.expected_lines(job.source)) for job in jobs)
        scraper = Scraper(lambda: _scraped(workers), t0)
        with Sampler(postgres, job_ids, t0) as sampler, scraper:
            injector = Injector(
                workers=workers,
                redis=redis,
                postgres=postgres,
                rng=random.Random(config.seed + 1),
                held=sampler.held,
                stop_seconds=config.resolved_stop_seconds(),
                outage_seconds=config.outage_seconds,
                proxies=services.proxies,
                net_seconds=config.net_seconds,
                net_delay=config.net_delay,
                s3_seconds=config.s3_seconds,
                lease_seconds=config.lease_seconds,
                disk=services.disk,
                disk_seconds=config.disk_seconds,
            )
            record["faults"] = _fault_loop(
                config, sampler, injector, workers, t0=t0, lines=lines, say=say
            )
            # Every job is final: no more commits, so the living workers' counters are exact.
            scraper.scrape_all()
        record["metrics"] = {**scraper.run_entry(), "all_final": sampler.all_final()}
        record["drained"] = round(time.monotonic() - t0, 2)
        workers.stop_all()
        ended = _job_rows(postgres, job_ids)
        _keep_database(postgres, job_ids, config.output / "db", say)
        record["jobs"] = [
            {
                "id": job_id,
                "tenant": job.tenant,
                "input": str(job.source.resolve()),
                "expect": job.expect,
                "final_at": sampler.final_at.get(job_id),
                **ended[job_id],
            }
            for job, job_id in zip(jobs, job_ids)
        ]
        services.mirror(record["jobs"])
        record.update(timeline=sampler.timeline, shard_progress=sampler.shard_progress)
    finally:
        service_pids.update(services.pids())
        workers.stop_all()
        services.stop()
        record["proxies"] = {name: asdict(p.stats) for name, p in services.proxies.items()}
    record["ended"] = round(time.monotonic() - started, 1)
    record["workers"] = workers.records(t0)
    record["unplanned_exits"] = workers.unplanned
    left = workers.leftovers()
    left.update({pid: name for pid, name in service_pids.items() if _alive(pid)})
    record["orphans"] = [{"pid": pid, "cmdline": cmd} for pid, cmd in sorted(left.items())]
    (config.output / "run.json").write_text(json.dumps(record, indent=1) + "\n")
    return chaos_check.write_report(config.output, record)


def _scraped(workers: Workers) -> list[tuple[str, int]]:
    """The workers whose metrics to read: every one alive and not paused, the draining ones too
    (they still commit rows)."""
    return [(w.name, w.metrics_port) for w in workers.all if w.alive() and not w.paused]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def _config_json(config: Config) -> dict[str, Any]:
    data = asdict(config)
    data.update(
        output=str(config.output),
        faults=config.resolved_faults(),
        poison_lines=config.resolved_poison_lines(),
        stop_seconds=config.resolved_stop_seconds(),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        cpus=os.cpu_count(),
    )
    return data


def _span(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    return int(low), int(high or low)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = Config()
    parser.add_argument("--lines", type=int, default=defaults.lines, help="ordinary lines in all")
    parser.add_argument("--workers", type=int, default=defaults.workers)
    parser.add_argument(
        "--every", type=float, default=defaults.every, help="seconds between faults"
    )
    parser.add_argument(
        "--vllm-workers",
        type=int,
        default=defaults.vllm_workers,
        help="real vLLM workers beside the instant ones (the tiny model; engine-kill's victims)",
    )
    parser.add_argument("--tenants", type=int, default=defaults.tenants, help="ordinary tenants")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--output", type=Path, default=defaults.output)
    parser.add_argument(
        "--faults",
        default=None,
        help=f"comma-separated fault kinds ({', '.join(FAULT_KINDS)}); empty: none; "
        "default: every kind the storage allows",
    )
    parser.add_argument(
        "--storage",
        choices=("s3", "dir"),
        default=defaults.storage,
        help="the job storage: a bucket on a moto S3 server of the run (needs moto[server]), "
        "or a local directory (no s3-errors; as root on a tmpfs of the run's, for disk-full)",
    )
    parser.add_argument("--poison-lines", type=int, default=None, help="0: no poison tenant")
    parser.add_argument("--shard-size", type=int, default=defaults.shard_size)
    parser.add_argument(
        "--step-seconds",
        type=float,
        default=defaults.step_seconds,
        help="the instant engine's pace (seconds per token step)",
    )
    parser.add_argument("--max-tokens", default="16-64", help="max_tokens per line, MIN-MAX")
    parser.add_argument("--lease-seconds", type=float, default=defaults.lease_seconds)
    parser.add_argument("--reconcile-seconds", type=float, default=defaults.reconcile_seconds)
    parser.add_argument("--outage-seconds", type=float, default=defaults.outage_seconds)
    parser.add_argument("--stop-seconds", type=float, default=None, help="SIGSTOP's length")
    parser.add_argument(
        "--net-seconds",
        type=float,
        default=defaults.net_seconds,
        help="how long a net-delay or net-partition lasts",
    )
    parser.add_argument(
        "--net-delay", default="200-500", help="a chunk's delay under net-delay, ms MIN-MAX"
    )
    parser.add_argument(
        "--s3-seconds", type=float, default=defaults.s3_seconds, help="how long s3-errors lasts"
    )
    parser.add_argument(
        "--disk-seconds", type=float, default=defaults.disk_seconds, help="how long disk-full lasts"
    )
    parser.add_argument(
        "--disk-mb",
        type=int,
        default=defaults.disk_mb,
        help="the small disk's size (--storage dir with disk-full); it must hold the output",
    )
    parser.add_argument(
        "--quiet-after",
        type=float,
        default=defaults.quiet_after,
        help="no fault once this share of all lines is committed (the drain is fault-free)",
    )
    parser.add_argument(
        "--final-within",
        type=float,
        default=defaults.final_within,
        help="every job must be final this many seconds after the last fault",
    )
    parser.add_argument("--timeout", type=float, default=defaults.timeout)
    parser.add_argument("--model", default=None, help="default: the tiny demo model, built")
    args = parser.parse_args(argv)
    config = Config(
        lines=args.lines,
        workers=args.workers,
        vllm_workers=args.vllm_workers,
        every=args.every,
        tenants=args.tenants,
        seed=args.seed,
        output=args.output,
        faults=None if args.faults is None else [k for k in args.faults.split(",") if k],
        storage=args.storage,
        poison_lines=args.poison_lines,
        shard_size=args.shard_size,
        step_seconds=args.step_seconds,
        max_tokens=_span(args.max_tokens),
        lease_seconds=args.lease_seconds,
        reconcile_seconds=args.reconcile_seconds,
        outage_seconds=args.outage_seconds,
        stop_seconds=args.stop_seconds,
        net_seconds=args.net_seconds,
        net_delay=tuple(ms / 1000 for ms in _span(args.net_delay)),  # type: ignore[arg-type]
        s3_seconds=args.s3_seconds,
        disk_seconds=args.disk_seconds,
        disk_mb=args.disk_mb,
        quiet_after=args.quiet_after,
        final_within=args.final_within,
        timeout=args.timeout,
        model=args.model,
        command="python -m benchmarks.chaos " + " ".join(sys.argv[1:] if argv is None else argv),
    )
    # A SIGTERM (`timeout`, a CI stop) ends the run through its `finally`: workers and services
    # stopped by PID, none left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report = run(config, say=lambda text: print(text, file=sys.stderr, flush=True))
    print(chaos_check.summary(report))
    print(f"report: {config.output / 'report.json'}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
