"""The server pod the chart describes: health probes on Triton's endpoints, container and
service ports, the server's arguments, GPUs and shared memory, where the model folder comes
from, and a shutdown that fits the grace period with the admin token from a Secret.
"""
from __future__ import annotations

import pytest

from deploy_helpers import VARIANTS, _container


# The helm run and the rendered variants are shared by the chart and entrypoint test files
# (conftest.py builds them once a session); these names are what the tests below ask for.
@pytest.fixture(scope="module")
def helm(chart_helm):
    return chart_helm


@pytest.fixture(scope="module")
def rendered(rendered_chart):
    return rendered_chart


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_probes_hit_the_triton_health_endpoints(rendered, variant):
    container = _container(rendered[variant])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    expected = {"startupProbe": "/v2/health/ready", "readinessProbe": "/v2/health/ready",
                "livenessProbe": "/v2/health/live"}
    for probe, path in expected.items():
        get = container[probe]["httpGet"]
        assert get["path"] == path
        assert ports[get["port"]] == 8000
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 1200  # 20 min to load


def test_container_ports_args_and_service_ports(rendered):
    for variant, objs in rendered.items():
        container = _container(objs)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002}
        service = {p["name"]: (p["port"], p["targetPort"]) for p in objs["Service"]["spec"]["ports"]}
        assert service == {"http": (8000, "http"), "grpc": (8001, "grpc"),
                           "metrics": (8002, "metrics")}
        args = container["args"]
        assert args[0] == "tritonserver"
        for flag in ("--model-repository=/models/model_repository", "--http-port=8000",
                     "--grpc-port=8001", "--metrics-port=8002", "--allow-metrics=true"):
            assert flag in args, (variant, flag)
    assert rendered["default"]["Service"]["spec"]["sessionAffinity"] == "None"
    assert rendered["custom"]["Service"]["spec"]["sessionAffinity"] == "ClientIP"


def test_gpu_limit_and_shared_memory(rendered):
    expected = {"default": (1, "8Gi"), "custom": (2, "32Gi"), "pvc": (1, "8Gi")}
    for variant, (gpus, shm) in expected.items():
        objs = rendered[variant]
        container = _container(objs)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert container["resources"]["limits"]["memory"] == "64Gi"
        volumes = {v["name"]: v for v in objs["Deployment"]["spec"]["template"]["spec"]["volumes"]}
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": shm}
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["dshm"]["mountPath"] == "/dev/shm"


def test_model_folder_sources(rendered):
    default, custom, pvc = (rendered[v] for v in ("default", "custom", "pvc"))
    # baked into the image: nothing to mount
    assert "model" not in {m["name"] for m in _container(default)["volumeMounts"]}
    assert default["ConfigMap"]["data"]["RADIXLM_MODEL_PATH"] == "/opt/radixlm/models/default"

    spec = custom["Deployment"]["spec"]["template"]["spec"]
    volume = {v["name"]: v for v in spec["volumes"]}["model"]
    assert volume["hostPath"] == {"path": "/data/models/Qwen2.5-7B-Instruct", "type": "Directory"}
    mount = {m["name"]: m for m in _container(custom)["volumeMounts"]}["model"]
    assert mount == {"name": "model", "mountPath": "/models/hf", "readOnly": True}
    assert custom["ConfigMap"]["data"]["RADIXLM_MODEL_PATH"] == "/models/hf"

    spec = pvc["Deployment"]["spec"]["template"]["spec"]
    volume = {v["name"]: v for v in spec["volumes"]}["model"]
    assert volume["persistentVolumeClaim"] == {"claimName": "qwen-weights", "readOnly": True}
    mount = {m["name"]: m for m in _container(pvc)["volumeMounts"]}["model"]
    assert mount["subPath"] == "Qwen2.5-0.5B-Instruct" and mount["mountPath"] == "/mnt/model"


def test_shutdown_bound_fits_the_grace_period_and_the_admin_token_comes_from_a_secret(helm,
                                                                                   rendered):
    pod = rendered["default"]["Deployment"]["spec"]["template"]["spec"]
    container = _container(rendered["default"])
    assert "--exit-timeout-secs=10" in container["args"]
    # the server's bound: exit timeout + 3 s (supervisor) + 5 s (its processes)
    assert pod["terminationGracePeriodSeconds"] >= 10 + 3 + 5
    assert "env" not in container  # no Secret: a random token made up at start
    objs = {o["kind"]: o for o in helm.render({"admin": {"existingSecret": "radixlm-admin"}})}
    env = _container(objs)["env"]
    assert env == [{"name": "RADIXLM_ADMIN_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": "radixlm-admin", "key": "token"}}}]
