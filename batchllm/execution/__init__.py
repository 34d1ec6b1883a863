"""Running a shard through an engine: the shard runner's continuous feed and its bookkeeping,
a process's engines (vLLM or the instant one), the context-sizing pass, finalizing a job, its
webhooks and metrics. Used alike by a fleet worker (worker/) and by `batchllm run` (jobs/)."""
