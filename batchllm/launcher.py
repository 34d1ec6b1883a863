"""The `batchllm` console script (and `python -m batchllm`): a `run` goes to a warm runner when
one of this checkout is up (kept_engine/handoff.py), anything else to the CLI in this process;
a cold `run` starts its engine's process first (kept_engine/early.py). Only the standard
library is imported before that."""

from __future__ import annotations

import sys


def main() -> None:
    from batchllm.kept_engine.handoff import hand_off, is_handed_command

    code = hand_off(sys.argv[1:])
    if code is not None:
        sys.exit(code)
    if is_handed_command(sys.argv[1:]):  # a cold `run`: its engine process starts now
        from batchllm.kept_engine import early

        early.start(sys.argv[1:])
    from batchllm.cli import main as cli_main

    cli_main()
