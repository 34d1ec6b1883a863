from batchllm.cli import main

main()
