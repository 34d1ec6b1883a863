"""A tiny random-weight Llama model, built locally, so tests and demos never download weights.

The model is useless as a language model but real to vLLM: a Llama architecture, a byte-level
BPE tokenizer with a chat template, safetensors weights. torch, transformers and tokenizers are
imported inside ``build_demo_model`` so importing this module (e.g. from the CLI) stays cheap.
"""

from __future__ import annotations

import itertools
import logging
import pathlib
from typing import Any

logger = logging.getLogger(__name__)

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
TARGET_VOCAB_SIZE = 3000

# Plain "role: content" lines keep prompts readable in test assertions; bos_token is written here
# because apply_chat_template tokenizes without adding special tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)

_SUBJECTS = (
    "the farmer",
    "a young teacher",
    "my neighbour",
    "the captain",
    "our doctor",
    "the engineer",
    "a quiet student",
    "the baker",
    "her brother",
    "the small child",
    "a tired nurse",
    "the pilot",
    "his grandmother",
    "the musician",
    "a careful driver",
    "the gardener",
    "every scientist",
    "the shopkeeper",
    "a famous writer",
    "the fisherman",
    "their manager",
    "the painter",
)
_VERBS = (
    "found",
    "carried",
    "painted",
    "repaired",
    "described",
    "borrowed",
    "noticed",
    "cleaned",
    "ordered",
    "remembered",
    "delivered",
    "measured",
    "opened",
    "followed",
    "collected",
    "watched",
    "explained",
    "protected",
    "discovered",
    "requested",
    "organized",
    "translated",
    "calculated",
)
_OBJECTS = (
    "a wooden table",
    "the broken window",
    "an empty bottle",
    "the newspaper",
    "a heavy box",
    "the yellow bicycle",
    "a long letter",
    "the silver spoon",
    "an important message",
    "the map",
    "a basket of apples",
    "the kitchen door",
    "a strange dog",
    "the weather report",
    "a blanket",
    "the train schedule",
    "a bowl of soup",
    "the mountain road",
    "a green umbrella",
    "the garden",
)
_PLACES = (
    "near the river",
    "in the village",
    "at the station",
    "behind the library",
    "under the bridge",
    "inside the museum",
    "beside the harbour",
    "across the valley",
    "on the hill",
    "in the market",
    "at the hospital",
    "outside the factory",
    "during the storm",
    "at dawn",
    "before winter",
    "in the evening",
    "on a sunny afternoon",
    "at midnight",
    "through the forest",
    "by the lake",
)
_ENDINGS = (
    ".",
    " yesterday.",
    " again.",
    " quickly.",
    " without a word.",
    " because it was necessary.",
    " and smiled.",
    " for the first time.",
    " while everyone was sleeping.",
    " with great care.",
)
_QUESTIONS = (
    "What time is it?",
    "Where did you put the keys?",
    "How many people came to the meeting?",
    "Why is the sky blue?",
    "Can you explain how a bridge is built?",
    "Who wrote this letter?",
    "Which road leads to the city?",
    "When does the next train leave?",
    "Is it going to rain?",
)


def _corpus(sentences: int = 800) -> list[str]:
    """Deterministic English-like sentences; arithmetic strides mix parts without an RNG."""
    lines = []
    for i in range(sentences):
        subject = _SUBJECTS[i % len(_SUBJECTS)]
        line = (
            f"{subject[0].upper()}{subject[1:]} {_VERBS[(i * 7) % len(_VERBS)]} "
            f"{_OBJECTS[(i * 3) % len(_OBJECTS)]} {_PLACES[(i * 11) % len(_PLACES)]}"
            f"{_ENDINGS[(i * 13) % len(_ENDINGS)]} {_QUESTIONS[i % len(_QUESTIONS)]} {i} {i * 37}"
        )
        lines.append(line)
    # Chat-formatted lines teach the tokenizer the role prefixes the template produces.
    roles = ("system", "user", "assistant")
    lines.extend(f"{role}: {q}" for role, q in itertools.product(roles, _QUESTIONS))
    return lines


def _build_tokenizer(extra_tokens: tuple[str, ...] = ()) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN],
        # The full byte alphabet makes every string encodable, whatever the corpus covered.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    # Like Llama, plain text prompts get a BOS; the chat template writes its own.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )
    if extra_tokens:  # not special: they stay in decoded text, where output parsers look
        wrapped.add_tokens(list(extra_tokens))
    return wrapped


def special_token_ids(tokenizer: Any) -> dict[str, Any]:
    """The token ids a config and a generation config name (and nothing else: sampling
    defaults in a generation config would silently change vLLM's default SamplingParams)."""
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def tiny_llama_config(tokenizer: Any) -> Any:
    """The tiny Llama text model of the demo model and of the demo VLM's text side."""
    from transformers import LlamaConfig

    # head_dim = 256 / 4 = 64: vLLM's CPU attention rejects small head sizes such as 16.
    return LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        num_hidden_layers=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        **special_token_ids(tokenizer),
    )


def build_demo_tokenizer(directory: str | pathlib.Path) -> pathlib.Path:
    """The demo model's tokenizer and config.json without its weights, in ~1 s and without
    torch: all that sizing, validation, tokenization and the instant engine read of a model
    (the unit tests' model). The same tokenizer as build_demo_model's."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer()
    tiny_llama_config(tokenizer).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def build_demo_model(
    directory: str | pathlib.Path, *, seed: int = 0, extra_tokens: tuple[str, ...] = ()
) -> pathlib.Path:
    """Build the tiny model and tokenizer into ``directory``; the same seed gives the same files.
    `extra_tokens` become tokens of their own (e.g. `<think>`, which vLLM's reasoning parsers
    look up in the vocabulary).

    Weights are saved as bfloat16 safetensors: vLLM's dtype="auto" downcasts float32 checkpoints
    to bfloat16 anyway, and logs a warning for every float32 tensor it loads.
    """
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(extra_tokens)
    ids = special_token_ids(tokenizer)
    config = tiny_llama_config(tokenizer)
    # fork_rng keeps the caller's global torch RNG untouched while seeding the weight init.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # transformers' stubs type .to() for devices only; a dtype is what torch takes too.
        model = LlamaForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]
    # Only token ids: sampling defaults here would silently change vLLM's default SamplingParams.
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    logger.info("built demo model in %s (vocab %d, seed %d)", directory, len(tokenizer), seed)
    return directory


DEMO_LABELS = ("negative", "neutral", "positive")


def build_demo_classifier(
    directory: str | pathlib.Path, *, seed: int = 0, labels: tuple[str, ...] = DEMO_LABELS
) -> pathlib.Path:
    """The demo model as a sequence classifier (LlamaForSequenceClassification, random weights,
    the `labels` classes): what `--task classify` runs in tests. Its classes mean nothing; its
    probabilities are real to vLLM's classify pooler. With one label it is a cross-encoder,
    which vLLM also scores (query, document) pairs with."""
    import torch
    from transformers import LlamaForSequenceClassification

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer()
    config = tiny_llama_config(tokenizer)
    config.num_labels = len(labels)
    config.id2label = dict(enumerate(labels))
    config.label2id = {label: i for i, label in enumerate(labels)}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(config).to(torch.bfloat16)  # type: ignore[arg-type]
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    logger.info("built demo classifier in %s (%d classes)", directory, len(labels))
    return directory


# The demo model's attention shapes (see build_demo_model): q_proj 256 -> 4 heads x 64,
# v_proj 256 -> 2 kv heads x 64.
_LORA_TARGETS = {"q_proj": (256, 256), "v_proj": (256, 128)}
_LORA_LAYERS = 2


def build_demo_adapters(
    model_dir: str | pathlib.Path, count: int, *, rank: int = 8, seed: int = 0
) -> list[pathlib.Path]:
    """Write `count` tiny random LoRA adapters (PEFT format) for the demo model under
    MODEL_DIR/adapters/lora-<i>. Unlike PEFT's initialisation (B = 0, no effect), both
    matrices are random, so each adapter visibly changes the model's greedy output."""
    import json

    import torch
    from safetensors.torch import save_file

    root = pathlib.Path(model_dir) / "adapters"
    written = []
    for i in range(count):
        directory = root / f"lora-{i}"
        directory.mkdir(parents=True, exist_ok=True)
        generator = torch.Generator().manual_seed(seed * 1000 + i)
        tensors = {}
        for layer in range(_LORA_LAYERS):
            for module, (fan_in, fan_out) in _LORA_TARGETS.items():
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
                tensors[f"{prefix}.lora_A.weight"] = torch.randn(
                    rank, fan_in, generator=generator
                ).mul(0.5)
                tensors[f"{prefix}.lora_B.weight"] = torch.randn(
                    fan_out, rank, generator=generator
                ).mul(0.5)
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, directory / "adapter_model.safetensors"
        )
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": str(pathlib.Path(model_dir).resolve()),
            "r": rank,
            "lora_alpha": 2 * rank,
            "lora_dropout": 0.0,
            "bias": "none",
            "target_modules": sorted(_LORA_TARGETS),
            "fan_in_fan_out": False,
            "modules_to_save": None,
            "use_rslora": False,
            "use_dora": False,
        }
        (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
        written.append(directory)
    logger.info("wrote %d demo LoRA adapters under %s", count, root)
    return written
