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


# -- reading the streamed responses (the contract of backend/wire_outputs.py)
from backend import wire_outputs  # noqa: E402

WANTED = frozenset({wire.OUTPUT_IDS, wire.FINISH_REASON, wire.NUM_CACHED_TOKENS})


def response(token_ids: list[int], finish_reason: str | None, cached: int = 0):
    sample = wire_outputs.SampleOutput(0, "", token_ids, finish_reason, len(token_ids),
                                       num_cached_tokens=cached)
    tensors = wire_outputs.generation_outputs([sample], outputs=WANTED, num_input_tokens=4,
                                              context_ids=[])
    return tensors.get


def new_record() -> dict:
    return {"first": None, "end": None, "n_out": 0, "cached": 0}


def test_a_running_request_says_None_and_is_not_taken_for_finished():
    rec = new_record()
    assert bench_triton.tally_response(rec, response([11], None), t=0.5) is False
    assert rec["end"] is None and rec["n_out"] == 1 and rec["first"] == 0.5


def test_tokens_are_summed_over_the_responses_up_to_the_final_one():
    rec = new_record()
    stream = [([11, 12], None, 0.1), ([13], None, 0.2), ([14, 15, 16], "length", 0.3)]
    finished = [bench_triton.tally_response(rec, response(ids, reason, cached=3), t)
                for ids, reason, t in stream]
    assert finished == [False, False, True]
    assert rec["n_out"] == 6
    assert (rec["first"], rec["end"]) == (0.1, 0.3)
    assert rec["finish_reason"] == "length" and rec["cached"] == 3


def test_an_empty_final_response_ends_the_request():
    rec = new_record()
    bench_triton.tally_response(rec, response([7], None), t=0.1)
    assert bench_triton.tally_response(rec, response([], "stop"), t=0.2) is True
    assert rec["n_out"] == 1 and rec["end"] == 0.2


def test_the_benchmark_passes_on_the_serving_parameters_the_model_reads():
    """make_repository drops parameters it does not know; the serving layer's own
    (backend/model_config.py) must survive, or a benchmark row silently measures the
    default instead."""
    known = bench_triton.engine_fields()
    assert {"engine_process", "request_timeout_s", "REPORT_CUSTOM_METRICS"} <= known
    assert {"max_running_requests", "enable_overlap", "quantization"} <= known
