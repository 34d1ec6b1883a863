"""`batchllm bench`: batchllm against the ways people run vLLM offline, on one workload, in one run.

Modules: `workload` writes the generated requests, `memory` samples peak RSS of a process tree,
`contenders` runs raw vLLM, fixed batches and batchllm's engine phase on one shared engine,
`processes` runs `vllm run-batch` and `batchllm run` end to end, `overhead` measures everything
but generation on an instant engine, `prefix` measures prefix grouping, `features` the request
features (structured output, logprobs, n, a mixed job), `embed` embedding jobs against `LLM.embed`,
`smoke` checks and tabulates the GPU smoke run, `report` prints the table and draws the chart,
`suite` ties them together. vllm is imported only inside functions.
"""
