"""`python -m batchllm.demo`: `make demo`'s steps (write the prompts, show the answers)."""

from batchllm.demo import main

main()
