"""Synthetic prompt files for the demo, the benchmarks and the tests.

Prompts are distinct (a counter and varied words) so vLLM's prefix cache cannot flatter a
repeat, unless a shared system prompt is asked for on purpose.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

_WORDS = (
    "alpha bravo river stone cloud maple orbit signal lantern copper meadow harbor "
    "violet thunder quartz falcon ember glacier saffron willow cobalt tundra beacon "
    "canyon nectar pixel velvet jasmine summit prairie"
).split()


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def write_workload(
    path: str | Path,
    *,
    requests: int,
    prompt_words: tuple[int, int] = (8, 64),
    forms: tuple[str, ...] = ("prompt",),
    max_tokens: tuple[int, int] | None = None,
    system_prompts: list[str] | None = None,
    bad_lines: int = 0,
    seed: int = 0,
) -> Path:
    """Write `requests` JSONL lines cycling through `forms` (prompt, chat, openai_chat,
    openai_completion), plus `bad_lines` invalid lines spread through the file."""
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    bad_at = set(rng.sample(range(requests), min(bad_lines, requests)))
    with path.open("w") as out:
        for i in range(requests):
            if i in bad_at:
                out.write(
                    rng.choice(
                        ['{"prompt": ', '{"prompt": ""}', '{"text": "no form"}', '{"messages": []}']
                    )
                    + "\n"
                )
                continue
            text = f"Request {i}: " + sentence(rng, rng.randint(*prompt_words))
            line: dict[str, Any] = {}
            form = forms[i % len(forms)]
            overrides = {"max_tokens": rng.randint(*max_tokens)} if max_tokens else {}
            messages = [{"role": "user", "content": text}]
            if system_prompts:
                messages.insert(0, {"role": "system", "content": rng.choice(system_prompts)})
            if form == "prompt":
                line = {"custom_id": f"req-{i}", "prompt": text, **overrides}
            elif form == "chat":
                line = {"custom_id": f"req-{i}", "messages": messages, **overrides}
            elif form == "openai_chat":
                line = _openai_line(i, "/v1/chat/completions", messages=messages, **overrides)
            elif form == "openai_completion":
                line = _openai_line(i, "/v1/completions", prompt=text, **overrides)
            else:
                raise ValueError(f"unknown form {form!r}")
            out.write(json.dumps(line) + "\n")
    return path


def _openai_line(i: int, url: str, **body: Any) -> dict[str, Any]:
    """A line in the OpenAI Batch API's form: `body` is the request to `url`."""
    return {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": {"model": "any", **body}}


def main(argv: list[str] | None = None) -> None:
    """`python -m batchllm.demo.workload OUT --requests N`: a mixed demo file, all four forms."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("out")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--bad-lines", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_workload(
        args.out,
        requests=args.requests,
        bad_lines=args.bad_lines,
        seed=args.seed,
        forms=("prompt", "chat", "openai_chat", "openai_completion"),
        max_tokens=(16, 128),
    )
    print(f"wrote {args.requests} requests to {args.out}")


if __name__ == "__main__":
    main()
