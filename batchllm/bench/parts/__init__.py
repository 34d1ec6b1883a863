"""The bench's parts beyond the core contenders (raw vLLM, fixed batches, run-batch, batchllm):
each measures one thing - embeddings, request features, prefix grouping, a warm worker, a
job's own overhead at scale, llama.cpp as a peer - and is chosen with `--parts`."""
