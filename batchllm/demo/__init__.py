"""`make demo`'s story on the real models: the input files it runs, and what it prints of them.

    python -m batchllm.demo write-chat prompts.jsonl        # questions, sentiment, extraction
    python -m batchllm.demo show-chat OUTPUT_DIR            # answers and rows read back
    python -m batchllm.demo write-embed corpus.jsonl        # sentences to embed
    python -m batchllm.demo show-embed OUTPUT_DIR           # nearest neighbours of a few queries
    python -m batchllm.demo write-pipeline DIR              # questions and a 3-stage qa.toml
    python -m batchllm.demo show-pipeline DIR/qa.toml       # the stages joined on custom_id

The jobs themselves run through `batchllm run`, as a user would run them; this module only writes
their input and reads their Parquet output back with pyarrow, the way a pipeline would.
"""

from __future__ import annotations

import argparse
import json
import math
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_CAPITALS = (
    ("France", "Paris"),
    ("Japan", "Tokyo"),
    ("Italy", "Rome"),
    ("Germany", "Berlin"),
    ("Spain", "Madrid"),
    ("England", "London"),
    ("Russia", "Moscow"),
    ("Egypt", "Cairo"),
    ("China", "Beijing"),
    ("Greece", "Athens"),
)
_FACTS = (
    "How many days are there in a week?",
    "What is the largest planet in the solar system?",
    "What do bees make?",
    "What is the boiling point of water in degrees Celsius?",
    "Who wrote Romeo and Juliet?",
    "What gas do plants take in from the air?",
    "How many legs does a spider have?",
    "What is the chemical symbol for gold?",
    "What is the opposite of hot?",
    "Which ocean is the largest?",
)
_REVIEWS = (
    ("I loved this movie, the acting was wonderful.", "positive"),
    ("Terrible service, the food was cold and the waiter was rude.", "negative"),
    ("The package arrived on Tuesday.", "neutral"),
    ("Best purchase I have made all year, it works perfectly!", "positive"),
    ("The battery died after two days. Very disappointed.", "negative"),
    ("This book was boring and far too long.", "negative"),
    ("What a fantastic concert, I would go again tomorrow.", "positive"),
    ("The store opens at nine in the morning.", "neutral"),
)
# The system prompt replaces the model's default one ("You are a helpful AI assistant named
# SmolLM..."); measured here, it classifies better than the review in a bare prompt.
_SENTIMENT_SYSTEM = (
    "You classify the sentiment of reviews. Answer with one word: positive, negative or neutral."
)
_PEOPLE = (
    ("Maria", 34, "Lisbon"),
    ("Kenji", 28, "Osaka"),
    ("Amara", 45, "Lagos"),
    ("Lukas", 52, "Vienna"),
    ("Sofia", 23, "Madrid"),
    ("Omar", 39, "Cairo"),
    ("Chloe", 31, "Paris"),
    ("Ivan", 60, "Moscow"),
)
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 20},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
# Two lines a real file might hold by mistake: each becomes an error row, the job still runs.
_BAD_LINES = (
    '{"messages": [{"role": "user", "content": "What is the capital of Peru?"}',
    '{"prompt": "Sentiment of: fine", "choice": "positive"}',
)


def chat_lines(repeats: int = 10) -> Iterator[dict[str, Any]]:
    """Questions (chat and OpenAI forms), sentiment (chat form, a system prompt and a
    `choice`), completions (prompt form, a `stop` string) and extraction (OpenAI form, a JSON
    schema): `repeats` rounds of 40 lines."""
    for r in range(repeats):
        for country, _ in _CAPITALS:
            yield {
                "custom_id": f"capital-{r}-{country.lower()}",
                "messages": [{"role": "user", "content": f"What is the capital of {country}?"}],
            }
        for i, question in enumerate(_FACTS):
            yield {
                "custom_id": f"fact-{r}-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "demo", "messages": [{"role": "user", "content": question}]},
            }
        for i, (review, _) in enumerate(_REVIEWS):
            yield {
                "custom_id": f"sentiment-{r}-{i}",
                "messages": [
                    {"role": "system", "content": _SENTIMENT_SYSTEM},
                    {"role": "user", "content": review},
                ],
                "choice": ["positive", "negative", "neutral"],
            }
        for i, (country, _) in enumerate(_CAPITALS[:4]):
            # A plain completion (no chat template) that a `stop` string ends.
            yield {
                "custom_id": f"completion-{r}-{i}",
                "prompt": f"Q: What is the capital of {country}?\nA:",
                "stop": ["\n"],
                "max_tokens": 24,
            }
        for name, age, city in _PEOPLE:
            yield {
                "custom_id": f"person-{r}-{name.lower()}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "demo",
                    "messages": [
                        {
                            "role": "user",
                            "content": f"{name} is {age} years old and lives in {city}. "
                            "Give their name, age and city as JSON.",
                        }
                    ],
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "person", "schema": PERSON_SCHEMA},
                    },
                },
            }


def write_chat(path: Path, repeats: int = 10) -> int:
    lines = [json.dumps(line) for line in chat_lines(repeats)]
    # The bad lines sit among the good ones, as they would in a real file.
    for offset, bad in enumerate(_BAD_LINES):
        lines.insert(len(lines) // (offset + 2), bad)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


_CORPUS = (
    "A cat sits on the mat.",
    "The stock market fell sharply today.",
    "It is raining heavily in the city.",
    "She plays the violin in an orchestra.",
    "Fresh bread is baked every morning.",
    "The football team won the championship.",
    "My laptop will not turn on.",
    "Investors are worried about interest rates.",
    "The puppy chased a ball across the garden.",
    "A storm is expected to bring strong winds.",
    "The pianist performed a beautiful concerto.",
    "This soup needs more salt.",
    "The striker scored twice in the final.",
    "Restart the router to fix the connection.",
)
_QUERIES = (
    "A kitten is resting on a rug.",
    "Shares dropped on Wall Street.",
    "What will the weather be like tomorrow?",
    "Who won the match last night?",
    "How do I cook pasta?",
    "My computer keeps crashing.",
)


def write_embed(path: Path) -> int:
    lines = [{"custom_id": f"doc-{i}", "input": text} for i, text in enumerate(_CORPUS)]
    lines += [{"custom_id": f"query-{i}", "input": text} for i, text in enumerate(_QUERIES)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return len(lines)


def _rows(output_dir: Path) -> list[dict[str, Any]]:
    import pyarrow.dataset as ds

    rows: list[dict[str, Any]] = ds.dataset(output_dir, format="parquet").to_table().to_pylist()
    return sorted(rows, key=lambda row: row["line"])


def _short(text: str | None, width: int = 70) -> str:
    return textwrap.shorten(" ".join((text or "").split()), width, placeholder=" ...")


def model_label(model: str | Path) -> str:
    """The model's name and size, as a reader of its answers should know them: e.g.
    "SmolLM2-135M-Instruct (135M parameters, from its Q4_1 GGUF weights)"."""
    directory = Path(model)
    name, note = directory.name, ""
    try:  # a `batchllm demo-model` directory says what it was made from
        made = Path(json.loads((directory / "batchllm-model.json").read_text())["file"]).name
        if made.endswith(".gguf"):
            name, _, quantized = made.removesuffix(".gguf").partition(".")
            note = f", from its {quantized} GGUF weights" if quantized else ""
    except (OSError, ValueError, KeyError, TypeError):
        pass
    count = _parameter_count(directory)
    size = f"{count / 1e6:,.0f}M parameters" if count else "size unknown"
    return f"{name} ({size}{note})"


def _parameter_count(directory: Path) -> int:
    """Parameters in the directory's safetensors files, from their headers alone."""
    total = 0
    for file in directory.glob("*.safetensors"):
        try:
            with file.open("rb") as handle:
                header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        except (OSError, ValueError):
            return 0
        for key, tensor in header.items():
            if key != "__metadata__":
                total += math.prod(tensor["shape"])
    return total


def _graded(custom_id: str, text: str | None) -> str:
    """A capital question's answer marked right or wrong (the demo knows those answers)."""
    country = custom_id.rsplit("-", 1)[-1]
    capital = dict((c.lower(), a) for c, a in _CAPITALS).get(country)
    if not custom_id.startswith("capital-") or capital is None:
        return ""
    return "  (right)" if capital.lower() in (text or "").lower() else f"  (wrong: {capital})"


def show_chat(output_dir: Path, source: Path) -> None:
    """Print a handful of each task's rows, read back from the job's Parquet output."""
    rows = _rows(output_dir)
    questions = {}
    for number, raw in enumerate(source.read_text().splitlines(), start=1):
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        messages = line.get("messages") or line.get("body", {}).get("messages")
        questions[number] = messages[-1]["content"] if messages else line.get("prompt", "")
    compact = {}
    for row in rows:
        try:
            compact[row["line"]] = json.dumps(json.loads(row["text"] or ""))
        except ValueError:
            compact[row["line"]] = row["text"]
    ok = [row for row in rows if row["status"] == "ok"]
    print(
        f"\n{len(rows)} rows read back from {output_dir}: {len(ok)} ok, {len(rows) - len(ok)} error"
    )
    try:
        model = json.loads((output_dir / "_manifest.json").read_text())["model"]
    except (OSError, ValueError, KeyError):
        model = None
    # What the model answered, as it answered it: a model this small is often wrong.
    print(f"\nQuestions -> answers of {model_label(model) if model else 'the model'}, greedy:")
    picked = [r for r in ok if r["custom_id"].startswith(("capital-0-", "fact-0-"))]
    for row in picked[:4] + picked[10:14]:
        print(f"  {_short(questions[row['line']], 48):<48} -> {_short(row['text'])}")
        print(
            f"  {'':<48}    [{row['finish_reason']}, {row['completion_tokens']} tokens]"
            + _graded(row["custom_id"], row["text"])
        )
    capitals = [r for r in ok if r["custom_id"].startswith("capital-")]
    right = sum(_graded(r["custom_id"], r["text"]) == "  (right)" for r in capitals)
    print(f"  capitals named right: {right} of {len(capitals)}")
    print("\nSentiment, constrained to positive/negative/neutral:")
    for row in [r for r in ok if r["custom_id"].startswith("sentiment-0-")][:5]:
        print(f"  {_short(questions[row['line']], 60):<60} -> {row['text']}")
    print("\nPlain completions (prompt form) ended by the stop string '\\n':")
    for row in [r for r in ok if r["custom_id"].startswith("completion-0-")][:2]:
        prompt = questions[row["line"]].replace("\n", " ")
        print(f"  {prompt:<44} -> {_short(row['text'])} [{row['finish_reason']}]")
    print("\nExtraction, constrained to a JSON schema (name, age, city):")
    for row in [r for r in ok if r["custom_id"].startswith("person-0-")][:4]:
        print(f"  {_short(questions[row['line']], 44):<44} -> {compact[row['line']]}")
        print(f"  {'':<44}    structured_ok={row['structured_ok']}")
    constrained = [r for r in ok if r["structured_ok"] is not None]
    valid = sum(1 for r in constrained if r["structured_ok"])
    stopped = sum(1 for r in ok if r["finish_reason"] == "stop")
    print(
        f"\n{valid}/{len(constrained)} constrained rows satisfy their constraint; "
        f"{stopped}/{len(ok)} ok rows ended on their own (finish_reason=stop)"
    )
    print("Bad lines became error rows; the job ran the rest:")
    for row in [r for r in rows if r["status"] == "error"]:
        print(f"  line {row['line']}: {_short(row['error'], 90)}")


def show_embed(output_dir: Path) -> None:
    """Each query's nearest corpus sentence by cosine similarity of the job's embeddings."""
    import numpy as np

    rows = {row["custom_id"]: row for row in _rows(output_dir)}
    docs = [rows[f"doc-{i}"]["embedding"] for i in range(len(_CORPUS))]
    matrix = np.asarray(docs, dtype=np.float32)
    matrix /= np.linalg.norm(matrix, axis=1, keepdims=True)
    print(f"\n{len(rows)} embeddings of {matrix.shape[1]} dimensions read back from {output_dir}")
    print("Nearest corpus sentence to each query (cosine similarity):")
    for i, query in enumerate(_QUERIES):
        vector = np.asarray(rows[f"query-{i}"]["embedding"], dtype=np.float32)
        scores = matrix @ (vector / np.linalg.norm(vector))
        best, worst = int(scores.argmax()), int(scores.argmin())
        print(
            f"  {query:<42} -> {_CORPUS[best]:<44} {scores[best]:.2f}"
            f"  (least alike: {scores[worst]:.2f})"
        )


# The pipeline demo (docs/pipelines.md): SmolLM2 answers, SmolLM2 judges each answer from a
# template quoting question and answer, MiniLM embeds the answers. Models are the demo's,
# beside the pipeline's folder (.demo/qa next to .demo/chat and .demo/embed).
PIPELINE_TOML = """\
name = "qa"

[[stage]]
name = "answer"
input = "questions.jsonl"
model = "../chat"
# A system message makes each templated prompt a chat (the model's chat template); a bare
# prompt is a completion, which an instruct model may end at once.
system = "Answer in one short sentence."
prompt_template = "{question}"
temperature = 0
max_tokens = 48
enforce_eager = true
# A fixed KV cache: a 135M model needs little, and vLLM's default reserves a share of the
# machine's memory, which a machine busy with other work may not have free.
kv_cache_memory_bytes = 536870912

[[stage]]
name = "judge"
from = "answer"
model = "../chat"
system = "You are a helpful assistant."
prompt_template = "{prompt}\\n{text}\\nTrue or false: the answer above is correct. Reply yes or no."
choice = ["yes", "no"]
temperature = 0
max_tokens = 2
enforce_eager = true
kv_cache_memory_bytes = 536870912

[[stage]]
name = "embed"
from = "answer"
model = "../embed"
task = "embed"
enforce_eager = true
kv_cache_memory_bytes = 536870912
"""


def write_pipeline(directory: Path) -> int:
    """The pipeline demo's questions (plain JSON lines: custom_id and question) and qa.toml."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = [
        {"custom_id": f"capital-{country}", "question": f"What is the capital of {country}?"}
        for country, _ in _CAPITALS
    ]
    lines += [{"custom_id": f"fact-{i}", "question": text} for i, text in enumerate(_FACTS)]
    lines.append({"custom_id": "no-question"})  # a line without the field: an error row
    text = "".join(json.dumps(line) + "\n" for line in lines)
    (directory / "questions.jsonl").write_text(text)
    (directory / "qa.toml").write_text(PIPELINE_TOML)
    return len(lines)


def show_pipeline(pipeline_file: Path) -> None:
    """The three stages' latest jobs, their rows read back and joined on custom_id."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds

    from batchllm.client import Client
    from batchllm.pipeline import load_pipeline, stage_states

    client = Client()
    jobs = {s.stage.name: s.job for s in stage_states(client, load_pipeline(pipeline_file))}
    tables = {}
    for stage, job in jobs.items():
        if job is None:
            raise SystemExit(f"stage {stage} has not run: batchllm pipeline run {pipeline_file}")
        columns = ["custom_id", "status", "text", "embedding", "error"]
        tables[stage] = client.results(job.id).to_table(columns=columns)
        print(f"stage {stage:<7} job {job.id}: {job.completed} ok, {job.failed} error")
    # As docs/pipelines.md joins them.
    answers = tables["answer"].filter(ds.field("status") == "ok")
    verdicts = tables["judge"].select(["custom_id", "text"])
    verdicts = verdicts.rename_columns(["custom_id", "verdict"])
    joined = answers.select(["custom_id", "text"]).join(verdicts, "custom_id")
    # pyarrow joins no list column: each row's vector is taken by its custom_id's position
    vectors = tables["embed"]
    at = pc.index_in(joined["custom_id"], value_set=vectors["custom_id"])
    joined = joined.append_column("embedding", vectors["embedding"].take(at))
    joined = joined.sort_by("custom_id")
    print(
        f"\n{joined.num_rows} of {answers.num_rows} ok answers joined with their verdict and vector:"
    )
    for row in joined.to_pylist()[:8]:
        dims = len(row["embedding"] or [])
        print(
            f"  {row['custom_id']:<16} {_short(row['text'], 44):<44} judge={row['verdict']:<3}"
            f" embedding[{dims}]"
        )
    said = joined.column("verdict").to_pylist()
    print(f"the judge said yes to {said.count('yes')} of {len(said)} answers")
    judge = getattr(jobs["judge"], "model", None)
    if judge:  # the verdicts are the model's, not checked ones
        print(f"(answers and verdicts are {model_label(judge)}'s own, right or wrong)")
    for row in tables["answer"].filter(ds.field("status") == "error").to_pylist():
        print(f"error row {row['custom_id']}: {_short(row['error'], 80)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m batchllm.demo", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("write-chat").add_argument("path", type=Path)
    show = commands.add_parser("show-chat")
    show.add_argument("output_dir", type=Path)
    show.add_argument("--source", type=Path, required=True, help="the job's input file")
    commands.add_parser("write-embed").add_argument("path", type=Path)
    commands.add_parser("show-embed").add_argument("output_dir", type=Path)
    commands.add_parser("write-pipeline").add_argument("directory", type=Path)
    commands.add_parser("show-pipeline").add_argument("pipeline_file", type=Path)
    args = parser.parse_args(argv)
    if args.command == "write-chat":
        print(f"wrote {write_chat(args.path)} lines to {args.path}")
    elif args.command == "write-embed":
        print(f"wrote {write_embed(args.path)} lines to {args.path}")
    elif args.command == "write-pipeline":
        print(f"wrote {write_pipeline(args.directory)} questions and qa.toml to {args.directory}")
    elif args.command == "show-pipeline":
        show_pipeline(args.pipeline_file)
    elif args.command == "show-chat":
        show_chat(args.output_dir, args.source)
    else:
        show_embed(args.output_dir)
