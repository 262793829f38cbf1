#!/usr/bin/env bash
# Does the engine process's step loop run slower because other threads share its core?
# One call on the GPU machine (~4 min): the 1B offline rows with the engine in-process, in
# the child as it starts, and in the child pinned (RADIXLM_ENGINE_CPUS) to one CPU, or to
# both hyperthreads of one core, while the parent is kept off that core (taskset).
#   bash benchmarks/gpu/child_cpus.sh        (results in $OUT/results.jsonl, log on stdout)
set -uo pipefail
cd "$(dirname "$0")/../.."
source benchmarks/gpu/setup.sh >/dev/null 2>&1 || exit 1
lscpu | grep -E "^CPU\(s\)|Thread\(s\)|Core\(s\)|Socket|Model name" || true
last=$(( $(nproc --all) - 1 ))
sib=$(cat /sys/devices/system/cpu/cpu$last/topology/thread_siblings_list 2>/dev/null || echo "$last")
others=$("$BENCH_PY" - "$sib" "$last" <<'PY'
import sys
def parse(t):
    out = set()
    for p in t.split(","):
        a, _, b = p.partition("-"); out.update(range(int(a), int(b or a) + 1))
    return out
keep = set(range(int(sys.argv[2]) + 1)) - parse(sys.argv[1])
print(",".join(map(str, sorted(keep))))
PY
)
echo "engine CPU $last, its core $sib; the rest: $others"
E=("$BENCH_PY" benchmarks/gpu/bench_engine.py --model "$BENCH_SHAPES/llama-1b" --device cuda
   --reps 5 --out "$BENCH_RESULTS" --modes offline --budget-s "${CHILD_CPUS_BUDGET_S:-70}")
run() { echo "== $1"; shift; "$@" 2>&1 | grep -E "result .*offline/b(32|128)_in32" ; }
run in-process "${E[@]}" --config-name cpus-inproc
run child "${E[@]}" --engine-process --config-name cpus-child
RADIXLM_ENGINE_CPUS=$last run "child on CPU $last, parent elsewhere" taskset -c "$others" "${E[@]}" --engine-process --config-name cpus-child-pin1
RADIXLM_ENGINE_CPUS=$sib run "child on core $sib, parent elsewhere" taskset -c "$others" "${E[@]}" --engine-process --config-name cpus-child-pincore
"$BENCH_PY" - "$BENCH_RESULTS" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("mode") == "offline" and "in32" in r.get("workload", ""):
        m = r.get("metrics", {})
        print(f"{r['config']:<22} {r['workload']:<18} {m.get('output_tok_per_s')!s:>10}  reps {m.get('reps_output_tok_per_s')}")
PY
