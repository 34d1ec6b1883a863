"""Developers' benchmarks, run from a checkout (`python -m benchmarks.fleet`, ...): not part of
the installed package. `batchllm bench` (batchllm/bench) is the users' benchmark."""
