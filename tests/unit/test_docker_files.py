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


# -- docker/k8s ----------------------------------------------------------------------------------


def k8s_objects() -> dict[str, dict]:
    """Every object of the manifests, by kind/name."""
    objects = {}
    for path in sorted((DOCKER / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            objects[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return objects


def test_the_k8s_manifests_are_workers_scaled_on_the_backlog_metric_and_the_api():
    from batchllm.api.backlog_metrics import BACKLOG_ROWS
    from batchllm.cli import cli

    objects = k8s_objects()
    assert set(objects) == {
        "Deployment/batchllm-worker",
        "ScaledObject/batchllm-worker",
        "Deployment/batchllm-serve",
        "Service/batchllm-serve",
    }
    worker = objects["Deployment/batchllm-worker"]["spec"]["template"]["spec"]
    assert worker["terminationGracePeriodSeconds"] >= 30
    (container,) = worker["containers"]
    assert container["args"][:2] == ["-v", "worker"]
    # The flags the manifests give exist on the commands they are given to.
    names = {p.opts[0] for p in cli.commands["worker"].params if p.opts}
    assert {a for a in container["args"] if a.startswith("--")} <= names, container["args"]

    scaled = objects["ScaledObject/batchllm-worker"]["spec"]
    assert scaled["scaleTargetRef"]["name"] == "batchllm-worker"
    assert scaled["minReplicaCount"] == 0
    (trigger,) = scaled["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["query"].startswith(f"sum({BACKLOG_ROWS}{{")

    serve = objects["Deployment/batchllm-serve"]["spec"]["template"]["spec"]["containers"][0]
    assert serve["args"][0] == "serve"
    names = {p.opts[0] for p in cli.commands["serve"].params if p.opts}
    assert {a for a in serve["args"] if a.startswith("--")} <= names, serve["args"]
    port = serve["args"][serve["args"].index("--port") + 1]
    assert serve["ports"][0]["containerPort"] == int(port)
    service = objects["Service/batchllm-serve"]["spec"]
    assert service["selector"] == {"app": "batchllm-serve"}
    assert service["ports"][0]["targetPort"] == serve["ports"][0]["name"]
