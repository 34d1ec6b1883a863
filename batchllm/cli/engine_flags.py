"""The engine's flags: those `run`/`submit` and `worker` share (the engine's shape), a fleet
worker's own (its task, context, GPU share, LoRA), and the check that this machine's hardware
can honour them; and the typed flags every command builds its numbers and choices from
(`count_option`, `float_option`, `share_option`, `choice_option`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click

from batchllm.spec import EngineOptions

_DTYPES = ["auto", "bfloat16", "float16", "float32", "half", "float"]


def _option(decls: tuple[str, ...], kind: click.ParamType, default: Any, attrs: Any) -> Any:
    if default is not None:  # a default is shown in --help; None: something else chooses
        attrs.setdefault("show_default", True)
    return click.option(*decls, type=kind, default=default, **attrs)


def count_option(*decls: str, least: int = 1, default: int | None = None, **attrs: Any) -> Any:
    """A flag taking a whole number of at least `least`. Without a `default` it is None when
    not given (vLLM, the model or a setting chooses); a default is shown in --help."""
    return _option(decls, click.IntRange(min=least), default, attrs)


def float_option(*decls: str, least: float = 0, default: float | None = None, **attrs: Any) -> Any:
    """A flag taking a number of at least `least` (seconds, a temperature), as count_option."""
    return _option(decls, click.FloatRange(min=least), default, attrs)


def share_option(*decls: str, default: float | None, **attrs: Any) -> Any:
    """A flag taking a share of something (of GPU memory, of probability mass): in (0, 1]."""
    return _option(decls, click.FloatRange(0, 1, min_open=True), default, attrs)


def choice_option(
    *decls: str, choices: Sequence[str], default: str | None = None, **attrs: Any
) -> Any:
    """A flag taking one of `choices`, as count_option."""
    return _option(decls, click.Choice(choices), default, attrs)


def engine_default(name: str):
    """A flag's default from the engine schema, so the CLI and the Python API cannot drift."""
    return EngineOptions.model_fields[name].default


# The engine flags `run`/`submit` and `worker` share, with the same defaults and help.
ENGINE_SHAPE_FLAGS = [
    count_option(
        "--kv-cache-memory-bytes",
        help="KV cache size in bytes [default: vLLM's, a share of GPU memory; on a CPU "
        "VLLM_CPU_KVCACHE_SPACE]. It bounds how many requests run at once.",
    ),
    count_option("--max-num-seqs", help="Sequences per engine step [default: vLLM's]."),
    count_option("--max-num-batched-tokens", help="Tokens per engine step [default: vLLM's]."),
    click.option(
        "--dtype", type=click.Choice(_DTYPES), default=engine_default("dtype"), show_default=True
    ),
    click.option("--quantization", default=None, help="e.g. fp8, awq, gptq."),
    count_option(
        "--tensor-parallel-size",
        default=engine_default("tensor_parallel_size"),
        help="GPUs per engine.",
    ),
    click.option(
        "--prefix-caching/--no-prefix-caching",
        default=None,
        help="vLLM automatic prefix caching [default: vLLM's, on].",
    ),
    click.option("--enforce-eager", is_flag=True, help="Skip CUDA graph capture."),
]


def require_hardware_for(engine: EngineOptions) -> None:
    """Refuse, before a job is created, engine settings this machine's GPUs cannot honour (the
    engine checks again, with the quantizations of the installed vLLM, when it starts)."""
    from batchllm.engine.hardware import runs_on_cpu, visible_gpus
    from batchllm.engine.preflight import check_engine_options

    on_cpu = runs_on_cpu()
    check_engine_options(engine, is_cpu=on_cpu, gpus=[] if on_cpu else visible_gpus())


# -- a fleet worker's engine ----------------------------------------------------------------

# The GPU share a dedicated worker takes by default (vLLM's own default; 0.92 for a job of
# `run`, which may share its machine with nothing else either but sized its engine itself).
WORKER_GPU_MEMORY_UTILIZATION = 0.90

_WORKER_ENGINE_FLAGS = [
    choice_option(
        "--task",
        choices=["generate", "embed", "classify"],
        default="generate",
        help="generate text, embed or classify with vLLM's pooling runner (an embedding or "
        "classification worker takes jobs of its task only).",
    ),
    count_option(
        "--max-model-len",
        least=16,
        help="The engine's context length; longer rows of a job become error rows [default: "
        "the model's context; vLLM refuses to start when the KV cache cannot hold one such "
        "sequence, so lower it then].",
    ),
    share_option(
        "--gpu-memory-utilization",
        default=WORKER_GPU_MEMORY_UTILIZATION,
        help="Share of GPU memory for vLLM (on a CPU machine: of RAM, see VLLM_CPU_KVCACHE_SPACE).",
    ),
    *ENGINE_SHAPE_FLAGS,
    click.option(
        "--compact-json",
        is_flag=True,
        help="JSON-constrained answers without whitespace between tokens (jobs asking for it "
        "need such a worker).",
    ),
    click.option(
        "--enable-lora",
        is_flag=True,
        help="Serve LoRA adapters: this worker takes LoRA jobs too (adapters come with each "
        "job; no restart).",
    ),
    count_option(
        "--max-lora-rank",
        help="Largest adapter rank the engine serves (implies --enable-lora) [default: vLLM's, "
        "16].",
    ),
    count_option(
        "--max-loras", help="Adapters one batch may mix (implies --enable-lora) [default: 1]."
    ),
]
_WORKER_ENGINE_PARAMS = [
    "task",
    "max_model_len",
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "max_num_seqs",
    "max_num_batched_tokens",
    "dtype",
    "quantization",
    "tensor_parallel_size",
    "prefix_caching",
    "enforce_eager",
    "compact_json",
    "enable_lora",
    "max_lora_rank",
    "max_loras",
]


def worker_engine_options(command):
    for decorate in reversed(_WORKER_ENGINE_FLAGS):
        command = decorate(command)
    return command


def worker_engine_from_flags(flags: dict) -> EngineOptions:
    """The worker's engine settings from its flags (popped from `flags`)."""
    values = {name: flags.pop(name) for name in _WORKER_ENGINE_PARAMS}
    values["enable_prefix_caching"] = values.pop("prefix_caching")
    values["enable_lora"] = bool(
        values["enable_lora"] or values["max_lora_rank"] or values["max_loras"]
    )
    options = EngineOptions(**values)
    require_hardware_for(options)
    return options


def engine_flags_as_args(ctx: click.Context) -> list[str]:
    """The engine flags given on the command line, as arguments again (for child workers)."""
    args: list[str] = []
    for param in ctx.command.params:
        if param.name not in _WORKER_ENGINE_PARAMS or not isinstance(param, click.Option):
            continue
        if ctx.get_parameter_source(param.name) is not click.core.ParameterSource.COMMANDLINE:
            continue
        value = ctx.params[param.name]
        if param.is_flag:
            if value:
                args.append(param.opts[0])
            elif param.secondary_opts:
                args.append(param.secondary_opts[0])
        else:
            args += [param.opts[0], str(value)]
    return args
