"""Kept engines: one vLLM engine per model and engine settings in a background process of the
user's, which `batchllm run` reuses instead of starting vLLM again (as Ollama keeps a model
loaded), until it has been idle for BATCHLLM_KEEP_ALIVE.

The process that owns a job still owns its rows, checkpoints and Parquet parts: a kept engine
only generates. It is reached over a Unix socket that only its user may use."""
