"""`batchllm doctor --startup`: build the model's engine once, as `run` would, and show where
its start went (issue 63): importing vLLM, building the engine (weights, compile, KV cache),
and the first answer. The one doctor check that starts an engine, so it is asked for by name."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from batchllm.doctor.machine import Section
from batchllm.settings import Settings
from batchllm.spec import EngineOptions

if TYPE_CHECKING:
    from batchllm.engine.vllm_engine import VllmEngine

# The context the check builds with: enough for its one prompt; a model's full context could
# ask for more KV cache than a small machine holds, which says nothing about its start.
STARTUP_CONTEXT = 1024
# ... and the KV cache: the start is the subject, not a job's capacity. A size given also skips
# vLLM's check that most of the machine's memory is free, which a busy machine fails.
STARTUP_KV_CACHE_BYTES = 256 * 2**20
_PROMPT = "What is the capital of France?"
_TOKENS = 8


def check_startup(model: str, settings: Settings, *, enforce_eager: bool = False) -> Section:
    """Build the engine for `model` with `run`'s defaults (and --enforce-eager if given) but
    a small KV cache, time each phase and one greedy request, then unload it."""
    section = Section("startup", "Engine start")
    started = time.monotonic()
    from batchllm.engine.vllm_engine import VllmEngine

    options = EngineOptions(
        enforce_eager=enforce_eager, kv_cache_memory_bytes=STARTUP_KV_CACHE_BYTES
    )
    engine = VllmEngine(
        model=model, options=options, max_model_len=STARTUP_CONTEXT, settings=settings
    )
    try:
        ready = time.monotonic()
        first, answer = _first_answer(engine)
    finally:
        engine.shutdown()
    phases = {"import batchllm's engine": ready - started - sum(engine.start_phases.values())}
    phases |= engine.start_phases
    phases["first answer (8 tokens)"] = first
    for phase, seconds in phases.items():
        section.row(phase, f"{seconds:.1f} s")
    total = ready - started + first
    section.row(
        "total", f"{total:.1f} s", "engine core in this process" if engine.in_process else ""
    )
    section.row("answer", repr(answer[:60]), f"{engine.hardware}")
    section.data.update(
        model=model,
        phases_seconds={k: round(v, 3) for k, v in phases.items()},
        total_seconds=round(total, 3),
        in_process=engine.in_process,
        enforce_eager=enforce_eager,
        answer=answer,
    )
    return section


def _first_answer(engine: VllmEngine) -> tuple[float, str]:
    """Seconds to one greedy answer of _TOKENS tokens, and its text."""
    started = time.monotonic()
    tokenizer = engine.tokenizer
    if getattr(tokenizer, "chat_template", None):  # an instruct model: the way `run` asks it
        chat = [{"role": "user", "content": _PROMPT}]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    else:
        ids = tokenizer.encode(_PROMPT)
    engine.add(
        "doctor-startup", ids, engine.sampling_params({"max_tokens": _TOKENS, "temperature": 0})
    )
    text = ""
    while engine.has_unfinished():
        for finished in engine.step():
            text = finished.text
    return time.monotonic() - started, text
