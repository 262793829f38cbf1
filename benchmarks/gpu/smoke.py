"""Engine smoke test for the GPU machine (run_all.sh check): CUDA-graph decode must give
the same bf16 greedy tokens as eager decode.

    python benchmarks/gpu/smoke.py --model /tmp/shapes/llama-1b [--out results.jsonl]

Two engines in this process on the same random weights (same seed), one with
``enable_cuda_graph=True`` and one with False, both with a fixed 64k-token KV pool. Each
generates 32 greedy tokens for the same prompts at batch 1, 8 and 72 (sizes a graph is
captured at, so both paths run the same kernels on the same shapes: outputs must be
identical; exit status 1 otherwise; 72 is max_running_requests, which is not a listed
capture size but is captured as the limit) and at batch 5 (padded to a captured size: reported,
not asserted, since a padded GEMM may pick another kernel and random weights give
near-tied logits). Also one JSON-schema request (xgrammar present and working) and the
KV slot integrity check. Appends lines to --out (mode ``check``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
from common import log  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(C.REPO / "benchmarks/gpu/results/local.jsonl"))
    args = ap.parse_args(argv)
    import dataclasses

    import torch
    from backend.core import Engine, EngineConfig, SamplingParams

    on_cuda = args.device.startswith("cuda")
    label = C.model_label(args.model)
    rec = C.Recorder(args.out, "engine", label, "smoke", {},
                     extra={"quick": not on_cuda, "device": args.device})
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    base = dict(model_path=args.model, device=args.device,
                dtype=args.dtype or ("bfloat16" if on_cuda else "float32"), load_format="dummy",
                max_total_tokens=65536, max_running_requests=72, enable_overlap=True)
    engines = {}
    for graph in (True, False):
        kw = {k: v for k, v in dict(base, enable_cuda_graph=graph).items() if k in fields}
        t = time.perf_counter()
        engines[graph] = Engine(EngineConfig(**kw))
        if on_cuda:
            torch.cuda.synchronize()
        log(f"engine cuda_graph={graph}: built in {time.perf_counter() - t:.1f}s")
    prompts = C.random_prompts(72, 32, C.hash_seed("smoke"))
    sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    failed = False
    for b, asserted in ((1, True), (8, True), (72, True), (5, False)):
        outs, tps = {}, {}
        for graph, eng in engines.items():
            eng.generate(prompts[:b], sp)  # warm (compiles, captures)
            t = time.perf_counter()
            res = eng.generate(prompts[:b], sp)
            if on_cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t
            outs[graph] = [r.token_ids for r in res]
            tps[graph] = round(b * args.new_tokens / dt, 1)
        same = outs[True] == outs[False]
        first_diff = []
        for i, (a, e) in enumerate(zip(outs[True], outs[False])):
            if a != e:
                pos = next((j for j, (x, y) in enumerate(zip(a, e)) if x != y), min(len(a), len(e)))
                first_diff.append({"prompt": i, "position": pos})
        status = "ok" if same or not asserted else "error"
        failed |= status == "error"
        rec.write("check", f"graph_vs_eager_b{b}",
                  {"identical": same, "asserted": asserted, "first_differences": first_diff[:8],
                   "tok_per_s_graph": tps[True], "tok_per_s_eager": tps[False],
                   "sample_graph": outs[True][0][:12], "sample_eager": outs[False][0][:12]},
                  status=status, error=None if status == "ok" else "cuda-graph tokens differ from eager")
    eng = engines[True]
    try:
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                   "n": {"type": "integer", "minimum": 0, "maximum": 99}},
                  "required": ["ok", "n"], "additionalProperties": False}
        r = eng.generate([prompts[0]], SamplingParams(max_new_tokens=48, temperature=0.0,
                                                      json_schema=json.dumps(schema)))[0]
        parsed = json.loads(r.text)
        rec.write("check", "json_schema", {"text": r.text, "parsed": parsed})
    except Exception as exc:  # noqa: BLE001
        rec.write("check", "json_schema", status="error", error=f"{type(exc).__name__}: {exc}")
        failed = True
    try:
        for e in engines.values():
            e.check_integrity()
        rec.write("check", "integrity", {"ok": True})
    except AssertionError as exc:
        rec.write("check", "integrity", {"ok": False}, status="error", error=str(exc))
        failed = True
    log("smoke: " + ("FAILED" if failed else "passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
