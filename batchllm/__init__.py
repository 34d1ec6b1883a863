"""batchllm: batch inference jobs over vLLM, JSONL in, Parquet out, throughput in SQL."""

__version__ = "0.1.0"
