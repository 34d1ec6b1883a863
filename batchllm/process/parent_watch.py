"""Makes every vLLM engine process batchllm starts die with its parent.

vLLM's EngineCore (and any workers under it) outlive a parent killed with SIGKILL (an OOM kill,
`kill -9`): they run on under PID 1, holding the memory or GPU a restarted worker needs. This is
a vLLM "general plugin" (registered in pyproject.toml), loaded in each vLLM process and active
only where the environment carries ENGINE_MARK (the owner's pid, set by VllmEngine while it
builds an engine), never in the owner itself. It also leaves SIGINT to the parent: an EngineCore
that gets a terminal's Ctrl-C aborts every request in flight, so the parent shuts its engine
down itself, in order. Not PR_SET_PDEATHSIG: it fires when the starting *thread* ends, and an
engine may be built off the main thread.

vLLM loads the plugin only once EngineCore has done its handshake with its parent: a parent
that dies before leaves it waiting for vLLM's 5-minute handshake timeout. So a parent must not
die uncleanly while it builds an engine: `batchllm worker` unwinds its build on SIGTERM
(cli/fleet.py), and vLLM's client then shuts the engine processes down.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

ENGINE_MARK = "BATCHLLM_ENGINE_CHILD"
_POLL_SECONDS = 1.0
_GRACE_SECONDS = 5.0  # for vLLM's own SIGTERM shutdown (shared memory, sockets) before SIGKILL

_started = False


def register() -> None:
    """The vLLM plugin entry point; vLLM may call it several times in one process."""
    global _started
    owner = os.environ.get(ENGINE_MARK)
    if _started or not owner or owner == str(os.getpid()):
        return
    _started = True
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch_parent(os.getppid(), _end_self, name="batchllm-parent-watch")


def watch_parent(
    parent: int, on_gone: Callable[[], None], *, name: str, poll: float = _POLL_SECONDS
) -> None:
    """Call `on_gone` on a daemon thread once the process `parent` is gone (at once when this
    process was reparented already). The one parent-death loop: the engine plugin here and
    `serve --worker`'s worker (process/stopping.py) both watch with it."""

    def watch() -> None:
        # The parent's death reparents this process, so getppid() changes (to 1 or a subreaper).
        while os.getppid() == parent and parent != 1:
            time.sleep(poll)
        on_gone()

    threading.Thread(target=watch, name=name, daemon=True).start()


def _end_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(_GRACE_SECONDS)
    os.kill(os.getpid(), signal.SIGKILL)
