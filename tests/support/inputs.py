"""An input file resolved as a front door resolves it (input/files/source.py), for tests that call
the layers below the front doors (jobs/, store_input, the readers) directly."""

from __future__ import annotations

from pathlib import Path

from batchllm.input.files.source import InputSource, resolve_input
from batchllm.settings import Settings, get_settings


def source_of(path: str | Path, settings: Settings | None = None) -> InputSource:
    endpoint = (settings or get_settings()).resolved_s3_endpoint
    return resolve_input(path, s3_endpoint=endpoint)
