"""Makes every vLLM engine process batchllm starts die with its parent.

vLLM starts an EngineCore process (and on some backends worker processes under it). When the
batchllm process above them is killed with SIGKILL (an OOM kill, `kill -9`, a node agent),
nothing tells them: they keep running under PID 1, holding gigabytes of memory here and the
whole GPU on a GPU node, so the restarted worker cannot start its engine. vLLM loads "general
plugins" in each of its processes; this is one (registered in pyproject.toml), active only in
processes whose environment carries ENGINE_MARK (the owner's pid, which VllmEngine sets before it
builds an engine), and never in the owner itself, where vLLM loads its plugins too.

It also leaves SIGINT to the parent: a terminal's Ctrl-C reaches the whole process group, and an
EngineCore that gets it aborts every request in flight, so the parent could not stop in order
(commit what finished, hand back the rest). The parent shuts its engine down itself.

PR_SET_PDEATHSIG is not used: it fires when the parent *thread* that started the process ends,
which is not the parent process's death when the engine was built off the main thread.
"""

from __future__ import annotations

import os
import signal
import threading
import time

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
    parent = os.getppid()
    threading.Thread(
        target=_watch, args=(parent,), name="batchllm-parent-watch", daemon=True
    ).start()


def _watch(parent: int) -> None:
    # The parent's death reparents this process, so getppid() changes (to 1 or a subreaper).
    while os.getppid() == parent and parent != 1:
        time.sleep(_POLL_SECONDS)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(_GRACE_SECONDS)
    os.kill(os.getpid(), signal.SIGKILL)
