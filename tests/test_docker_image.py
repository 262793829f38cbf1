"""The serving image: what the Dockerfile copies (and .dockerignore lets through), its
base, ports, health check and command, how it installs the backend and the default model,
and that docker/requirements-gpu.txt keeps the repository's pins. Reads the files only; no
docker needed.
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from deploy_helpers import CHART, ROOT, entrypoint


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
