"""A model that cannot be loaded keeps tritonserver from starting half-configured: with a
truncated GGUF file as ``model_path`` the server logs the loader's reason and exits
instead of serving without its model."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import MODEL_REPOSITORY, REPO, _stop, free_ports
from gguf_factory import to_gguf
from model_factory import build_tiny_model

pytestmark = [pytest.mark.server]


def test_a_truncated_gguf_stops_the_server_with_the_reason(tmp_path):
    gguf = to_gguf(build_tiny_model(tmp_path / "tiny", "qwen2"), tmp_path / "tiny.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf.read_bytes()[: gguf.stat().st_size // 2])
    repo = tmp_path / "repo"
    shutil.copytree(MODEL_REPOSITORY / "llm", repo / "llm")
    config = repo / "llm" / "config.pbtxt"
    config.write_text(re.sub(r'(key: "model_path" value: \{ string_value: )"[^"]*"',
                             rf'\1"{cut}"', config.read_text()))
    assert str(cut) in config.read_text()
    http, grpc, metrics = free_ports(3)
    launcher = Path(sys.prefix) / "bin" / "radixlm-serve"
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [str(launcher), f"--model-repository={repo}", f"--http-port={http}",
             f"--grpc-port={grpc}", f"--metrics-port={metrics}"],  # exit-on-error: the default
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
    try:
        assert process.wait(timeout=180) != 0
    finally:
        _stop(process)
    text = log_path.read_text(errors="replace")
    assert "cut.gguf is truncated" in text, text[-3000:]
    assert re.search(r"failed to load 'llm'", text), text[-3000:]
