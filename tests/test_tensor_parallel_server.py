"""A tensor-parallel engine behind a real tritonserver (CPU, gloo): the default model
(9 query heads, 3 KV heads) over three ranks as one Triton instance answers as one rank
does, and stopping the server leaves no rank behind."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import requests

from conftest import MODEL_REPOSITORY, _stop, ensure_default_model, start_server
from test_tensor_parallel import _wait_gone

pytestmark = [pytest.mark.server, pytest.mark.slow]

SIZE = 3


def test_three_ranks_serve_the_default_model_and_stop_with_the_server(tmp_path):
    ensure_default_model()
    repo = tmp_path / "repo"
    shutil.copytree(MODEL_REPOSITORY / "llm", repo / "llm")
    config = repo / "llm" / "config.pbtxt"
    config.write_text(config.read_text() + 'parameters: { key: "tensor_parallel_size" '
                      f'value: {{ string_value: "{SIZE}" }} }}\n')
    server = start_server(tmp_path / "server.log", (f"--model-repository={repo}",))
    pids: list[int] = []
    try:
        body = {"text_input": "The capital of France is", "stream": True,
                "sampling_parameters": json.dumps({"max_tokens": 8, "temperature": 0})}
        with requests.post(f"http://{server.http_url}/v2/models/llm/generate_stream",
                           json=body, stream=True, timeout=120) as response:
            events = [json.loads(line[len(b"data:"):]) for line in response.iter_lines()
                      if line.startswith(b"data:")]
        assert "".join(e["text_output"] for e in events).startswith(" Paris")
        joined = re.search(rf"group of {SIZE} ranks joined; ranks 1..{SIZE - 1} are "
                           r"processes \[([\d, ]+)\]", server.log_path.read_text())
        assert joined, server.log_tail()
        pids = [int(p) for p in joined.group(1).split(",")]
        assert len(pids) == SIZE - 1
    finally:
        _stop(server.process)
    _wait_gone(pids)
