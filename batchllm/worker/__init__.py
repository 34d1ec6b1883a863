"""Running shards: the shard runner (used in-process by `batchllm run`) and the Celery worker."""
