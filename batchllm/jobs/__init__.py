"""The domain: input formats, validation, jobs in SQL, the Parquet contract. No celery, no vllm."""
