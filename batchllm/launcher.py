"""The `batchllm` console script (and `python -m batchllm`): a `run` goes to a warm runner when
one of this checkout is up (kept_engine/handoff.py), anything else to the CLI in this process.
Only the standard library is imported before that choice."""

from __future__ import annotations

import sys


def main() -> None:
    from batchllm.kept_engine.handoff import hand_off

    code = hand_off(sys.argv[1:])
    if code is not None:
        sys.exit(code)
    from batchllm.cli import main as cli_main

    cli_main()
