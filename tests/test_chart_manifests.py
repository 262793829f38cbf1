"""The Helm chart's objects: every one valid against the Kubernetes 1.30 JSON schemas of
kubernetes-validate (the ServiceMonitor, a CRD, against a structural schema written below),
the set each variant renders, the labels and selectors that tie them together, the
autoscaler, monitor and disruption budget, the values the chart refuses, and a strict
``helm lint``. The chart is rendered by a real ``helm`` (deploy_helpers.py); runs offline.
"""
from __future__ import annotations

import re

import jsonschema
import kubernetes_validate
import pytest

from deploy_helpers import K8S_VERSION, VARIANTS, HelmError, _container


# The helm run and the rendered variants are shared by the chart and entrypoint test files
# (conftest.py builds them once a session); these names are what the tests below ask for.
@pytest.fixture(scope="module")
def helm(chart_helm):
    return chart_helm


@pytest.fixture(scope="module")
def rendered(rendered_chart):
    return rendered_chart


# kubernetes-validate knows only the built-in kinds; the ServiceMonitor is a CRD of the
# Prometheus operator, so the fields the chart may write are spelled out here.
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object", "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "namespaceSelector": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"any": {"type": "boolean"},
                                   "matchNames": {"type": "array", "items": {"type": "string"}}},
                },
                "selector": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "matchLabels": {"type": "object",
                                        "additionalProperties": {"type": "string"}},
                        "matchExpressions": {"type": "array"},
                    },
                },
                "endpoints": {
                    "type": "array", "minItems": 1,
                    "items": {
                        "type": "object", "required": ["port"], "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string", "minLength": 1},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": r"^\d+(ms|s|m|h)$"},
                            "scrapeTimeout": {"type": "string", "pattern": r"^\d+(ms|s|m|h)$"},
                            "honorLabels": {"type": "boolean"},
                        },
                    },
                },
            },
        },
    },
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_manifest_validates_against_the_kubernetes_schemas(rendered, variant):
    objs = rendered[variant]
    for kind, obj in objs.items():
        if kind == "ServiceMonitor":
            jsonschema.validate(obj, SERVICE_MONITOR_SCHEMA)
            service_ports = {p["name"] for p in objs["Service"]["spec"]["ports"]}
            for endpoint in obj["spec"]["endpoints"]:
                assert endpoint["port"] in service_ports
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{variant} {kind} is invalid at {path}: {exc.message}")


def test_default_release_objects(rendered):
    objs = rendered["default"]
    assert set(objs) == {"ConfigMap", "Deployment", "Service", "ServiceMonitor",
                         "HorizontalPodAutoscaler", "PodDisruptionBudget"}
    assert {o["metadata"]["name"] for k, o in objs.items() if k != "ConfigMap"} == {"radixlm"}
    assert objs["ConfigMap"]["metadata"]["name"] == "radixlm-engine"
    assert _container(objs)["image"] == "radixlm/tritonserver:0.1.0"
    assert set(rendered["pvc"]) == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"}
    assert rendered["custom"]["Deployment"]["metadata"]["name"] == "prod-radixlm"
    assert _container(rendered["custom"])["image"] == "registry.example.com/ml/radixlm:2026.11.1"
    custom_pod = rendered["custom"]["Deployment"]["spec"]["template"]["spec"]
    assert custom_pod["runtimeClassName"] == "nvidia"
    assert "runtimeClassName" not in rendered["default"]["Deployment"]["spec"]["template"]["spec"]


def test_hpa_custom_metric(rendered, helm):
    default = rendered["default"]["HorizontalPodAutoscaler"]["spec"]
    assert default["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                         "name": "radixlm"}
    assert (default["minReplicas"], default["maxReplicas"]) == (1, 4)
    (metric,) = default["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"] == {"name": "radixlm_num_requests_waiting"}
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "4"}
    assert default["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 600

    custom = rendered["custom"]["HorizontalPodAutoscaler"]["spec"]
    (metric,) = custom["metrics"]
    assert metric["pods"]["metric"]["name"] == "radixlm_kv_cache_usage_ratio"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "800m"}
    assert (custom["minReplicas"], custom["maxReplicas"]) == (2, 8)
    assert custom["scaleTargetRef"]["name"] == rendered["custom"]["Deployment"]["metadata"]["name"]
    # the HPA owns the replica count; without it the chart sets it
    assert "replicas" not in rendered["default"]["Deployment"]["spec"]
    assert rendered["pvc"]["Deployment"]["spec"]["replicas"] == 3

    selected = helm.render({"autoscaling": {
        "metricSelector": {"matchLabels": {"model": "llm"}},
        "targetAverageValue": {"radixlm_num_requests_waiting": 2}}})
    hpa = next(o for o in selected if o["kind"] == "HorizontalPodAutoscaler")
    kubernetes_validate.validate(hpa, K8S_VERSION, strict=True)
    pods = hpa["spec"]["metrics"][0]["pods"]
    assert pods["metric"]["selector"] == {"matchLabels": {"model": "llm"}}
    assert pods["target"]["averageValue"] == "2"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_labels_and_selectors_agree(rendered, variant):
    objs = rendered[variant]
    _, release, namespace = VARIANTS[variant]
    deployment = objs["Deployment"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector == {"app.kubernetes.io/name": "radixlm", "app.kubernetes.io/instance": release}
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    service = objs["Service"]
    assert service["spec"]["selector"] == selector
    assert objs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == selector
    for kind, obj in objs.items():
        assert selector.items() <= obj["metadata"]["labels"].items(), kind
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    if "ServiceMonitor" in objs:
        monitor = objs["ServiceMonitor"]["spec"]
        # the ServiceMonitor finds the Service by its labels, in the release's namespace
        assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert monitor["namespaceSelector"] == {"matchNames": [namespace]}
        (endpoint,) = monitor["endpoints"]
        assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
        port = {p["name"]: p for p in service["spec"]["ports"]}[endpoint["port"]]
        assert port["port"] == 8002


def test_service_monitor_and_pdb_settings(rendered):
    monitor = rendered["custom"]["ServiceMonitor"]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["endpoints"][0]["interval"] == "30s"
    assert rendered["default"]["ServiceMonitor"]["spec"]["endpoints"][0]["interval"] == "15s"
    assert rendered["default"]["PodDisruptionBudget"]["spec"] == {
        "maxUnavailable": 1, "selector": rendered["default"]["PodDisruptionBudget"]["spec"]["selector"]}
    custom_pdb = rendered["custom"]["PodDisruptionBudget"]["spec"]
    assert custom_pdb["minAvailable"] == 1 and "maxUnavailable" not in custom_pdb


@pytest.mark.parametrize("values, message", [
    ({"autoscaling": {"metric": "nv_gpu_utilization"}}, "autoscaling.metric"),
    ({"model": {"source": "pvc"}}, "model"),
    ({"model": {"source": "hostPath", "hostPath": {"path": "relative/dir"}}}, "model"),
    ({"gpu": {"count": 0}}, "gpu.count"),
    ({"engine": {"schedulePolicy": "random"}}, "engine.schedulePolicy"),
    ({"engine": {"extraParameters": {"Bad-Key": 1}}}, "engine.extraParameters"),
    ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "minReplicas is larger"),
    ({"autoscaling": {"targetAverageValue": {"radixlm_num_requests_waiting": None}}},
     "no entry for the metric radixlm_num_requests_waiting"),
    ({"terminationGracePeriodSeconds": 15}, "terminationGracePeriodSeconds must be at least"),
    ({"triton": {"exitTimeoutSeconds": 30}}, "terminationGracePeriodSeconds must be at least"),
])
def test_invalid_values_are_rejected(helm, values, message):
    with pytest.raises(HelmError, match=re.escape(message)):
        helm.render(values)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_helm_lint_passes_strictly(helm, variant):
    """`helm lint --strict`: Chart.yaml, the schema and every template, warnings as errors."""
    values, _, namespace = VARIANTS[variant]
    out = helm.run("lint", values, "--strict", "--namespace", namespace)
    assert "1 chart(s) linted, 0 chart(s) failed" in out
