"""docker/: the compose file's profiles bring up what they promise, the image installs from
the pyproject extras, and, where the `docker compose` CLI exists, compose accepts both
profiles (broken YAML or a missing variable fails without a Docker daemon)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

DOCKER = Path(__file__).resolve().parents[2] / "docker"
FLEET = {"redis", "postgres", "migrate", "flower"}


def services_in(profile: str) -> dict[str, dict]:
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    return {
        name: service
        for name, service in compose["services"].items()
        if not service.get("profiles") or profile in service["profiles"]
    }


def wants_gpu(service: dict) -> bool:
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {})
    return bool(devices.get("devices"))


def test_the_cpu_profile_is_the_fleet_and_one_cpu_worker_without_a_gpu():
    cpu = services_in("cpu")
    assert set(cpu) == FLEET | {"worker-cpu"}
    assert not any(wants_gpu(s) for s in cpu.values())
    worker = cpu["worker-cpu"]
    assert worker["build"]["args"]["EXTRA"] == "cpu"
    assert "demo-model /data/model" in worker["command"][0]
    assert "batchllm -v worker --model /data/model" in worker["command"][0]


def test_the_gpu_profile_runs_the_gpu_worker():
    gpu = services_in("gpu")
    assert set(gpu) == FLEET | {"worker"}
    assert wants_gpu(gpu["worker"])


def test_the_image_installs_the_pyproject_extras():
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert re.search(r'pip install .*-e "\.\[\$\{EXTRA\},postgres,api\]"', dockerfile)
    assert "ARG EXTRA=gpu" in dockerfile


@pytest.mark.skipif(
    shutil.which("docker") is None
    or subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0,
    reason="no `docker compose` CLI on this machine",
)
@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_docker_compose_accepts_each_profile(profile):
    done = subprocess.run(
        ["docker", "compose", "-f", str(DOCKER / "compose.yaml"), "--profile", profile, "config"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
