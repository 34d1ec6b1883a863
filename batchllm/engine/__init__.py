"""The only place that imports vLLM, and only when an engine is built (see vllm_engine.py)."""
