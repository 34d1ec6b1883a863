"""Score, rerank and classify rows as the response bodies vLLM's run-batch writes for them
(its ScoreResponse, RerankResponse and ClassificationResponse), for `batchllm export`."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from batchllm.input.formats.scoring import ScoreShape, ranked


def score_body(
    row: dict[str, Any], model: str, created: int, make_id: Callable[[str], str]
) -> dict[str, Any]:
    """A score row's body: a RerankResponse for a /v1/rerank line (the best documents first,
    its top_n of them), else a ScoreResponse (one score per text_2, in their order)."""
    shape = ScoreShape.of(json.loads(row.get("settings") or "{}"))
    scores: list[float] = row["scores"] or []
    prompt = row["prompt_tokens"] or 0
    if shape.rerank:
        documents = json.loads(row.get("inputs") or "[]")[shape.queries :]
        return {
            "id": make_id("rerank-"),
            "model": model,
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt},
            "results": [
                {
                    "index": i,
                    "document": {"text": documents[i] if i < len(documents) else None},
                    "relevance_score": scores[i],
                }
                for i in ranked(scores, shape.top_n)
            ],
        }
    return {
        "id": make_id("embd-"),  # vLLM's ScoreResponse id prefix
        "object": "list",
        "created": created,
        "model": model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0},
    }


def classify_body(row: dict[str, Any], model: str, created: int, body_id: str) -> dict[str, Any]:
    """A classify row's body: one ClassificationData for its one input."""
    probs: list[float] = row["probs"] or []
    prompt = row["prompt_tokens"] or 0
    return {
        "id": body_id,
        "object": "list",
        "created": created,
        "model": model,
        "data": [{"index": 0, "label": row["label"], "probs": probs, "num_classes": len(probs)}],
        "usage": {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0},
    }
