#!/usr/bin/env bash
# Which kernel families should launch early (backend/core/kernels/pdl.py) on this GPU:
# the 8B shape's steady decode step (tools/gpu/decode_step_ab.py, one process a setting)
# with each RADIXLM_DEPENDENT_LAUNCH setting, bf16 and FP8 weights (AB_QUANTIZATIONS), at
# the batch sizes in AB_BATCHES (default 1). Run on the GPU machine, in one call (about
# 35 s a setting, so ten settings a call; norm-activation matters from 2 rows on, e.g.
# AB_BATCHES="32 128" AB_QUANTIZATIONS=none ... few-row-gemm default):
#
#   bash tools/gpu/ab_dependent_launch.sh [SETTINGS...]   # default: see SETTINGS below
#
# Prints one RESULT line a setting and a table of the median steps; writes the lines to
# $OUT/dependent_launch_ab.jsonl (or ./dependent_launch_ab.jsonl).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
# shellcheck source=/dev/null
source benchmarks/gpu/setup.sh >/dev/null
SETTINGS=("$@")
if (( ${#SETTINGS[@]} == 0 )); then
  # no norm-activation here: at batch 1 the norms and SiLU-and-mul run inside the
  # matrix-vector kernels, so that setting would time the same step as default
  SETTINGS=(default none all matrix-vector decode-attention)
fi
BATCHES=(${AB_BATCHES:-1})
QUANTS=(${AB_QUANTIZATIONS:-none fp8})
out="${OUT:-.}/dependent_launch_ab.jsonl"
: > "$out"
for q in "${QUANTS[@]}"; do
  for b in "${BATCHES[@]}"; do
    for s in "${SETTINGS[@]}"; do
      arg=()
      [ "$s" != default ] && arg=(--dependent-launch "$s")
      timeout 120 "$BENCH_PY" tools/gpu/decode_step_ab.py --model "$BENCH_SHAPES/llama-8b" \
        --quantization "$q" --batch "$b" --runs 2 --label "$s" "${arg[@]}" 2>&1 \
        | grep '^RESULT ' | sed 's/^RESULT //' | tee -a "$out"
    done
  done
done
"$BENCH_PY" - "$out" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print(f"{'weights':8s} {'batch':>5s} {'setting':18s} {'step ms':>8s} {'tok/s':>9s}")
for r in rows:
    print(f"{r['quantization']:8s} {r['batch']:5d} {r['label']:18s} {r['median_ms']:8.3f} {r['tok_s']:9.1f}")
PY
