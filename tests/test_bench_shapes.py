"""The benchmark's Llama shape folders are read alike by our loader and by vLLM (which takes
its config from transformers): the hub's Llama 3 layout, llama3 rotary scaling."""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

from transformers import AutoConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
shapes = importlib.import_module("shapes")

from backend.core.layers.rotary import rope_parameters  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
               "high_freq_factor": 4.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 8192}


def test_llama_shapes_carry_rope_settings_as_llama_3_checkpoints_do_and_load_as_llama3(tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    for name in ("llama-1b", "llama-8b", "tiny-llama"):
        folder = shapes.write_shape(name, tmp_path / "out", tok)
        raw = json.loads((folder / "config.json").read_text())
        assert raw["rope_theta"] == 500000.0 and raw["rope_scaling"]["rope_type"] == "llama3"
        assert "rope_parameters" not in raw
        assert rope_parameters(AutoConfig.from_pretrained(folder)) == LLAMA3_ROPE
