"""The image's entrypoint (docker/entrypoint.py): it writes the chart's engine settings
into the model repository's config.pbtxt files (idempotently, an empty value removing a
parameter), finds the repository from tritonserver's arguments, and as PID 1 starts
tritonserver with the hardening flags, keeps the admin token out of its log and passes
SIGTERM on.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from deploy_helpers import ROOT, entrypoint


# The rendered variants are shared by the chart and entrypoint test files (conftest.py
# renders them once a session); this name is what the tests below ask for.
@pytest.fixture(scope="module")
def rendered(rendered_chart):
    return rendered_chart


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


def test_entrypoint_serves_tritonserver_hardened_and_supervised(repository, tmp_path):
    """The image's PID 1 adds the server flags radixlm-serve adds and stays to supervise:
    the admin token never shows in its log, and SIGTERM reaches tritonserver."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "tritonserver"  # prints its arguments, ends on SIGTERM
    fake.write_text("#!/bin/sh\necho \"args: $*\"\ntrap 'echo terminated; exit 0' TERM\n"
                    "while true; do sleep 0.1; done\n")
    fake.chmod(0o755)
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "XDG_RUNTIME_DIR": str(runtime),
           "RADIXLM_ADMIN_TOKEN": "t0k3n"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "docker" / "entrypoint.py"),
                             "tritonserver", f"--model-repository={repository}"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("args:"):
            break
    proc.send_signal(signal.SIGTERM)
    out = "".join(lines) + proc.stdout.read()
    assert proc.wait(20) == 0, out
    args = lines[-1].split()
    assert "--exit-timeout-secs=10" in args
    assert ("--http-restricted-api=logging,trace,shared-memory,model-repository:"
            "radixlm-admin-token=t0k3n") in args
    assert f"--backend-config=python,shm-region-prefix-name=radixlm-{proc.pid}-" in args
    assert "[radixlm-entrypoint] tritonserver" in out and "<admin token>" in out
    assert "t0k3n" not in out.replace(lines[-1], "")  # only the stand-in printed it
    assert "radixlm-serve: got SIGTERM; stopping tritonserver" in out and "terminated" in out
