"""Request features measured: the same prompts as a plain job, a JSON-schema job, a choice job,
a top-5 logprobs job and an n=4 job, one after another on one shared engine, and a mixed job
whose plain rows are timed against a control.

Every job goes through the real `run_job` and asks for the same max_tokens; plain, logprobs and
n=4 rows run to it (`ignore_eos`), JSON and choice rows stop with their grammar, hence requests/s
beside tokens/s. The engine has `compact_json` (random weights otherwise fill the JSON with
whitespace) and no prefix caching (every job runs the same prompts). The mixed job interleaves
plain rows with JSON, choice and logprobs rows; its control keeps the plain rows and makes the
others plain with exactly their mixed counterparts' token counts, so both keep the engine equally
busy and the plain rows' times differ only by the features' cost. Both also run through raw
`LLM.generate`, which tells how much of a slowdown is vLLM's own.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from batchllm.bench.figures import BenchFailed, Contender, Run, job_run
from batchllm.bench.memory import PeakRss
from batchllm.bench.own_engine import OwnEnginePart, Say
from batchllm.bench.workload import TEMPERATURE, Request, Workload, iter_requests
from batchllm.engine.prompts import Prepared
from batchllm.engine.protocol import Adapter, Engine, Finished
from batchllm.execution.engines import EngineCache
from batchllm.input.formats.rows import InputRow
from batchllm.settings import Settings
from batchllm.spec import EngineOptions, JobSpec, SamplingDefaults
from batchllm.store.models import Job

SCHEMA = {
    "type": "object",
    "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "sarcastic": {"type": "boolean"},
    },
    "required": ["sentiment", "sarcastic"],
    "additionalProperties": False,
}
CHOICES = ["positive", "negative", "neutral"]
TOP_LOGPROBS = 5
SAMPLES = 4
_RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}}

JOBS = {
    "plain": "plain (unconstrained)",
    "json": "JSON schema (enum + boolean)",
    "choice": f"choice of {len(CHOICES)} labels",
    "logprobs": f"top-{TOP_LOGPROBS} logprobs",
    "n4": f"n={SAMPLES} samples",
    "mixed": "mixed: plain + json/choice/logprobs",
    "control": "control: the mixed load, all plain",
}
# The kinds of the mixed job's odd lines, in turn.
_MIXED = ("json", "choice", "logprobs")
# The mixed job's plain rows, and the same lines in the control and the plain job.
HALVES = {
    "mixed": "mixed job: its plain rows",
    "control": "control job: the same rows",
    "plain": "plain job: the same rows",
}
# The settings batchllm stores for each kind of line (input/validation/validate.py): what raw
# vLLM's twin of each job is given, through batchllm's own SamplingParams construction.
_RAW: dict[str, dict[str, Any]] = {
    "plain": {"ignore_eos": True},
    "json": {"structured": {"json": SCHEMA}},
    "choice": {"structured": {"choice": CHOICES}},
    "logprobs": {"ignore_eos": True, "logprobs": TOP_LOGPROBS},
    "n4": {"ignore_eos": True, "n": SAMPLES},
}
_WARMUP_ROWS = 40


def line_fields(kind: str, max_tokens: int) -> dict[str, Any]:
    """What a line of this kind asks for beside its messages and temperature."""
    full: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": True}
    kinds: dict[str, dict[str, Any]] = {
        "plain": full,
        # No ignore_eos: it would let the row run on, unconstrained, past the grammar's end.
        "json": {"max_tokens": max_tokens, "response_format": _RESPONSE_FORMAT},
        "choice": {"max_tokens": max_tokens, "choice": CHOICES},
        "logprobs": {**full, "logprobs": True, "top_logprobs": TOP_LOGPROBS},
        "n4": {**full, "n": SAMPLES},
    }
    return kinds[kind]


def mixed_kind(index: int) -> str:
    """The kind of the mixed job's line `index` (0-based): plain on even lines."""
    return "plain" if index % 2 == 0 else _MIXED[(index // 2) % len(_MIXED)]


def write_lines(path: Path, requests: list[Request], fields: Callable[[int], dict]) -> Path:
    """batchllm's chat lines, one per request, with `fields(index)` on each."""
    with path.open("w") as out:
        for i, request in enumerate(requests):
            line = {
                "custom_id": request.custom_id,
                "messages": request.messages,
                "temperature": TEMPERATURE,
                **fields(i),
            }
            out.write(json.dumps(line) + "\n")
    return path


# -- timing each request of a job ----------------------------------------------------------------


@dataclass
class Timeline:
    """Per engine request: when the runner added it and its prompt ids (which tell its line),
    and when it finished with how many generated tokens."""

    added: dict[str, tuple[float, list[int]]] = field(default_factory=dict)
    finished: dict[str, tuple[float, int]] = field(default_factory=dict)


class _TimedEngine:
    """The shared engine as the runner sees it, noting each request's add and finish on the
    timeline: a clock read and a dict write per request, for every job of this part alike."""

    def __init__(self, engine: Engine, timeline: Timeline) -> None:
        self._engine = engine
        self._timeline = timeline
        self.version = engine.version
        self.hardware = engine.hardware
        self.max_num_seqs = engine.max_num_seqs
        self.max_model_len = engine.max_model_len

    def prepare(self, rows: list[InputRow], chat_template: str | None = None) -> list[Prepared]:
        return self._engine.prepare(rows, chat_template)

    def sampling_params(self, merged: dict[str, Any]) -> Any:
        return self._engine.sampling_params(merged)

    def add(
        self, request_id: str, token_ids: Any, params: Any, adapter: Adapter | None = None
    ) -> None:
        self._engine.add(request_id, token_ids, params, adapter)
        self._timeline.added[request_id] = (time.perf_counter(), token_ids)

    def step(self) -> list[Finished]:
        finished = self._engine.step()
        now = time.perf_counter()
        for out in finished:
            self._timeline.finished[out.request_id] = (now, out.generated_tokens)
        return finished

    def has_unfinished(self) -> bool:
        return self._engine.has_unfinished()

    def abort(self, request_ids: list[str]) -> None:
        self._engine.abort(request_ids)

    def shutdown(self) -> None:
        self._engine.shutdown()


class _TimedEngines:
    """An EngineSource over one warm engine whose requests land on `timeline` (set per job)."""

    def __init__(self, settings: Settings) -> None:
        self.cache = EngineCache(settings)
        self.timeline = Timeline()

    @property
    def engine(self) -> Engine | None:
        return self.cache.engine

    def get(self, spec: JobSpec, max_model_len: int) -> Engine:
        return _TimedEngine(self.cache.get(spec, max_model_len), self.timeline)

    def close(self) -> None:
        self.cache.close()


@dataclass
class _Done:
    run: Run
    job: Job
    timeline: Timeline
    rows: dict[str, dict[str, Any]]  # custom_id -> output row


def _run_job(engines: _TimedEngines, spec: JobSpec, source: Path, settings: Settings) -> _Done:
    """The whole `run_job`, timed like the engine part's batchllm contender: from the end of
    validation and storage to the finished job. Error rows would make the figures meaningless."""
    from batchllm.bench.contenders import timed_run_job
    from batchllm.output.parts import read_output
    from batchllm.storage import Storage
    from batchllm.store.models import JobStatus

    engines.timeline = timeline = Timeline()
    with PeakRss() as memory:
        timed = timed_run_job(engines, spec, source, settings)
    job = timed.job
    if job.status is not JobStatus.COMPLETED or job.request_failed:
        raise BenchFailed(
            f"bench job {job.id} ended {job.status.value} with {job.request_failed} error "
            f"rows: {job.error or 'see its output'}"
        )
    table = read_output(Storage.of(settings), job.output_dir)
    run = job_run(  # no error rows (checked above): every request completed
        job,
        seconds=timed.ended - timed.stored,
        peak_rss=memory.peak,
        structured_rows=job.structured_rows,
        structured_valid=job.structured_valid,
    )
    return _Done(run, job, timeline, {r["custom_id"]: r for r in table.to_pylist()})


def plain_half(done: _Done, lines: dict[tuple[int, ...], int]) -> Run:
    """The even lines' requests of a job as a run of their own: from the job's first request
    reaching the engine until the last of them finished (`lines`: prompt ids -> line index)."""
    start = min(added for added, _ in done.timeline.added.values())
    ends, latencies, prompt_tokens, output_tokens = [], [], 0, 0
    for request_id, (added, ids) in done.timeline.added.items():
        if lines[tuple(ids)] % 2:
            continue
        finished, generated = done.timeline.finished[request_id]
        ends.append(finished)
        latencies.append(finished - added)
        prompt_tokens += len(ids)
        output_tokens += generated
    return Run(
        seconds=max(ends) - start,
        requests=len(ends),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        peak_rss=done.run.peak_rss,
        extra={"median_latency_seconds": statistics.median(latencies)},
    )


def _check(kind: str, done: _Done) -> None:
    """Fail loudly when a job did not get its feature: its figures would be the plain job's."""
    rows = list(done.rows.values())
    if kind in ("json", "choice") and done.job.structured_rows != len(rows):
        raise BenchFailed(f"{kind} job {done.job.id}: not every row ran constrained")
    if kind == "logprobs" and not all(
        r["logprobs"] and all(len(t["top_logprobs"]) == TOP_LOGPROBS for t in r["logprobs"])
        for r in rows
    ):
        raise BenchFailed(f"logprobs job {done.job.id}: rows without {TOP_LOGPROBS} alternatives")
    if kind == "n4" and not all(r["choices"] and len(r["choices"]) == SAMPLES for r in rows):
        raise BenchFailed(f"n={SAMPLES} job {done.job.id}: rows without {SAMPLES} samples")


def run_features(
    setup: OwnEnginePart, *, requests: int, prompt_words: tuple[int, int], max_tokens: int
) -> dict[str, Any]:
    """Every job of this part on one engine started here; the part's figures for bench.json."""
    from batchllm.bench.contenders import engine_info
    from batchllm.engine.sizing import size_max_model_len

    workload = Workload(
        requests=requests,
        prompt_words=prompt_words,
        output_tokens=(max_tokens, max_tokens),
        seed=setup.seed + 2,
    )
    prompts = list(iter_requests(workload, 0))
    rows = [r.row(line) for line, r in enumerate(prompts, start=1)]
    setup.say("[features] sizing the context")
    max_model_len = size_max_model_len(
        setup.model, rows, SamplingDefaults(max_tokens=max_tokens), settings=setup.settings
    )
    spec = JobSpec(
        model=setup.model,
        sampling=SamplingDefaults(max_tokens=max_tokens, temperature=TEMPERATURE),
        engine=EngineOptions(
            max_model_len=max_model_len,
            compact_json=True,
            enable_prefix_caching=False,
            enforce_eager=setup.enforce_eager,
            # Rows fed in file order: the mixed and control jobs then queue their plain rows
            # at the same places (prefix grouping would order the two files differently;
            # these prompts share no prefix for it to gain on anyway).
            group_prefixes=False,
        ),
    )
    setup.workdir.mkdir(parents=True, exist_ok=True)
    engines = _TimedEngines(setup.settings)
    setup.say(f"[features] starting the vLLM engine (compact_json, max_model_len {max_model_len})")
    started = time.perf_counter()
    engine = engines.cache.get(spec, max_model_len)
    info = engine_info(
        engine,
        started=started,
        max_model_len=max_model_len,
        compact_json=True,
        prefix_caching=False,
    )
    try:
        part = _Part(
            prompts, engine.prepare(rows), engines, spec, setup.settings, setup.workdir, setup.say
        )
        part.take_turns(setup.repeats)
    finally:
        engines.close()
    return part.figures(workload, info)


class _Part:
    """The jobs of this part and their raw vLLM twins, on the engine `engines` holds."""

    def __init__(
        self,
        prompts: list[Request],
        prepared: list[Prepared],
        engines: _TimedEngines,
        spec: JobSpec,
        settings: Settings,
        workdir: Path,
        say: Say,
    ) -> None:
        self.prompts = prompts
        self.engines = engines
        self.spec = spec
        self.settings = settings
        self.workdir = workdir
        self.say = say
        self.max_tokens = spec.sampling.max_tokens
        # Prompt ids -> line index: which requests are a job's plain (even) lines.
        self.lines: dict[tuple[int, ...], int] = {}
        for i, ids in enumerate(prepared):
            if isinstance(ids, str):
                raise BenchFailed(f"a feature prompt cannot run: {ids}")
            self.lines[tuple(cast(list[int], ids))] = i
        if len(self.lines) != len(prompts):
            raise BenchFailed("the feature prompts are not distinct")
        self.token_prompts = [{"prompt_token_ids": list(ids)} for ids in self.lines]
        self.jobs = {key: Contender(key, label) for key, label in JOBS.items()}
        self.raw = {key: Contender(f"vllm_{key}", f"raw vLLM: {key}") for key in JOBS}
        self.plain_rows = {k: Contender(f"{k}_plain_rows", label) for k, label in HALVES.items()}

    def take_turns(self, repeats: int) -> None:
        """Each job once per repeat, in turn, so drift on a busy machine hits all alike, each
        followed by its raw vLLM twin; the control right after the mixed job. A warm-up job
        first: it compiles the JSON and choice grammars (vLLM keeps them per engine, as a long
        job pays for them once) and runs every feature's code path once."""
        self.say("[features] warming up (one job with every feature)")
        kinds = ("plain", "json", "choice", "logprobs", "n4")
        self._job("warmup", lambda i: line_fields(kinds[i % len(kinds)], self.max_tokens))
        for repeat in range(repeats):
            said = f"repeat {repeat + 1}/{repeats}"
            for key in ("plain", "json", "choice", "logprobs", "n4", "mixed"):
                done = self._timed(key, _fields_of(key, self.max_tokens), said)
                _check(key, done)
                if key in ("plain", "mixed"):
                    self.plain_rows[key].runs.append(plain_half(done, self.lines))
                line_kinds = [
                    mixed_kind(i) if key == "mixed" else key for i in range(len(self.prompts))
                ]
                outputs = self._raw_twin(key, [_RAW[kind] for kind in line_kinds], said)
            # The last job of the turn was the mixed one: now its control, with each side's own.
            mixed, raw_mixed = done, outputs
            control = _control_of(mixed, self.prompts, self.max_tokens)
            self.plain_rows["control"].runs.append(
                plain_half(self._timed("control", control, said), self.lines)
            )
            rows = self.plain_rows["mixed"].runs[-1], self.plain_rows["control"].runs[-1]
            self.say(
                f"[features] plain rows, {said}: done in {rows[0].seconds:.1f} s in the mixed "
                f"job, {rows[1].seconds:.1f} s in the control"
            )
            # Raw vLLM's control: its own mixed run's load, without the features.
            self._raw_twin(
                "control",
                [
                    _RAW["plain"]
                    if i % 2 == 0
                    else {"ignore_eos": True, "max_tokens": len(out.outputs[0].token_ids)}
                    for i, out in enumerate(raw_mixed)
                ],
                said,
            )

    def _job(self, key: str, fields: Callable[[int], dict]) -> _Done:
        source = write_lines(self.workdir / f"features-{key}.jsonl", self.prompts, fields)
        return _run_job(self.engines, self.spec, source, self.settings)

    def _timed(self, key: str, fields: Callable[[int], dict], said: str) -> _Done:
        done = self._job(key, fields)
        self.jobs[key].runs.append(done.run)
        self._said(JOBS[key], said, done.run)
        return done

    def _said(self, label: str, said: str, run: Run) -> None:
        self.say(
            f"[features] {label}, {said}: {run.requests / run.seconds:,.1f} req/s, "
            f"{run.output_tokens_per_s:,.0f} output tokens/s ({run.seconds:.1f} s)"
        )

    def _raw_twin(self, key: str, overrides: list[dict[str, Any]], said: str) -> list[Any]:
        """Job `key`'s requests through one raw `LLM.generate` call: token ids (as in the engine
        part, the engine alone), and the sampling parameters batchllm builds for those lines
        (VllmEngine.sampling_params), so the two differ only by batchllm's job path."""
        engine = self.engines.cache.engine
        if engine is None:
            raise BenchFailed("the features engine is gone")
        params = [
            engine.sampling_params(self.spec.sampling.merged({"max_tokens": self.max_tokens, **o}))
            for o in overrides
        ]
        with PeakRss() as memory:
            started = time.perf_counter()
            outputs = engine.llm.generate(self.token_prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - started
        run = Run(
            seconds=seconds,
            requests=len(outputs),
            prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
            output_tokens=sum(len(c.token_ids) for o in outputs for c in o.outputs),
            peak_rss=memory.peak,
        )
        self.raw[key].runs.append(run)
        self._said(f"raw vLLM, {key}", said, run)
        return outputs

    def figures(self, workload: Workload, info: dict[str, Any]) -> dict[str, Any]:
        def paired(pair: tuple[Contender, Contender], figure: Callable[[Run], float]) -> float:
            """The median over repeats of the first side's figure over the second's, each pair
            run back to back (so drift on a busy machine cancels out of the ratio)."""
            return statistics.median(figure(a) / figure(b) for a, b in zip(*(c.runs for c in pair)))

        def speed(run: Run) -> float:
            return run.output_tokens_per_s

        def rate(run: Run) -> float:
            return run.requests / run.seconds

        jobs = {key: c.summary() for key, c in self.jobs.items()}
        raw = {key: c.summary() for key, c in self.raw.items()}
        for key, figures in jobs.items():
            runs = self.jobs[key].runs
            for name, sides in (("", jobs), ("raw_", raw)):
                sides[key][f"requests_ratio_to_{name}plain"] = (
                    sides[key]["requests_per_s"]["median"]
                    / sides["plain"]["requests_per_s"]["median"]
                )
                sides[key][f"tokens_ratio_to_{name}plain"] = (
                    sides[key]["output_tokens_per_s"]["median"]
                    / sides["plain"]["output_tokens_per_s"]["median"]
                )
            figures["output_tokens_per_request"] = figures["output_tokens"] / figures["requests"]
            # Requests/s: JSON and choice rows sample their length, so tokens differ a little.
            figures["requests_ratio_to_raw"] = paired((self.jobs[key], self.raw[key]), rate)
            constrained = sum(r.extra["structured_rows"] for r in runs)
            if constrained:
                figures["structured_rows"] = constrained
                figures["structured_valid"] = sum(r.extra["structured_valid"] for r in runs)
        plain_rows = {key: c.summary() for key, c in self.plain_rows.items()}
        for key, figures in plain_rows.items():
            figures["median_latency_seconds"] = statistics.median(
                r.extra["median_latency_seconds"] for r in self.plain_rows[key].runs
            )
        rows = (self.plain_rows["mixed"], self.plain_rows["control"])
        return {
            "workload": asdict(workload),
            "max_tokens": self.max_tokens,
            "schema": SCHEMA,
            "choices": CHOICES,
            "top_logprobs": TOP_LOGPROBS,
            "samples": SAMPLES,
            "engine": info,
            "jobs": jobs,
            "raw": raw,
            "plain_rows": plain_rows,
            # The figures the mixed job exists for, mixed over control (1.0: not slowed; the
            # latency ratio above 1.0: slower). Output tokens/s: both sides generate the same.
            "mixed_vs_control": {
                "plain_rows": paired(rows, speed),
                "plain_rows_latency": paired(rows, lambda run: run.extra["median_latency_seconds"]),
                "job": paired((self.jobs["mixed"], self.jobs["control"]), speed),
                "raw_vllm": paired((self.raw["mixed"], self.raw["control"]), speed),
            },
        }


def _fields_of(key: str, max_tokens: int) -> Callable[[int], dict]:
    """The line fields of job `key`, by line index."""
    if key == "mixed":
        return lambda i: line_fields(mixed_kind(i), max_tokens)
    return lambda _i: line_fields(key, max_tokens)


def _control_of(mixed: _Done, prompts: list[Request], max_tokens: int) -> Callable[[int], dict]:
    """The control job's line fields: the mixed job's load, row by row, without its features
    (odd lines plain, generating exactly the tokens the mixed job's line generated)."""
    generated = {custom_id: row["completion_tokens"] for custom_id, row in mixed.rows.items()}

    def fields(i: int) -> dict:
        if i % 2 == 0:
            return line_fields("plain", max_tokens)
        return {"max_tokens": generated[prompts[i].custom_id], "ignore_eos": True}

    return fields
