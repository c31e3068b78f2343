"""infra/deploy, checked as far as this machine allows without a cluster or a registry:
the Kubernetes manifests against the Kubernetes API schemas (strict: an unknown field is
an error), the compose file through a compose implementation (podman-compose) and the
compose specification's schema, every BELAYER_* value either sets through Belayer's own
config loader, and every role they start through the image's entrypoint."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from belayer.config import ENV_PREFIX, load_config

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "infra" / "deploy"
K8S = DEPLOY / "k8s"
ENTRYPOINT = DEPLOY / "entrypoint.sh"
KUBERNETES_VERSION = "1.33"
# Not Kubernetes objects: kustomize's own file and the values of Temporal's Helm chart.
NOT_RESOURCES = {"kustomization.yaml", "temporal-values.yaml"}
# The entrypoint's roles, one Belayer component each, in every deployment.
BELAYER_ROLES = {"prepare", "sandbox-host", "rollout-node", "trajectory-worker", "trainer-worker", "endpoint"}
BIN = Path(sys.executable).parent


def manifests() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name not in NOT_RESOURCES)


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def all_resources() -> list[dict]:
    return [doc for path in manifests() for doc in documents(path)]


def env_file_values() -> dict[str, str]:
    """infra/deploy/env.example, as compose reads a .env file."""
    pairs = (
        line.split("=", 1)
        for line in (DEPLOY / "env.example").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    return {key: value for key, value in pairs}


def compose_config(extra_env: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)} | extra_env
    return subprocess.run(
        [str(BIN / "podman-compose"), "-f", str(DEPLOY / "compose.yaml"), "config"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=60,
    )


def loaded_with(env: dict[str, str], monkeypatch):
    """Belayer's configuration under exactly these BELAYER_* variables and no config file."""
    for key in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return load_config()


# ---------------------------------------------------------------- Kubernetes


@pytest.mark.parametrize("path", manifests(), ids=lambda p: p.name)
def test_every_manifest_is_valid_kubernetes(path):
    for doc in documents(path):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validation_is_strict_enough_to_catch_a_misspelt_field():
    deployment = documents(K8S / "trainer-worker.yaml")[0]
    deployment["spec"]["template"]["spec"]["containers"][0]["imag"] = "belayer:dev"
    with pytest.raises(kubernetes_validate.ValidationError, match="imag"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_the_kustomization_applies_every_manifest_but_the_secret_example():
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in manifests()} - {"secret.example.yaml"}


def containers_of(resource: dict) -> list[dict]:
    spec = resource.get("spec", {})
    pod = spec.get("template", {}).get("spec", {})
    return pod.get("containers", [])


def belayer_containers() -> list[tuple[str, dict]]:
    return [
        (r["metadata"]["name"], c)
        for r in all_resources()
        for c in containers_of(r)
        if any("configMapRef" in source for source in c.get("envFrom", []))
    ]


def pod_env(container: dict, field_values: dict[str, str]) -> dict[str, str]:
    """What the container's process sees: its envFrom sources (the ConfigMap, the example
    Secret), then its env entries, `$(VAR)` expanded as the kubelet does."""
    by_name = {r["metadata"]["name"]: r for r in all_resources() if r["kind"] in ("ConfigMap", "Secret")}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef") or source.get("secretRef")
        resource = by_name[ref["name"]]
        env |= {k: str(v) for k, v in (resource.get("data") or resource.get("stringData")).items()}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], entry["value"])
        else:
            env[entry["name"]] = field_values[entry["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def test_every_belayer_pod_gets_a_configuration_the_loader_accepts(monkeypatch):
    fields = {"spec.nodeName": "gpu-node-a", "metadata.name": "belayer-rollout-node-1"}
    seen = {}
    for name, container in belayer_containers():
        env = pod_env(container, fields)
        config = loaded_with({k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}, monkeypatch)
        seen[container["args"][0]] = config
        assert config.temporal.address == "temporal-frontend:7233", name
        assert config.state_dir == Path("/var/lib/belayer"), name
    assert set(seen) == BELAYER_ROLES
    # Per-node identities: the sandbox host's queue follows its node, the rollout node's id its pod.
    assert seen["sandbox-host"].sandbox.host_task_queue == "belayer-sandbox-gpu-node-a"
    assert seen["rollout-node"].rollout.node_id == "belayer-rollout-node-1"


def test_a_setting_the_loader_does_not_know_would_be_refused(monkeypatch):
    """The check above means something: a misspelt BELAYER_* variable fails loudly."""
    from belayer.errors import ConfigError

    with pytest.raises(ConfigError, match="node_idd"):
        loaded_with({"BELAYER_ROLLOUT__NODE_IDD": "x"}, monkeypatch)


# ---------------------------------------------------------------- compose


@pytest.fixture(scope="module")
def compose() -> dict:
    done = compose_config(env_file_values())
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


def test_podman_compose_reads_the_compose_file(compose):
    assert set(compose["services"]) == {"postgresql", "temporal", "temporal-ui", "minio", *BELAYER_ROLES}
    assert compose["services"]["sandbox-host"]["privileged"] is True
    # Nothing is published beyond the loopback interface.
    published = [port for service in compose["services"].values() for port in service.get("ports", [])]
    assert published and all(str(port).startswith("127.0.0.1:") for port in published)


@pytest.mark.usefixtures("local_processes")
def test_compose_without_its_secrets_names_the_missing_one():
    done = compose_config({})
    assert done.returncode != 0
    assert "BELAYER_S3_ACCESS_KEY" in done.stderr + done.stdout


@pytest.mark.usefixtures("local_processes")
def test_the_compose_file_follows_the_compose_specification():
    done = subprocess.run(
        [
            str(BIN / "check-jsonschema"),
            "--builtin-schema",
            "vendor.compose-spec",
            str(DEPLOY / "compose.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_belayer_service_gets_a_configuration_the_loader_accepts(compose, monkeypatch):
    roles = {}
    for service in compose["services"].values():
        env = {k: str(v) for k, v in (service.get("environment") or {}).items() if k.startswith(ENV_PREFIX)}
        if not env:
            continue
        roles[service["command"][0]] = loaded_with(env, monkeypatch)
    assert set(roles) == BELAYER_ROLES
    assert all(c.storage.endpoint == "http://minio:9000" for c in roles.values())
    assert roles["rollout-node"].rollout.node_id == "node0"


# ---------------------------------------------------------------- the image's entrypoint


def entrypoint(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ENTRYPOINT), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.usefixtures("local_processes")
def test_every_role_the_deployments_start_is_one_the_entrypoint_knows(compose):
    roles = {c["args"][0] for _, c in belayer_containers()}
    roles |= {s["command"][0] for s in compose["services"].values() if "build" in s}
    script = ENTRYPOINT.read_text()
    for role in roles:
        assert re.search(rf"^\s*{re.escape(role)}\)", script, re.M), f"entrypoint.sh has no role {role}"
    for role in roles:
        assert role in entrypoint("--help").stdout


@pytest.mark.usefixtures("local_processes")
def test_the_entrypoint_refuses_an_unknown_role():
    done = entrypoint("sandbox-hots")
    assert done.returncode == 2
    assert "unknown role 'sandbox-hots'" in done.stderr


@pytest.mark.usefixtures("local_processes")
def test_the_entrypoint_reaches_belayer_prepare():
    done = entrypoint("prepare", "--help")
    assert done.returncode == 0, done.stderr
    assert "search attributes" in done.stdout
