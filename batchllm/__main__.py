"""`python -m batchllm`: the CLI, as the `batchllm` console script runs it."""

from batchllm.launcher import main

main()
