"""One decode setting of a model shape at one batch size, timed through the engine
(CUDA graphs, overlap on): the steady step time, to set settings side by side in one device call.

    python tools/gpu/decode_step_ab.py --model /tmp/shapes/llama-8b [--quantization fp8] \
        [--batch 1] [--dependent-launch FAMILIES] [--torch-argmax] [--small-gemm-rows N] \
        [--label NAME]

Run one process per setting (a CUDA graph keeps what was launched when it was
captured): ``--dependent-launch`` sets the kernel families launched with programmatic
dependent launch (``kernels/pdl.py``: ``all``, ``none`` or a comma list),
``--torch-argmax`` takes greedy tokens from ``logits.argmax`` instead of
``sampling.argmax_rows``, ``--small-gemm-rows N`` moves the
row limits of ``kernels/small_gemm.py`` (half precision: ``layers.basic.SMALL_GEMM_MAX_ROWS``;
W8A8: ``layers.fp8_linear.SMALL_GEMM_ROWS``) to N. Prints one ``RESULT {json}`` line:
the median step of ``--runs`` runs (each ``--batch`` fresh prompts of 32 tokens and 256
new tokens, after one untimed run). docs/benchmarks/fp8.md reports what it measured.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks" / "gpu")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a shape folder (random weights)")
    ap.add_argument("--quantization", default="none", help="EngineConfig.quantization")
    ap.add_argument("--dependent-launch", default="",
                    help="RADIXLM_DEPENDENT_LAUNCH for this process (default: pdl.DEFAULT_FAMILIES)")
    ap.add_argument("--torch-argmax", action="store_true")
    ap.add_argument("--small-gemm-rows", type=int, default=0)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--label", default="")
    args = ap.parse_args()

    import torch

    from backend.core.kernels import pdl  # reads the variable at the first launch, not here

    if args.dependent_launch:
        os.environ[pdl.ENV] = args.dependent_launch
    if args.torch_argmax:
        import backend.core.forward_step as forward_step
        forward_step.argmax_rows = lambda logits: logits.argmax(dim=-1)

    if args.small_gemm_rows:
        from backend.core.layers import basic, fp8_linear
        basic.SMALL_GEMM_MAX_ROWS = fp8_linear.SMALL_GEMM_ROWS = args.small_gemm_rows

    import bench_engine
    import common
    from backend.core import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(
        model_path=args.model, device="cuda", dtype="bfloat16", load_format="dummy",
        quantization=args.quantization, max_total_tokens=max(16384, 512 * args.batch),
        max_running_requests=max(8, args.batch), cuda_graph_max_batch=args.batch,
        enable_cuda_graph=True, enable_overlap=True))
    steps = []
    for run in range(args.runs + 1):
        bench_engine.reset_cache(engine)
        step_log: list = []
        torch.cuda.synchronize()
        prompts = common.random_prompts(args.batch, 32, common.hash_seed("ab", run))
        bench_engine.drive(engine, [0.0] * args.batch, prompts,
                           bench_engine.greedy(SamplingParams, args.new_tokens),
                           step_log=step_log)
        if run:  # the first run compiles and warms up
            steady = bench_engine.steady_decode(step_log, args.batch, 32)
            steps.append(steady["step_s_median"] * 1e3)
    steps.sort()
    median = steps[len(steps) // 2]
    print("RESULT " + json.dumps({
        "label": args.label, "quantization": args.quantization, "batch": args.batch,
        "dependent_launch": sorted(pdl.enabled_families()),
        "argmax": "torch" if args.torch_argmax else "argmax_rows",
        "small_gemm_rows": args.small_gemm_rows or None,
        "step_ms": [round(s, 4) for s in steps], "median_ms": round(median, 4),
        "tok_s": round(args.batch * 1e3 / median, 1), "gpu": torch.cuda.get_device_name()}), flush=True)


if __name__ == "__main__":
    main()
