#!/usr/bin/env bash
# Does the engine process's step loop run slower because other threads share its core?
# One call on the GPU machine (~5 min): the 1B offline rows with the engine in-process, in
# the child unpinned (RADIXLM_ENGINE_CPUS=none) and with its step loop on a CPU of its own
# (the default, auto), then the same through tritonserver with one and two instances.
#   bash benchmarks/gpu/child_cpus.sh        (results in $OUT/results.jsonl, log on stdout)
# Rows: engine default (in-process), cpus-child-none, cpus-child-auto; triton cpus-triton-none,
# default and instances-2 (both pinned: the default), which report.py pairs with the
# in-process row of the same call.
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/gpu/setup.sh >/dev/null 2>&1 || exit 1
lscpu | grep -E "^CPU\(s\)|Thread\(s\)|Core\(s\)|Socket|Model name" || true
E=("$BENCH_PY" benchmarks/gpu/bench_engine.py --model "$BENCH_SHAPES/llama-1b" --device cuda
   --reps 5 --out "$BENCH_RESULTS" --modes offline --budget-s "${CHILD_CPUS_BUDGET_S:-70}")
run() { echo "== $1"; shift; "$@" 2>&1 | grep -E "result .*offline/b(32|128)_in32" ; }
run in-process "${E[@]}" --config-name default
if [ "${CHILD_CPUS_NONE:-1}" = 1 ]; then  # 0: skip the unpinned child
  RADIXLM_ENGINE_CPUS=none run "child, unpinned" "${E[@]}" --engine-process --config-name cpus-child-none
fi
run "child, step loop pinned (auto)" "${E[@]}" --engine-process --config-name cpus-child-auto
if [ "${CHILD_CPUS_TRITON:-1}" = 1 ]; then  # the same through tritonserver
  T=("$BENCH_PY" benchmarks/gpu/bench_triton.py --model "$BENCH_SHAPES/llama-1b" --device cuda
     --reps 3 --out "$BENCH_RESULTS" --modes offline --budget-s 75
     --server-python "$RADIXLM_SERVER_PYTHON" --server-log "$BENCH_OUT/server-cpus.log")
  export PYTHONPATH="$CLIENT_PYTHONPATH"
  RADIXLM_ENGINE_CPUS=none run "triton, unpinned" "${T[@]}" --config-name cpus-triton-none
  run "triton, pinned (auto)" "${T[@]}"
  run "triton x2, pinned (auto)" "${T[@]}" --instances 2
fi
"$BENCH_PY" - "$BENCH_RESULTS" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("mode") == "offline" and "in32" in r.get("workload", ""):
        m = r.get("metrics", {})
        print(f"{r['config']:<22} {r['workload']:<18} {m.get('output_tok_per_s')!s:>10}  reps {m.get('reps_output_tok_per_s')}")
PY
