from batchllm.demo import main

main()
