"""Chat rows with images: their prompt ids, their decoded images and what they cost in tokens.

The chat template renders each image part where the model expects it (OpenAI's `image_url`
parts are handed to it as `{"type": "image"}`, the Hugging Face convention) and the engine gets
the prompt's ids with one image placeholder per image plus the decoded images; vLLM expands each
placeholder to the image's tokens itself. The row's prompt tokens count those expanded tokens:
the model's processor says how many an image of that size takes, so the context check and the
sizing pass see what the engine will run.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

from batchllm.input.formats.rows import InputRow
from batchllm.input.images import ImageProblem, decoded, image_parts, open_image
from batchllm.row_errors import INVALID_PROMPT, Refusal
from batchllm.settings import Settings

log = logging.getLogger(__name__)

NO_IMAGES = Refusal("model does not accept images", INVALID_PROMPT)


@dataclass(frozen=True, slots=True)
class ImagePrompt:
    """A prepared chat row with images: what the engine is given and what it will count."""

    ids: list[int]  # the rendered prompt, one placeholder token per image
    # PIL images in the order their placeholders appear, opened but not decoded: a batch of
    # rows holds their encoded bytes only; the engine decodes each row's as it adds it.
    images: list[Any]
    tokens: int  # prompt tokens once each placeholder is expanded to its image's tokens


def decoded_images(prompt: ImagePrompt) -> list[Any]:
    """The prompt's images decoded (ImageProblem for one that no longer decodes)."""
    return [decoded(image) for image in prompt.images]


def has_images(row: InputRow) -> bool:
    # Validation keeps a message's parts only when it has images (input/validation/validate.py).
    return row.kind == "chat" and row.messages is not None and '"image_url"' in row.messages


class ImageProcessor:
    """A model's multi-modal processor, reduced to what preparing a row needs; None-like
    (`accepts_images` False) for a text-only model. A row's images are opened under
    `settings` (where they may be read from, their size limits), as validation opened them."""

    def __init__(self, processor: Any, settings: Settings) -> None:
        self.processor = processor
        self.settings = settings
        token = getattr(processor, "image_token", None)
        tokenizer = getattr(processor, "tokenizer", None)
        self.image_token_id: int | None = getattr(processor, "image_token_id", None)
        if self.image_token_id is None and token is not None and tokenizer is not None:
            self.image_token_id = tokenizer.convert_tokens_to_ids(token)
        self.accepts_images = (
            getattr(processor, "image_processor", None) is not None
            and self.image_token_id is not None
        )

    def image_tokens(self, images: list[Any]) -> list[int]:
        """Tokens each image becomes in the model's prompt."""
        sizes = [[image.height, image.width] for image in images]
        counted = getattr(self.processor, "_get_num_multimodal_tokens", None)
        if counted is not None:
            try:
                return list(counted(image_sizes=sizes)["num_image_tokens"])
            except (TypeError, KeyError, NotImplementedError):
                pass
        # A processor without the shortcut: the tokens its placeholder becomes, image by image.
        placeholder = getattr(self.processor, "image_token", "")
        return [
            len(
                self.processor(text=[placeholder], images=[image], add_special_tokens=False)[
                    "input_ids"
                ][0]
            )
            for image in images
        ]


def load_image_processor(model: str, settings: Settings) -> ImageProcessor:
    """The model's processor (a text model's is its tokenizer), its images read under
    `settings`."""
    return ImageProcessor(_loaded_processor(model), settings)


@functools.lru_cache(maxsize=4)
def _loaded_processor(model: str) -> Any:
    """The model's Hugging Face processor, loaded once per process; None without one."""
    try:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(model)  # type: ignore[no-untyped-call]
    except Exception as exc:  # no processor files: a text-only model
        log.info("no multi-modal processor for %s: %s", model, exc)
        processor = None
    return processor


def template_messages(row: InputRow) -> list[dict[str, Any]]:
    """The row's messages as a chat template takes them: each image part as {"type": "image"}."""
    messages = row.chat_messages()
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            message["content"] = [
                {"type": "image"} if part["type"] == "image_url" else part for part in content
            ]
    return messages


def prepare_image_row(
    row: InputRow, ids: list[int], processor: ImageProcessor | None
) -> ImagePrompt | Refusal:
    """An image row's ImagePrompt from its rendered ids, or why it cannot run."""
    if processor is None or not processor.accepts_images:
        return NO_IMAGES
    parts = list(image_parts(row.chat_messages()))
    placed = sum(1 for i in ids if i == processor.image_token_id)
    if placed != len(parts):
        return Refusal(
            f"the chat template placed {placed} image token(s) for {len(parts)} image(s); "
            "it must render each image part (pass a --chat-template that does)",
            INVALID_PROMPT,
        )
    images = []
    for i, j, url in parts:
        try:
            images.append(open_image(url, processor.settings, decode=False))
        except ImageProblem as exc:  # readable at validation, gone or changed since
            return Refusal(f"field 'messages.{i}.content.{j}.image_url': {exc}", INVALID_PROMPT)
    tokens = len(ids) - len(images) + sum(processor.image_tokens(images))
    return ImagePrompt(ids=ids, images=images, tokens=tokens)
