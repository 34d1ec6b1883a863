"""Stage 1, the input: read a file's lines, validate them (line by line or a block at a time),
give every line a custom_id, and store the rows as Parquet input shards. No SQL, no vllm.

Its folders are layers, each importing only the ones after it (tests/unit/test_layering.py):
the modules here (the stored input: shards, token ids, adapters; a job's spec and its parent's
rows as the front doors give them) -> validation/ (a whole file) -> parsing/ (one line) ->
images/ (a line's images) -> files/ (the file and its physical lines) -> formats/ (what a line,
a request and a stored row are)."""
