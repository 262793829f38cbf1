"""The serving-loop benchmark runs against the current response contract: every streamed
token of every request reaches its sink (it failed on every send once the contract made
outputs opt-in, and nothing noticed)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_serving_loop import run  # noqa: E402


def test_every_token_of_every_stream_reaches_its_sink():
    result = run(batch=4, step_s=0.001, tokens=8, senders=2)
    assert result["tokens"] == 32
    assert 1 <= result["responses"] <= 32  # queued tokens may merge into one response
    assert result["wall_ms"] >= 8 * 1.0  # the stand-in's own 8 steps of 1 ms
