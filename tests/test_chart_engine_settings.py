"""The engine settings the chart hands the server: its ConfigMap (which the entrypoint
writes into config.pbtxt), keys that are fields of the engine's EngineConfig, enums that are
the engine's, pods that roll when the settings change, and a tensor-parallel engine that
asks for its GPUs.
"""
from __future__ import annotations

import dataclasses
import json
import re

import pytest

from deploy_helpers import CHART, ROOT, HelmError, _container, _load, entrypoint


# The helm run and the rendered variants are shared by the chart and entrypoint test files
# (conftest.py builds them once a session); these names are what the tests below ask for.
@pytest.fixture(scope="module")
def helm(chart_helm):
    return chart_helm


@pytest.fixture(scope="module")
def rendered(rendered_chart):
    return rendered_chart


def test_a_tensor_parallel_engine_asks_for_its_gpus_and_runs_as_one_instance(helm):
    objs = {o["kind"]: o for o in helm.render({"engine": {"tensorParallelSize": 4}}, "big", "ml")}
    assert _container(objs)["resources"]["limits"]["nvidia.com/gpu"] == 4
    data = objs["ConfigMap"]["data"]
    assert data["RADIXLM_PARAM_TENSOR_PARALLEL_SIZE"] == "4"
    # the stubs front one engine whose ranks take GPUs 0..3: not one instance per GPU
    assert data["RADIXLM_INSTANCE_GROUP"] == "[ { count: 2, kind: KIND_MODEL } ]"
    with pytest.raises(HelmError, match="tensorParallelSize"):
        helm.render({"engine": {"tensorParallelSize": 0}})


def test_engine_settings_configmap(rendered, helm):
    default = rendered["default"]["ConfigMap"]["data"]
    assert default == {
        "RADIXLM_ENGINE_MODEL": "llm",
        "RADIXLM_MODEL_PATH": "/opt/radixlm/models/default",
        "RADIXLM_INSTANCE_GROUP": "[ { count: 2, kind: KIND_GPU } ]",
        "RADIXLM_PARAM_DEVICE": "cuda",
        "RADIXLM_PARAM_MAX_TOTAL_TOKENS": "",  # removed: the pool is sized from the GPU memory
        "RADIXLM_PARAM_MEM_FRACTION_STATIC": "0.85",
        "RADIXLM_PARAM_MAX_RUNNING_REQUESTS": "256",
        "RADIXLM_PARAM_MAX_PREFILL_TOKENS": "8192",
        "RADIXLM_PARAM_SCHEDULE_POLICY": "lpm",
        "RADIXLM_PARAM_ENABLE_RADIX_CACHE": "true",
        "RADIXLM_PARAM_DTYPE": "bfloat16",
    }
    custom = rendered["custom"]["ConfigMap"]["data"]
    # a million, not Helm's default float rendering "1e+06"
    assert custom["RADIXLM_PARAM_MAX_TOTAL_TOKENS"] == "1000000"
    assert custom["RADIXLM_PARAM_ENABLE_RADIX_CACHE"] == "false"
    assert custom["RADIXLM_PARAM_SCHEDULE_POLICY"] == "fcfs"
    assert custom["RADIXLM_PARAM_DTYPE"] == "float16"
    assert custom["RADIXLM_PARAM_MAX_RUNNING_REQUESTS"] == "64"
    assert custom["RADIXLM_PARAM_CUDA_GRAPH_MAX_BATCH"] == "256"
    assert custom["RADIXLM_PARAM_ATTENTION_BACKEND"] == "triton"
    for variant, objs in rendered.items():
        env_from = _container(objs)["envFrom"]
        assert env_from == [{"configMapRef": {"name": objs["ConfigMap"]["metadata"]["name"]}}]
        annotations = objs["Deployment"]["spec"]["template"]["metadata"]["annotations"]
        assert re.fullmatch(r"[0-9a-f]{64}", annotations["checksum/engine-config"])
    # pods roll when, and only when, the engine settings change
    checks = {v: o["Deployment"]["spec"]["template"]["metadata"]["annotations"]
              ["checksum/engine-config"] for v, o in rendered.items()}
    assert len(set(checks.values())) == 3
    again = helm.render({"replicaCount": 5, "autoscaling": {"enabled": False}})
    deployment = next(o for o in again if o["kind"] == "Deployment")
    assert deployment["spec"]["template"]["metadata"]["annotations"][
        "checksum/engine-config"] == checks["default"]


def test_engine_settings_are_engine_config_fields(rendered):
    """The keys the chart writes into config.pbtxt are fields of backend.core.config.EngineConfig,
    and the chart's enums are the engine's."""
    engine_config = _load("radixlm_engine_config", ROOT / "backend" / "core" / "config.py")
    fields = {f.name for f in dataclasses.fields(engine_config.EngineConfig)}
    for variant, objs in rendered.items():
        params = entrypoint.engine_parameters(objs["ConfigMap"]["data"])
        assert set(params) <= fields, (variant, set(params) - fields)
        assert params["model_path"] == objs["ConfigMap"]["data"]["RADIXLM_MODEL_PATH"]
    schema = json.loads((CHART / "values.schema.json").read_text())
    engine = schema["properties"]["engine"]["properties"]
    assert tuple(engine["schedulePolicy"]["enum"]) == engine_config.SCHEDULE_POLICIES
    assert tuple(engine["dtype"]["enum"]) == engine_config.DTYPES
