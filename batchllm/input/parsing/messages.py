"""A chat line's messages as stored with its row; the images they show are opened and checked
here, so a bad one is the line's error naming its part."""

from __future__ import annotations

from typing import Any

from batchllm.input.formats.schemas import ChatMessage
from batchllm.input.images import ImageProblem, check_image
from batchllm.input.parsing.problems import LineProblem
from batchllm.settings import Settings


def stored_messages(
    messages: list[ChatMessage], settings: Settings, prefix: str = ""
) -> list[dict[str, Any]]:
    """The messages as stored: ChatMessage.stored() (the text of text parts joined, a tool
    turn's id, an assistant turn's calls), except a message with images, which keeps its
    parts; every image is opened and decoded here (images/checks.py), so a bad one is this
    line's error naming its part."""
    stored: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not message.has_images():
            stored.append(message.stored())
            continue
        parts: list[dict[str, Any]] = []
        content = message.content if isinstance(message.content, list) else []
        for j, part in enumerate(content):
            if part["type"] == "text":
                parts.append({"type": "text", "text": part["text"]})
                continue
            field = f"{prefix}messages.{i}.content.{j}.image_url"
            if message.role != "user":
                raise LineProblem(field, f"images are for user messages, not {message.role}")
            url = _image_url(part, field)
            try:
                check_image(url, settings)
            except ImageProblem as exc:
                raise LineProblem(field, str(exc)) from None
            parts.append({"type": "image_url", "image_url": {"url": url}})
        stored.append({"role": message.role, "content": parts})
    return stored


def _image_url(part: dict[str, Any], field: str) -> str:
    reference = part.get("image_url")
    if not isinstance(reference, dict) or not isinstance(reference.get("url"), str):
        raise LineProblem(field, "expected {url: ...}")
    if not reference["url"].strip():
        raise LineProblem(field + ".url", "url is empty")
    extra = set(reference) - {"url", "detail"}
    if extra:
        raise LineProblem(field, f"unknown image_url field(s): {', '.join(sorted(extra))}")
    if reference.get("detail") not in (None, "auto", "low", "high"):
        raise LineProblem(field + ".detail", "detail is auto, low or high")
    return str(reference["url"])
