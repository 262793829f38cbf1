"""Engine smoke test for the GPU machine (run_all.sh check): CUDA-graph decode must give
the same bf16 greedy tokens as eager decode.

    python benchmarks/gpu/smoke.py --model /tmp/shapes/llama-1b [--quantization fp8] [--out results.jsonl]

Two engines in this process on the same random weights (same seed), one with
``enable_cuda_graph=True`` and one with False, both with a fixed 64k-token KV pool. Each
generates 32 greedy tokens for the same prompts at batch 1, 8 and 72 (sizes a graph is
captured at, so both paths run the same kernels on the same shapes: outputs must be
identical; exit status 1 otherwise; 72 is max_running_requests, which is not a listed
capture size but is captured as the limit) and at batch 5 (padded to a captured size: reported,
not asserted, since a padded GEMM may pick another kernel and random weights give
near-tied logits). Extend steps replay graphs too (prompts of up to
``cuda_graph_max_tokens`` tokens): the batch-1, 8 and 5 prompts (32, 256 and 160 tokens)
are captured sizes, and a graph runs the extend kernel's tile an eager step would, so
their prefills must match as well. A staggered run then adds one
request per step to decoding ones (mixed prefill + decode steps, most padded, some with a
cached prefix): reported, not asserted, for the same reason as batch 5. Before all that,
three extend steps go straight through both model runners: at captured token counts
(128 tokens of 3 requests with 40 logits rows, then 32 tokens on their cached prefixes)
the logits must be bit-identical; so must a padded one (100 tokens in the 128 graph)
with the same step run eagerly on 128 rows (its padding as a dummy request). Also one JSON-schema request (xgrammar present and working) and the
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
    ap.add_argument("--quantization", default="none",
                    help="EngineConfig.quantization of both engines (fp8: the W8A8 kernels in graphs)")
    ap.add_argument("--out", default=str(C.REPO / "benchmarks/gpu/results/local.jsonl"))
    args = ap.parse_args(argv)
    import dataclasses

    import torch
    from backend.core import Engine, EngineConfig, SamplingParams

    on_cuda = args.device.startswith("cuda")
    label = C.model_label(args.model)
    quant = {} if args.quantization == "none" else {"quantization": args.quantization}
    rec = C.Recorder(args.out, "engine", label, "smoke", quant,
                     extra={"quick": not on_cuda, "device": args.device})
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    base = dict(model_path=args.model, device=args.device,
                dtype=args.dtype or ("bfloat16" if on_cuda else "float32"), load_format="dummy",
                max_total_tokens=65536, max_running_requests=72, enable_overlap=True,
                quantization=args.quantization)
    engines = {}
    for graph in (True, False):
        kw = {k: v for k, v in dict(base, enable_cuda_graph=graph).items() if k in fields}
        t = time.perf_counter()
        engines[graph] = Engine(EngineConfig(**kw))
        if on_cuda:
            torch.cuda.synchronize()
        log(f"engine cuda_graph={graph}: built in {time.perf_counter() - t:.1f}s")
    failed = False
    for name, metrics, ok in _extend_logits(engines) if on_cuda else []:  # graphs: CUDA only
        rec.write("check", name, metrics, status="ok" if ok else "error",
                  error=None if ok else "extend-graph logits differ from eager")
        failed |= not ok
    # disjoint prompts per batch size: a prompt cached by an earlier batch would turn the
    # next batch's prefill into a padded one (one new token for it)
    prompts = C.random_prompts(1 + 8 + 72 + 5, 32, C.hash_seed("smoke"))
    sp = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    start = 0
    for b, asserted in ((1, True), (8, True), (72, True), (5, False)):
        outs, tps = {}, {}
        batch_prompts, start = prompts[start:start + b], start + b
        for graph, eng in engines.items():
            eng.generate(batch_prompts, sp)  # warm (compiles, captures)
            t = time.perf_counter()
            res = eng.generate(batch_prompts, sp)
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
    outs = {graph: _staggered(eng, prompts, args.new_tokens) for graph, eng in engines.items()}
    rec.write("check", "graph_vs_eager_staggered",
              {"identical": outs[True] == outs[False], "asserted": False,
               "requests": len(outs[True]),
               "same_requests": sum(a == e for a, e in zip(outs[True], outs[False])),
               "extend_graph_sizes": getattr(engines[True].runner.extend_graphs, "sizes", None)},
              status="ok")
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


def _extend_logits(engines):
    """Extend steps straight through each engine's model runner, before any request:
    (check name, metrics, ok). Each must give bit-identical logits with and without
    graphs: same kernels on the same shapes, so the graph's padding (requests, logits rows,
    and for the 100-token step 28 tokens, matched by an explicit dummy request on the
    eager side) must change nothing. Padding alone changes the GEMMs' rounding (128 rows
    instead of 100): reported as ``vs_unpadded_eager``."""
    import torch
    from backend.core.forward_batch import ForwardBatch

    gen = torch.Generator().manual_seed(7)

    def ids(n):
        return torch.randint(1000, 30000, (n,), generator=gen).tolist()

    def build(rows, prefix, new, first_slot, logit_rows, tokens, device):
        total = sum(new)
        return ForwardBatch.build(input_ids=tokens, req_pool_indices=rows, extend_prefix_lens=prefix,
                                  extend_seq_lens=new, out_cache_loc=list(range(first_slot, first_slot + total)),
                                  logits_indices=logit_rows, device=device)

    # table rows and slots used here are overwritten when the engine hands them out
    exact = ([1, 2, 3], [0, 0, 0], [50, 40, 38], 1,
             [49, 89] + list(range(90, 128)))  # 128 tokens; request 3 scores every token
    follow = ([1, 2, 3], [50, 40, 38], [1, 1, 30], 129, [0, 1, 31])  # 32 tokens, with prefixes
    padded = ([4, 5, 6], [0, 0, 0], [45, 30, 25], 200, [44, 74, 99])  # 100 tokens -> 128
    steps = [("exact_128", exact), ("exact_32_prefix", follow), ("padded_100", padded)]
    tokens = {name: ids(sum(spec[2])) for name, spec in steps}
    logits, replayed = {}, {}
    for graph, eng in engines.items():
        runner = eng.runner
        for name, (rows, prefix, new, slot, logit_rows) in steps:
            batch = build(rows, prefix, new, slot, logit_rows, tokens[name], runner.device)
            replayed[graph, name] = runner.extend_graphs is not None and runner.extend_graphs.can_run(batch)
            logits[graph, name] = runner.forward(batch).float().cpu()
    # the padded step run eagerly with its padding made explicit: a dummy request of 28
    # tokens on table row 0 and KV slot 0, so its GEMMs run on the graph's 128 rows
    eager = engines[False].runner
    rows, prefix, new, slot, logit_rows = padded
    batch = ForwardBatch.build(
        input_ids=tokens["padded_100"] + [0] * 28, req_pool_indices=rows + [0],
        extend_prefix_lens=prefix + [0], extend_seq_lens=new + [28],
        out_cache_loc=list(range(slot, slot + 100)) + [0] * 28, logits_indices=logit_rows,
        device=eager.device)
    logits[False, "padded_100_by_hand"] = eager.forward(batch).float().cpu()
    checks = [("exact_128", "exact_128"), ("exact_32_prefix", "exact_32_prefix"),
              ("padded_100", "padded_100_by_hand")]
    out = []
    for name, ref in checks:
        a, e = logits[True, name], logits[False, ref]
        diff = (a - e).abs().max().item()
        ok = replayed[True, name] and not replayed[False, name] and diff == 0.0
        metrics = {"rows": a.shape[0], "max_abs_diff": diff, "graph_replayed": replayed[True, name],
                   "eager_reference": ref}
        if ref != name:  # what padding alone changes: GEMM rounding on 128 rows, not 100
            unpadded = logits[False, name]
            metrics["vs_unpadded_eager"] = {
                "max_abs_diff": (a - unpadded).abs().max().item(),
                "max_logit": unpadded.abs().max().item(),
                "argmax_agreement": (a.argmax(-1) == unpadded.argmax(-1)).float().mean().item()}
        out.append(("extend_graph_" + name, metrics, ok))
    return out


def _staggered(eng, prompts, new_tokens: int) -> list[list[int]]:
    """Greedy tokens of 12 requests added one per engine step while earlier ones decode;
    every other prompt repeats an earlier prompt's first 24 tokens (a cache hit)."""
    from backend.core import SamplingParams

    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    todo = [prompts[i] if i % 2 == 0 else prompts[i - 1][:24] + prompts[i][24:]
            for i in range(12)]
    ids: dict[str, int] = {}
    tokens: list[list[int]] = [[] for _ in todo]
    finished = 0
    while finished < len(todo):
        if len(ids) < len(todo):
            ids[eng.add_request(todo[len(ids)], sp)] = len(ids)
        for out in eng.step():
            tokens[ids[out.request_id]].extend(out.new_token_ids)
            finished += out.finished
    return tokens


if __name__ == "__main__":
    sys.exit(main())
