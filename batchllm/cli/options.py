"""Flags shared by `run` and `submit`: the input file, job-level sampling defaults and engine
settings, and the checks that refuse a hopeless job before any work; and the flags `worker`
shares with them (--engine) and with `serve` (--log-format). The engine's own flags are
cli/engine_flags.py's."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from batchllm.cli.engine_flags import (
    ENGINE_SHAPE_FLAGS,
    choice_option,
    count_option,
    engine_default,
    float_option,
    share_option,
)
from batchllm.input.job_spec import OptionOverLimit, build_job_spec
from batchllm.settings import get_settings
from batchllm.spec import MAX_TOKENS_LIMIT, MAX_TOP_LOGPROBS, JobSpec, SamplingDefaults

if TYPE_CHECKING:  # pyarrow stays out of `batchllm --help`'s imports
    from batchllm.input.files.source import InputSource

# Hugging Face's own rule for `name` or `org/name` (huggingface_hub's validate_repo_id).
_REPO_ID = re.compile(r"(?!.*(--|\.\.))[\w.-]{1,96}(/[\w.-]{1,96})?")
_PATH_STARTS = ("/", "./", "../", "~")


class InputFile(click.ParamType):
    """FILE of `run` and `submit`: a local JSONL, Parquet or CSV file (checked as click.Path
    checks it), or a URI such as s3://bucket/prompts.jsonl (checked through its store,
    pyarrow's filesystem), resolved once into the InputSource (input/files/source.py) that every
    step after takes; before any job is created."""

    name = "file"

    def __init__(self) -> None:
        self._local = click.Path(exists=True, dir_okay=False, path_type=Path)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from batchllm.errors import BatchLLMError
        from batchllm.input.files.source import InputSource, resolve_input

        if isinstance(value, InputSource):
            return value
        endpoint = get_settings().resolved_s3_endpoint
        if isinstance(value, str) and "://" in value:
            try:
                return resolve_input(value, s3_endpoint=endpoint)
            except BatchLLMError as exc:
                self.fail(str(exc), param, ctx)
        path = self._local.convert(value, param, ctx)
        if not path.is_file():
            # The file is read more than once (to find a request, then to validate and store
            # it): a named pipe would block the second read forever.
            self.fail(
                f"{path} is not a regular file (a pipe or device is read only once); "
                "save the input to a file first",
                param,
                ctx,
            )
        try:
            return resolve_input(path, s3_endpoint=endpoint)
        except BatchLLMError as exc:
            self.fail(str(exc), param, ctx)

    def shell_complete(self, ctx: click.Context, param: click.Parameter, incomplete: str):
        return self._local.shell_complete(ctx, param, incomplete)


def input_file(command):
    """FILE, or `--from JOB` (another job's rows) instead; `job_input` resolves either."""
    command = click.option(
        "--from-status",
        "from_status",
        default="ok",
        show_default=True,
        metavar="STATUSES",
        help="With --from: the parent's rows of these output statuses, comma-separated "
        "(ok, error).",
    )(command)
    command = click.option(
        "--from",
        "from_job",
        default=None,
        metavar="JOB",
        help="Instead of FILE: a completed job's rows (prompt, text, finish_reason, "
        "embedding, ... and custom_id, which each row keeps). The prompt is the parent's "
        "answer (text) unless --prompt-template, --prompt-column or --messages-column says "
        "otherwise.",
    )(command)
    return click.argument("file", type=InputFile(), required=False)(command)


@contextmanager
def job_input(
    file: InputSource | None, from_job: str | None, from_status: str, flags: dict[str, Any]
) -> Iterator[InputSource]:
    """The job's input: FILE as resolved, or a parent's rows (`--from`, a temporary table for
    as long as the job is being created), with the child's table options put in `flags`."""
    if from_job is None:
        if file is None:
            raise click.UsageError("give FILE, or --from JOB to read another job's rows")
        yield file
        return
    if file is not None:
        raise click.UsageError(f"give FILE ({file}) or --from {from_job}, not both")
    from batchllm.input.job_rows import JobRows, child_options
    from batchllm.jobs.parent_rows import parent_input

    rows = JobRows(from_job, tuple(s.strip() for s in from_status.split(",") if s.strip()))
    flags.update(child_options(rows, flags))
    with parent_input(rows, get_settings()) as source:
        yield source


def _sampling(name: str):
    """A flag's default from the job schema, so the CLI and the Python API cannot drift."""
    return SamplingDefaults.model_fields[name].default


def job_options(command):
    """A job's input (`input_file`) and every flag of its spec: what `run` and `submit` share."""
    decorators = [
        click.option("--model", "-m", required=True, help="Model path or name as vLLM loads it."),
        choice_option(
            "--task",
            choices=["generate", "embed", "classify"],
            help="generate text, embed the lines' inputs (and score /v1/score and /v1/rerank "
            "lines) with vLLM's pooling runner, or classify them with a sequence-"
            'classification model [default: from the file\'s first line: {"input": ...}, '
            "/v1/embeddings, /v1/score or /v1/rerank lines embed; /v1/classify lines "
            "classify].",
        ),
        click.option(
            "--prompt-column",
            default=None,
            metavar="COLUMN",
            help="FILE is a Parquet or CSV table: each row's prompt is in this column.",
        ),
        click.option(
            "--messages-column",
            default=None,
            metavar="COLUMN",
            help="FILE is a Parquet or CSV table: each row's chat messages (a list of "
            "{role, content}, or its JSON text) are in this column.",
        ),
        click.option(
            "--prompt-template",
            default=None,
            metavar="TEXT",
            help="Build each row's prompt from its named fields, Python str.format style: "
            "'Q: {question}' ({{ and }} for literal braces). Fields are a table's columns, a "
            "JSONL file's keys (one JSON object per line) or, with --from, the parent job's "
            "columns (prompt, text, ...).",
        ),
        click.option(
            "--id-column",
            default=None,
            metavar="COLUMN",
            help="A table's column whose value becomes each row's custom_id, to join the "
            "output back on [default: the row number, from 1; a templated JSONL line's own "
            "custom_id].",
        ),
        click.option(
            "--system",
            default=None,
            metavar="TEXT",
            help="A system message put before every table row's (or templated line's) prompt "
            "or messages.",
        ),
        click.option(
            "--dry-run",
            is_flag=True,
            help="Validate, count the prompt tokens and estimate the output tokens and the "
            "time, then exit: no job, no engine.",
        ),
        click.option(
            "--max-tokens",
            type=click.IntRange(1, MAX_TOKENS_LIMIT),
            default=_sampling("max_tokens"),
            show_default=True,
            help="Default most tokens to generate per request (lines may override).",
        ),
        float_option(
            "--temperature",
            default=_sampling("temperature"),
            help="Default sampling temperature; 0 is greedy.",
        ),
        share_option("--top-p", default=_sampling("top_p"), help="Default nucleus sampling mass."),
        click.option("--ignore-eos", is_flag=True, help="Always generate max_tokens tokens."),
        click.option(
            "--n",
            "n",
            type=click.IntRange(1),
            default=_sampling("n"),
            show_default=True,
            help="Samples per request (lines may override with `n`; at most BATCHLLM_MAX_N).",
        ),
        click.option(
            "--logprobs",
            type=click.IntRange(0, MAX_TOP_LOGPROBS),
            default=None,
            help="Log probabilities of every generated token, with this many alternatives "
            "each (lines may override).",
        ),
        click.option(
            "--json-schema",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            default=None,
            help="Constrain every answer to this JSON schema (a file); a line's own "
            "constraint replaces it.",
        ),
        click.option(
            "--choice",
            default=None,
            metavar="A,B,C",
            help="Constrain every answer to one of these labels (comma-separated).",
        ),
        click.option(
            "--regex", default=None, help="Constrain every answer to fully match this regex."
        ),
        click.option(
            "--chat-template",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            default=None,
            help="A Jinja chat template file replacing the model's own for chat lines.",
        ),
        click.option(
            "--reasoning-parser",
            default=None,
            metavar="NAME",
            help="vLLM's reasoning parser (e.g. deepseek_r1, qwen3): the thinking goes to the "
            "`reasoning` column, the answer to `text`.",
        ),
        click.option(
            "--tool-call-parser",
            default=None,
            metavar="NAME",
            help="vLLM's tool call parser (e.g. hermes, llama3_json): reads the tool calls "
            "of lines with tools and tool_choice auto.",
        ),
        click.option(
            "--strict",
            is_flag=True,
            help="Refuse the whole file if any line is invalid (default: invalid lines "
            "become error rows and the rest runs).",
        ),
        share_option(
            "--gpu-memory-utilization",
            default=engine_default("gpu_memory_utilization"),
            help="Share of GPU memory for vLLM.",
        ),
        count_option(
            "--max-model-len",
            least=16,
            help="Context length [default: longest prompt + max_tokens, capped by the model].",
        ),
        *ENGINE_SHAPE_FLAGS,
        click.option(
            "--compact-json",
            is_flag=True,
            help="JSON-constrained answers without whitespace between tokens (fewer tokens; "
            "vLLM's xgrammar backend for every constraint).",
        ),
        click.option(
            "--no-group-prefixes",
            is_flag=True,
            help="Run requests in file order instead of grouping shared prefixes.",
        ),
        click.option(
            "--lora",
            multiple=True,
            metavar="NAME=PATH",
            help='A LoRA adapter directory lines may pick with "adapter": NAME (or, in the '
            "OpenAI form, body.model NAME); copied into the job's storage (repeatable).",
        ),
        count_option("--max-lora-rank", help="Largest adapter rank [default: vLLM's, 16]."),
        click.option(
            "--metadata", multiple=True, metavar="KEY=VALUE", help="Label the job (repeatable)."
        ),
    ]
    for decorate in reversed(decorators):
        command = decorate(command)
    return input_file(command)


notify_option = click.option(
    "--notify",
    metavar="URL",
    default=None,
    help="POST a signed batch.completed/failed/cancelled/expired event to URL when the job "
    "ends (retried until delivered; secret: BATCHLLM_WEBHOOK_SECRET or a new one, printed).",
)


def engine_kind_options(engine_help: str, step_help: str):
    """--engine (vllm, or the instant engine that simulates one) and its pace,
    --instant-step-seconds, for `run` and `worker`; each command's help says what an instant
    engine is for there."""

    def decorate(command):
        command = click.option(
            "--instant-step-seconds",
            type=click.FloatRange(min=0),
            default=0.0,
            show_default=True,
            help=step_help,
        )(command)
        return click.option(
            "--engine",
            "engine_kind",
            type=click.Choice(["vllm", "instant"]),
            default="vllm",
            show_default=True,
            help=engine_help,
        )(command)

    return decorate


def log_format_option(help: str):
    """--log-format of the commands that start long-lived processes (`worker`, `serve`)."""
    return click.option(
        "--log-format",
        type=click.Choice(["text", "json"]),
        default="text",
        show_default=True,
        envvar="BATCHLLM_LOG_FORMAT",  # the processes it starts get --log-format itself
        help=help,
    )


def echo_webhook_secret(secret: str | None, url: str | None) -> None:
    """Tell the user the secret a new job's webhook is signed with (unless it is their own,
    BATCHLLM_WEBHOOK_SECRET)."""
    if secret is not None and not get_settings().webhook_secret:
        click.echo(f"webhook to {url} signed with secret {secret}", err=True)


def spec_from_flags(flags: dict, file: InputSource | None = None) -> JobSpec:
    """The job spec the flags describe; the task, when not given, from FILE's lines."""
    metadata = _pairs(flags.pop("metadata", ()), "--metadata")
    adapters = _pairs(flags.pop("lora", ()), "--lora")
    for name, path in adapters.items():
        if not Path(path).expanduser().is_dir():
            raise click.BadParameter(f"{name}={path}: no such directory", param_hint="--lora")
    template_file = flags.pop("chat_template")
    try:
        spec = build_job_spec(
            flags.pop("model"),
            settings=get_settings(),
            requests=file,
            lora=adapters,
            chat_template=template_file.read_text() if template_file else None,
            metadata=metadata,
            prompt_column=flags.pop("prompt_column"),
            messages_column=flags.pop("messages_column"),
            prompt_template=flags.pop("prompt_template"),
            id_column=flags.pop("id_column"),
            system=flags.pop("system"),
            priority=flags.pop("priority", "normal"),
            reasoning_parser=flags.pop("reasoning_parser"),
            tool_call_parser=flags.pop("tool_call_parser"),
            parents=flags.pop("parents", None),
            after=flags.pop("after", None),
            task=flags.pop("task"),
            max_tokens=flags.pop("max_tokens"),
            temperature=flags.pop("temperature"),
            top_p=flags.pop("top_p"),
            ignore_eos=flags.pop("ignore_eos"),
            n=flags.pop("n"),
            logprobs=flags.pop("logprobs"),
            structured=_job_constraint(
                flags.pop("json_schema"), flags.pop("choice"), flags.pop("regex")
            ),
            gpu_memory_utilization=flags.pop("gpu_memory_utilization"),
            max_model_len=flags.pop("max_model_len"),
            max_num_seqs=flags.pop("max_num_seqs"),
            max_num_batched_tokens=flags.pop("max_num_batched_tokens"),
            dtype=flags.pop("dtype"),
            quantization=flags.pop("quantization"),
            tensor_parallel_size=flags.pop("tensor_parallel_size"),
            enable_prefix_caching=flags.pop("prefix_caching"),
            enforce_eager=flags.pop("enforce_eager"),
            compact_json=flags.pop("compact_json"),
            kv_cache_memory_bytes=flags.pop("kv_cache_memory_bytes"),
            max_lora_rank=flags.pop("max_lora_rank"),
            group_prefixes=not flags.pop("no_group_prefixes"),
        )
    except OptionOverLimit as exc:
        raise click.BadParameter(exc.reason, param_hint=f"--{exc.option}") from None
    if spec.engine.task in ("embed", "classify"):
        _refuse_generation_flags(spec.sampling, adapters, template_file, spec.engine.task)
    return spec


def _refuse_generation_flags(
    sampling: SamplingDefaults,
    adapters: dict[str, str],
    template_file: Path | None,
    task: str = "embed",
) -> None:
    """An embedding or classification job generates nothing: flags that shape generation
    would be ignored."""
    given = [
        flag
        for flag, used in (
            ("--n", sampling.n != 1),
            ("--logprobs", sampling.logprobs is not None),
            ("--json-schema/--choice/--regex", sampling.structured is not None),
            ("--lora", bool(adapters)),
            ("--chat-template", template_file is not None),
        )
        if used
    ]
    if given:
        job = "an embedding" if task == "embed" else "a classification"
        raise click.UsageError(f"{', '.join(given)}: not for {job} job (--task {task})")


def _pairs(items: tuple[str, ...], flag: str) -> dict[str, str]:
    """KEY=VALUE items of a repeatable flag."""
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint=flag)
        pairs[key] = value
    return pairs


def _job_constraint(
    schema_file: Path | None, choice: str | None, regex: str | None
) -> dict[str, Any] | None:
    """The job's structured output constraint from --json-schema/--choice/--regex (one)."""
    from batchllm.input.formats.structured import ConstraintError, constraint_of

    given = [
        f
        for f, v in (("--json-schema", schema_file), ("--choice", choice), ("--regex", regex))
        if v
    ]
    if len(given) > 1:
        raise click.UsageError(f"give one constraint per job: got {' and '.join(given)}")
    fields: dict[str, Any] = {}
    if schema_file is not None:
        try:
            fields["json"] = json.loads(schema_file.read_text())
        except ValueError as exc:
            raise click.BadParameter(
                f"{schema_file} is not JSON: {exc}", param_hint="--json-schema"
            ) from None
        if fields["json"] is None:  # constraint_of would take null for "not given"
            raise click.BadParameter(
                f"{schema_file}: a JSON schema must be an object", param_hint="--json-schema"
            )
    if choice is not None:
        fields["choice"] = [c.strip() for c in choice.split(",") if c.strip()]
    if regex is not None:
        fields["regex"] = regex
    try:
        return constraint_of(fields)
    except ConstraintError as exc:
        flag = {"json": "--json-schema", "choice": "--choice", "regex": "--regex"}[exc.field]
        raise click.BadParameter(exc.message, param_hint=flag) from None


def require_requests(file: InputSource) -> None:
    """Refuse a file without a request before a job is created for it."""
    from batchllm.input.files.lines import has_requests
    from batchllm.settings import get_settings

    settings = get_settings()
    if not has_requests(file, settings.max_line_bytes):
        raise click.ClickException(f"{file} has no requests (it is empty or has only blank lines)")


def require_local_model(model: str) -> None:
    """Refuse a model path that does not exist here, which vLLM would otherwise take for a
    Hugging Face repo id and refuse with a message about repo ids."""
    if Path(model).expanduser().exists():
        return
    if model.startswith(_PATH_STARTS) or not _REPO_ID.fullmatch(model):
        raise click.ClickException(
            f"--model {model}: no such directory, and not a Hugging Face repo id (org/name)"
        )
