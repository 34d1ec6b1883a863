"""Flags shared by `run` and `submit`: the input file, job-level sampling defaults and engine
settings, and the checks that refuse a hopeless job before any work."""

from __future__ import annotations

import re
from pathlib import Path

import click

from batchllm.jobs.schemas import MAX_TOKENS_LIMIT, EngineOptions, JobSpec, SamplingDefaults

# Hugging Face's own rule for `name` or `org/name` (huggingface_hub's validate_repo_id).
_REPO_ID = re.compile(r"(?!.*(--|\.\.))[\w.-]{1,96}(/[\w.-]{1,96})?")
_PATH_STARTS = ("/", "./", "../", "~")

input_file = click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))

_DTYPES = ["auto", "bfloat16", "float16", "float32", "half", "float"]


def _sampling(name: str):
    """A flag's default from the job schema, so the CLI and the Python API cannot drift."""
    return SamplingDefaults.model_fields[name].default


def _engine(name: str):
    return EngineOptions.model_fields[name].default


def job_options(command):
    decorators = [
        click.option("--model", "-m", required=True, help="Model path or name as vLLM loads it."),
        click.option(
            "--max-tokens",
            type=click.IntRange(1, MAX_TOKENS_LIMIT),
            default=_sampling("max_tokens"),
            show_default=True,
            help="Default most tokens to generate per request (lines may override).",
        ),
        click.option(
            "--temperature",
            type=click.FloatRange(min=0),
            default=_sampling("temperature"),
            show_default=True,
            help="Default sampling temperature; 0 is greedy.",
        ),
        click.option(
            "--top-p",
            type=click.FloatRange(0, 1, min_open=True),
            default=_sampling("top_p"),
            show_default=True,
            help="Default nucleus sampling mass.",
        ),
        click.option("--ignore-eos", is_flag=True, help="Always generate max_tokens tokens."),
        click.option(
            "--strict",
            is_flag=True,
            help="Refuse the whole file if any line is invalid (default: invalid lines "
            "become error rows and the rest runs).",
        ),
        click.option(
            "--gpu-memory-utilization",
            type=click.FloatRange(0, 1, min_open=True),
            default=_engine("gpu_memory_utilization"),
            show_default=True,
            help="Share of GPU memory for vLLM.",
        ),
        click.option(
            "--max-model-len",
            type=click.IntRange(min=16),
            default=None,
            help="Context length [default: longest prompt + max_tokens, capped by the model].",
        ),
        click.option(
            "--max-num-seqs",
            type=click.IntRange(min=1),
            default=None,
            help="Sequences per engine step [default: vLLM's].",
        ),
        click.option(
            "--max-num-batched-tokens",
            type=click.IntRange(min=1),
            default=None,
            help="Tokens per engine step [default: vLLM's].",
        ),
        click.option(
            "--dtype", type=click.Choice(_DTYPES), default=_engine("dtype"), show_default=True
        ),
        click.option("--quantization", default=None, help="e.g. fp8, awq, gptq."),
        click.option(
            "--tensor-parallel-size",
            type=click.IntRange(min=1),
            default=_engine("tensor_parallel_size"),
            show_default=True,
            help="GPUs per engine.",
        ),
        click.option(
            "--prefix-caching/--no-prefix-caching",
            default=None,
            help="vLLM automatic prefix caching [default: vLLM's, on].",
        ),
        click.option("--enforce-eager", is_flag=True, help="Skip CUDA graph capture."),
        click.option(
            "--no-group-prefixes",
            is_flag=True,
            help="Run requests in file order instead of grouping shared prefixes.",
        ),
        click.option(
            "--metadata", multiple=True, metavar="KEY=VALUE", help="Label the job (repeatable)."
        ),
    ]
    for decorate in reversed(decorators):
        command = decorate(command)
    return command


def spec_from_flags(flags: dict) -> JobSpec:
    metadata = {}
    for item in flags.pop("metadata", ()):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--metadata")
        metadata[key] = value
    sampling = SamplingDefaults(
        max_tokens=flags.pop("max_tokens"),
        temperature=flags.pop("temperature"),
        top_p=flags.pop("top_p"),
        ignore_eos=flags.pop("ignore_eos"),
    )
    engine = EngineOptions(
        gpu_memory_utilization=flags.pop("gpu_memory_utilization"),
        max_model_len=flags.pop("max_model_len"),
        max_num_seqs=flags.pop("max_num_seqs"),
        max_num_batched_tokens=flags.pop("max_num_batched_tokens"),
        dtype=flags.pop("dtype"),
        quantization=flags.pop("quantization"),
        tensor_parallel_size=flags.pop("tensor_parallel_size"),
        enable_prefix_caching=flags.pop("prefix_caching"),
        enforce_eager=flags.pop("enforce_eager"),
        group_prefixes=not flags.pop("no_group_prefixes"),
    )
    return JobSpec(model=flags.pop("model"), sampling=sampling, engine=engine, metadata=metadata)


def require_requests(file: Path) -> None:
    """Refuse a file without a request before a job is created for it."""
    from batchllm.jobs.lines import has_requests
    from batchllm.settings import get_settings

    if not has_requests(file, get_settings().max_line_bytes):
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


def require_hardware_for(engine: EngineOptions) -> None:
    """Refuse, before a job is created, engine settings this machine's GPUs cannot honour (the
    engine checks again, with the quantizations of the installed vLLM, when it starts)."""
    from batchllm.engine.hardware import runs_on_cpu, visible_gpus
    from batchllm.engine.preflight import check_engine_options

    on_cpu = runs_on_cpu()
    check_engine_options(engine, is_cpu=on_cpu, gpus=[] if on_cpu else visible_gpus())
