"""bench_triton's requests speak the wire contract the llm model declares: a request whose
input_ids tensor has another type is rejected by Triton before the model sees it, and then
every Triton row of the benchmark fails."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
bench_triton = importlib.import_module("bench_triton")

from backend import wire  # noqa: E402

# Triton's wire type names and the numpy types tritonclient sends them as
NUMPY_OF_WIRE_TYPE = {"INT32": np.int32, "INT64": np.int64, "UINT32": np.uint32}


def declared_type(name: str) -> str:
    (spec,) = [s for s in wire.INPUT_SPECS if s["name"] == name]
    return spec["data_type"].removeprefix("TYPE_")


def test_input_ids_go_out_as_the_type_the_model_declares():
    assert declared_type(wire.INPUT_IDS) == "INT64"
    assert bench_triton.INPUT_IDS_DATATYPE == declared_type(wire.INPUT_IDS)


def test_the_input_ids_data_has_the_numpy_type_of_that_wire_type():
    data = bench_triton.input_ids_array([128000, 9906, 31999])
    assert data.dtype == NUMPY_OF_WIRE_TYPE[bench_triton.INPUT_IDS_DATATYPE]
    assert data.tolist() == [128000, 9906, 31999]
    assert data.shape == (3,)
