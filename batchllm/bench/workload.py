"""Generated benchmark requests with controlled lengths and distinct text.

Lengths (prompt words, output tokens, system prompt choice) come from the workload's seed, so
every contender gets the same shape of work; the words come from a per-run `variant`, so no run
finds another run's prompts in vLLM's prefix cache. Outputs run to their exact length
(`ignore_eos`), so every contender generates the same number of tokens.

A `natural` workload is for a real instruct model: real questions answered greedily, each row
ending on its own (the end-of-turn token) or at its cap, as a production job's rows do. Greedy
decoding gives every contender the same prompts' same answers, so they still generate about
the same tokens; they are compared by output tokens/s.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from batchllm.demo.workload import sentence
from batchllm.input.formats.rows import InputRow
from batchllm.settings import Settings

TEMPERATURE = 1.0
# How output lengths are drawn within the range. `uniform`: every length alike. `log-uniform`:
# long-tailed like real chat traffic (most answers short, a few long; the median is the range's
# geometric mean), the shape that makes fixed batches wait on their longest request.
OUTPUT_SHAPES = ("uniform", "log-uniform")


@dataclass(frozen=True)
class Workload:
    requests: int
    prompt_words: tuple[int, int]
    output_tokens: tuple[int, int]
    output_shape: str = "uniform"
    system_prompts: int = 0  # how many distinct shared system prompts; 0 for none
    system_words: int = 0
    seed: int = 0
    natural: bool = False
    greedy: bool = False  # temperature 0 for the synthetic requests too

    @property
    def temperature(self) -> float:
        return 0.0 if self.natural or self.greedy else TEMPERATURE

    @property
    def ignore_eos(self) -> bool:
        return not self.natural

    @property
    def max_output(self) -> int:
        return self.output_tokens[1]

    def draw_output(self, shape: random.Random) -> int:
        low, high = self.output_tokens
        if self.output_shape == "log-uniform":
            return min(high, int(math.exp(shape.uniform(math.log(low), math.log(high + 1)))))
        return shape.randint(low, high)


@dataclass(frozen=True)
class Request:
    custom_id: str
    messages: list[dict[str, str]]
    max_tokens: int
    temperature: float = TEMPERATURE
    ignore_eos: bool = True

    @property
    def sampling(self) -> dict[str, object]:
        return {
            "max_tokens": self.max_tokens,
            "ignore_eos": self.ignore_eos,
            "temperature": self.temperature,
        }

    def row(self, line: int) -> InputRow:
        """The stored input row batchllm's engine path sees for this request."""
        return InputRow(
            line=line,
            custom_id=self.custom_id,
            kind="chat",
            messages=json.dumps(self.messages),
            sampling=json.dumps(self.sampling),
        )


# Natural questions: topics x asks, distinct per request; answers run from a word to a paragraph.
_TOPICS = (
    "the moon", "volcanoes", "honey bees", "the Roman empire", "photosynthesis", "rainbows",
    "the piano", "coffee", "glaciers", "the internet", "whales", "bicycles", "the pyramids",
    "electricity", "tea", "sharks", "the Olympic games", "chess", "deserts", "vaccines",
    "the printing press", "penguins", "earthquakes", "bread", "the violin", "tigers", "Mars",
    "recycling", "the heart", "clouds",
)  # fmt: skip
_ASKS = (
    "What is {t}? Answer in one sentence.",
    "Give me three short facts about {t}.",
    "Explain {t} to a child.",
    "Why is {t} important?",
    "Write a haiku about {t}.",
    "Describe {t} in two sentences.",
    "What is one surprising thing about {t}?",
    "Summarize the history of {t} briefly.",
)


def natural_question(i: int) -> str:
    """The same question for request i in every variant, so every contender answers the same
    questions (greedy: the same answers, the same tokens); the variant tag in front of it keeps
    a run's prompts out of another's prefix cache."""
    ask = _ASKS[(i // len(_TOPICS)) % len(_ASKS)]
    return ask.format(t=_TOPICS[i % len(_TOPICS)])


def iter_requests(workload: Workload, variant: int) -> Iterator[Request]:
    shape = random.Random(workload.seed)
    words = random.Random(f"{workload.seed}/{variant}")
    systems = [sentence(words, workload.system_words) for _ in range(workload.system_prompts)]
    for i in range(workload.requests):
        prompt_words = shape.randint(*workload.prompt_words)
        max_tokens = workload.draw_output(shape)
        if workload.natural:
            # The model's default system prompt is shared by every request, as in real traffic;
            # the request number keeps prompts distinct within and across variants.
            text = f"({variant}.{i}) {natural_question(i)}"
            yield Request(
                custom_id=f"req-{i}",
                messages=[{"role": "user", "content": text}],
                max_tokens=workload.max_output,
                temperature=workload.temperature,
                ignore_eos=False,
            )
            continue
        messages = [{"role": "user", "content": f"{i}: {sentence(words, prompt_words)}"}]
        if systems:
            system = systems[shape.randrange(len(systems))]
            messages.insert(0, {"role": "system", "content": system})
        yield Request(
            custom_id=f"req-{i}",
            messages=messages,
            max_tokens=max_tokens,
            temperature=workload.temperature,
        )


def write_openai_chat(path: Path, workload: Workload, variant: int, *, model: str) -> Path:
    """The requests as OpenAI batch lines, the one form `vllm run-batch` and batchllm share."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as out:
        for request in iter_requests(workload, variant):
            body = {"model": model, "messages": request.messages, **request.sampling}
            out.write(
                json.dumps(
                    {
                        "custom_id": request.custom_id,
                        "method": "POST",
                        "url": "/v1/chat/completions",
                        "body": body,
                    }
                )
                + "\n"
            )
    return path


def stored_rows(workload: Workload, variant: int) -> list[InputRow]:
    return [r.row(line) for line, r in enumerate(iter_requests(workload, variant), start=1)]


def size_context(model: str, runs: list[tuple[Workload, int]], settings: Settings) -> int:
    """One max_model_len for every contender: the longest request among the (workload, variant)
    pairs that will run, sized the way batchllm sizes a job (under `settings`)."""
    from batchllm.engine.sizing import size_max_model_len
    from batchllm.spec import SamplingDefaults

    rows = (row for workload, variant in runs for row in stored_rows(workload, variant))
    return size_max_model_len(model, rows, SamplingDefaults(max_tokens=1), settings=settings)
