"""The chart's OpenAI sidecar and its router (sglang-router with Kubernetes service discovery).

Rendered by ``helm template`` (the helm `make env` installs next to the interpreter, else
one on PATH); every object is validated against the Kubernetes 1.30 schemas.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "radixlm"
ON = {"openai": {"enabled": True}, "router": {"enabled": True}}


@pytest.fixture(scope="module")
def helm(tmp_path_factory) -> list[str]:
    beside = Path(sys.executable).parent / "helm"
    binary = str(beside) if beside.exists() else shutil.which("helm")
    if binary is None:
        pytest.fail("no helm: `make env` installs it into .venv/bin (tools/install_helm.sh)")
    home = tmp_path_factory.mktemp("helm")
    return [binary, str(home)]


def render(helm: list[str], values: dict, release: str = "prod", namespace: str = "llm") -> list[dict]:
    binary, home = helm
    env = {"PATH": "/usr/bin:/bin", "HOME": home, "HELM_CACHE_HOME": f"{home}/cache",
           "HELM_CONFIG_HOME": f"{home}/config", "HELM_DATA_HOME": f"{home}/data"}
    proc = subprocess.run([binary, "template", release, str(CHART), "--namespace", namespace,
                           "-f", "-"], input=yaml.safe_dump(values), capture_output=True,
                          text=True, env=env, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip() or proc.stdout.strip())
    return [o for o in yaml.safe_load_all(proc.stdout) if o]


def by_name(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


@pytest.fixture(scope="module")
def objects(helm) -> dict[tuple[str, str], dict]:
    rendered = render(helm, ON)
    for obj in rendered:
        if obj["kind"] != "ServiceMonitor":  # a CRD: tests/test_chart_manifests.py checks it
            kubernetes_validate.validate(obj, "1.30.0", strict=True)
    return by_name(rendered)


def _command(container: dict) -> list[str]:
    return container.get("command", []) + container.get("args", [])


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_every_server_pod_runs_the_openai_sidecar_against_its_own_triton(objects):
    server = objects[("Deployment", "prod-radixlm")]
    containers = {c["name"]: c for c in server["spec"]["template"]["spec"]["containers"]}
    sidecar = containers["openai"]
    assert sidecar["image"] == containers["tritonserver"]["image"]
    command = _command(sidecar)
    assert command[0] == "radixlm-openai" and "--grpc-url=localhost:8001" in command
    assert "--port=8080" in command and "--model=llm" in command
    assert sidecar["ports"] == [{"name": "openai", "containerPort": 8080, "protocol": "TCP"}]
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/health", "port": "openai"}
    # the tokenizer routes read the model folder, which the image carries by default
    assert "--tokenizer=/opt/radixlm/models/default" in command and "volumeMounts" not in sidecar


def test_the_sidecar_reads_a_mounted_models_tokenizer_from_its_own_read_only_mount(helm):
    values = {**ON, "model": {"source": "pvc", "pvc": {"claimName": "weights"},
                              "subPath": "llama"}}
    server = by_name(render(helm, values))[("Deployment", "prod-radixlm")]
    containers = {c["name"]: c for c in server["spec"]["template"]["spec"]["containers"]}
    sidecar = containers["openai"]
    assert "--tokenizer=/mnt/model" in _command(sidecar)
    assert sidecar["volumeMounts"] == [{"name": "model", "mountPath": "/mnt/model",
                                        "readOnly": True, "subPath": "llama"}]
    assert sidecar["volumeMounts"][0] in containers["tritonserver"]["volumeMounts"]
    off = by_name(render(helm, {**values, "openai": {"enabled": True, "tokenizerRoutes": False}}))
    sidecar = {c["name"]: c for c in off[("Deployment", "prod-radixlm")]["spec"]["template"]
               ["spec"]["containers"]}["openai"]
    assert not any(a.startswith("--tokenizer") for a in _command(sidecar))
    assert "volumeMounts" not in sidecar


def test_the_router_discovers_exactly_the_ready_server_pods_at_the_sidecar_port(objects):
    server = objects[("Deployment", "prod-radixlm")]
    router = objects[("Deployment", "prod-radixlm-router")]
    (container,) = router["spec"]["template"]["spec"]["containers"]
    command = _command(container)
    assert command[:2] == ["sglang-router", "launch"]
    assert "--policy=cache_aware" in command and "--service-discovery" in command
    assert "--service-discovery-namespace=llm" in command
    assert "--service-discovery-port=8080" in command
    start = command.index("--selector") + 1
    end = next(i for i in range(start, len(command)) if command[i].startswith("--"))
    selector = dict(item.split("=", 1) for item in command[start:end])
    assert selector == server["spec"]["selector"]["matchLabels"]
    router_labels = router["spec"]["template"]["metadata"]["labels"]
    assert not _matches(selector, router_labels)  # the router never routes to itself
    for kind, name in (("Service", "prod-radixlm"), ("PodDisruptionBudget", "prod-radixlm")):
        pod_selector = objects[(kind, name)]["spec"]["selector"]
        pod_selector = pod_selector.get("matchLabels", pod_selector)
        assert not _matches(pod_selector, router_labels), f"the server {kind} selects the router"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readiness"


def test_the_router_may_watch_pods_in_its_namespace_only(objects):
    router = objects[("Deployment", "prod-radixlm-router")]["spec"]["template"]["spec"]
    role = objects[("Role", "prod-radixlm-router")]
    binding = objects[("RoleBinding", "prod-radixlm-router")]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "prod-radixlm-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": router["serviceAccountName"],
                                    "namespace": "llm"}]
    assert ("ServiceAccount", router["serviceAccountName"]) in objects
    assert not any(kind.startswith("Cluster") for kind, _ in objects)


def test_the_router_service_is_the_releases_openai_endpoint(objects):
    service = objects[("Service", "prod-radixlm-router")]
    router = objects[("Deployment", "prod-radixlm-router")]
    assert service["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["port"] == 8080
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def test_without_the_openai_api_there_is_no_sidecar_and_no_router(helm):
    rendered = by_name(render(helm, {"openai": {"enabled": False}, "router": {"enabled": True}}))
    server = rendered[("Deployment", "prod-radixlm")]
    assert [c["name"] for c in server["spec"]["template"]["spec"]["containers"]] == ["tritonserver"]
    assert not any(name.endswith("-router") for _, name in rendered)


def test_the_values_schema_refuses_an_unknown_routing_policy(helm):
    with pytest.raises(RuntimeError, match="policy"):
        render(helm, {**ON, "router": {"enabled": True, "policy": "least_busy"}})


def test_helm_lint_passes_strictly_with_the_sidecar_and_router(helm):
    binary, home = helm
    values = Path(home) / "on.yaml"
    values.write_text(yaml.safe_dump(ON))
    proc = subprocess.run([binary, "lint", "--strict", str(CHART), "-f", str(values)],
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "HOME": home})
    assert proc.returncode == 0, proc.stdout + proc.stderr
