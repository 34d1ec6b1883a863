"""The OpenAI-compatible Batch API server (`batchllm serve`): /v1/files, /v1/batches and
/v1/models over the same database, storage and fleet as the CLI. FastAPI is imported only by
this package, which only `batchllm serve` loads."""
