"""The chaos run's inputs: K tenants' JSONL jobs of ordinary lines, and a poison tenant whose
lines carry what a careless or hostile tenant sends (lone surrogates, unknown and mistyped
fields, prompts longer than the context, images that are not there or are no image, malformed
JSON, a body naming another model) among good lines. Each job says what status each line's row
must have (benchmarks/chaos_check.py's Expectation): the ordinary tenants' rows are all `ok`,
the poison tenant's bad lines `error`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchllm.demo.workload import write_workload

POISON_TENANT = "poison"
PROMPT_WORDS = (4, 24)


@dataclass
class TenantJob:
    tenant: str
    source: Path
    expect: dict[str, Any]  # chaos_check.Expectation's JSON

    @property
    def poison(self) -> bool:
        return self.tenant == POISON_TENANT


def _chat(custom_id: str, content: Any, **extra: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "messages": [{"role": "user", "content": content}], **extra}


def _image(custom_id: str, url: str) -> dict[str, Any]:
    parts = [
        {"type": "text", "text": "what is in it?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]
    return _chat(custom_id, parts)


NOT_AN_IMAGE = "data:image/png;base64,bm90IGFuIGltYWdl"  # base64 of "not an image"
# Each bad kind's line; json.dumps writes a lone surrogate as the escape a tenant's bytes carry
# ("\\ud800"), which json.loads accepts.
_POISON: dict[str, Callable[[str], Any]] = {
    "surrogate-content": lambda cid: _chat(cid, "x\ud800 y"),
    "surrogate-id": lambda cid: _chat(cid + "\udc00", "hello"),
    "unknown-field": lambda cid: {"custom_id": cid, "prompt": "hi", "frobnicate": 3},
    "mistyped-field": lambda cid: {"custom_id": cid, "prompt": "hi", "max_tokens": "many"},
    "oversized": lambda cid: {"custom_id": cid, "prompt": "word " * 1200},
    "image-missing": lambda cid: _image(cid, "no-such-dir/cat.png"),
    "image-not-image": lambda cid: _image(cid, NOT_AN_IMAGE),
    "image-bad-base64": lambda cid: _image(cid, "data:image/png;base64,%%%"),
    "image-http": lambda cid: _image(cid, "http://127.0.0.1:9/cat.png"),
    "malformed-json": lambda cid: f'{{"custom_id": "{cid}", "prompt": ',
    # The body names a model the job does not run: batchllm runs the job's model, so the line
    # may honestly come out either way; what matters is that it comes out once.
    "other-model": lambda cid: {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]},
    },
}
POISON_KINDS = list(_POISON)
_EITHER = {"other-model"}


def poison_line(kind: str, custom_id: str) -> tuple[str, str]:
    """A bad line of this kind and the status its row must have."""
    made = _POISON[kind](custom_id)
    text = made if isinstance(made, str) else json.dumps(made)
    return text, "any" if kind in _EITHER else "error"


def write_poison(path: Path, *, lines: int, seed: int, max_tokens: tuple[int, int]) -> TenantJob:
    """`lines` lines, every other one bad (each kind in turn), the rest good chat lines."""
    rng = random.Random(seed)
    statuses: dict[str, str] = {}
    with path.open("w") as out:
        for i in range(lines):
            number = i + 1
            if i % 2:
                text, status = poison_line(POISON_KINDS[(i // 2) % len(POISON_KINDS)], f"p-{i}")
            else:
                text = json.dumps(
                    _chat(f"p-{i}", f"good line {i}", max_tokens=rng.randint(*max_tokens))
                )
                status = "ok"
            out.write(text + "\n")
            if status != "error":
                statuses[str(number)] = status
    return TenantJob(POISON_TENANT, path, {"default": "error", "lines": statuses})


def write_tenants(
    work_dir: Path,
    *,
    tenants: int,
    lines: int,
    poison_lines: int,
    seed: int,
    max_tokens: tuple[int, int],
) -> list[TenantJob]:
    """`tenants` jobs sharing `lines` ordinary lines, then the poison tenant's job (if
    `poison_lines`)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    jobs = []
    for t in range(tenants):
        share = lines // tenants + (1 if t < lines % tenants else 0)
        source = write_workload(
            work_dir / f"tenant-{t + 1}.jsonl",
            requests=share,
            prompt_words=PROMPT_WORDS,
            forms=("prompt", "chat"),
            max_tokens=max_tokens,
            seed=seed * 1000 + t,
        )
        jobs.append(TenantJob(f"tenant-{t + 1}", source, {"default": "ok"}))
    if poison_lines:
        jobs.append(
            write_poison(
                work_dir / "poison.jsonl", lines=poison_lines, seed=seed, max_tokens=max_tokens
            )
        )
    return jobs
