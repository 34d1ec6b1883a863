"""Stage 1, the input: read a file's lines, validate them (line by line or a block at a time),
give every line a custom_id, and store the rows as Parquet input shards. No SQL, no vllm."""
