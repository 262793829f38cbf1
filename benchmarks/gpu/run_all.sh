#!/usr/bin/env bash
# The GPU benchmark suite, by phase:  bash benchmarks/gpu/run_all.sh PHASE [PHASE ...]
#
#   check      environment (imports, server pieces), tools/check_kernels_gpu.py, and the
#              engine smoke test (smoke.py: CUDA-graph tokens == eager tokens on llama-1b)
#   engine     bench_engine.py, default configuration: llama-1b, llama-8b, then the default
#              model (offline + prefix)
#   baselines  radix cache off, transformers static batches, overlap off (1b and 8b)
#   triton     bench_triton.py: the engine behind tritonserver over gRPC streaming
#   instances  the same with BENCH_INSTANCES (default "2 4") Triton instances of the model
#              sharing one engine process
#   cache      the two-tier radix cache: bench_cache_tiers.py (multi-turn chats with a
#              working set 4x the GPU cache, host tier vs GPU-only LRU; load vs recompute
#              by prefix length), then bench_engine's prefix and offline rows with the host
#              tier on and off (same call otherwise)
#   openai     bench_openai_overhead.py: 32 streams straight over gRPC against the same
#              through radixlm-openai (SSE), one server (BENCH_OPENAI_MODEL, default llama-8b)
#   peer       vLLM beside us on this machine instance (peer.sh install first): per model,
#              vllm_peer.py for each of BENCH_PEER_CONFIGS (default "async"; e.g. "default
#              async", "fp8+async"), then bench_engine's offline + prefix rows and
#              bench_triton's offline rows; all from this run only (the report's ratios
#              pair rows of one run)
#   report     report.py: docs/benchmarks/{README.md,*.png} from the published runs in
#              docs/benchmarks/runs/ (run it here, after publish.py; see README.md)
#
# Every step is its own process under `timeout`; a failing step is logged and the next one
# runs. The phases of one invocation share BENCH_DEADLINE_S (default 480 s): each step gets
# a share of what is left, passed to the script as --budget-s; the script records the items
# that do not fit as "skipped". Items already measured (status ok) in the raw results
# benchmarks/gpu/results/*.jsonl (git-ignored) or in this run's are skipped (resume), unless
# BENCH_FRESH=1 (then only this run's results count). BENCH_ONLY=REGEX runs only the steps
# whose name ("engine llama-1b", "hf llama-8b", "overlap-off llama-1b", ...) matches;
# BENCH_ENGINE_MODES / BENCH_TRITON_MODES narrow the engine and triton steps' --modes.
# BENCH_ENGINE_ARGS="quantization=fp8 ..." (EngineConfig fields) go to the engine, triton and
# peer steps, whose rows are then labelled BENCH_CONFIG_NAME (required with them; name it as
# vLLM's configuration of the same precision: fp8, kv-fp8, fp8+kv-fp8); BENCH_PREFIX_WORKLOADS
# (comma list, e.g. few-shot) narrows bench_engine's prefix workloads.
# Output: $OUT/results.jsonl, $OUT/log.txt, $OUT/server-<model>.log on the device machine
# ($OUT unset: benchmarks/gpu/results/local/). BENCH_QUICK=1: CPU dry run, tiny sizes.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
[ $# -ge 1 ] || { sed -n '2,25p' "$0"; exit 2; }
if [ -n "${BENCH_ENGINE_ARGS:-}" ] && [ -z "${BENCH_CONFIG_NAME:-}" ]; then
  echo "run_all: BENCH_ENGINE_ARGS=\"$BENCH_ENGINE_ARGS\" needs BENCH_CONFIG_NAME (the rows' label," \
       "e.g. fp8: else they would pass for the default configuration's)"; exit 2
fi
export BENCH_RUN_ID="${BENCH_RUN_ID:-$(date +%Y%m%d-%H%M%S)}"
T0=$SECONDS
DEADLINE="${BENCH_DEADLINE_S:-480}"

if [ "$1" = report ] && [ $# -eq 1 ]; then
  exec "${BENCH_PY:-$ROOT/.venv/bin/python}" benchmarks/gpu/report.py "${@:2}"
fi

# shellcheck source=setup.sh
source benchmarks/gpu/setup.sh || exit 1
exec > >(tee -a "$BENCH_LOG") 2>&1
echo "run_all: phases [$*] run $BENCH_RUN_ID deadline ${DEADLINE}s on $(hostname) at $(date -Is)"

QUICK="${BENCH_QUICK:-0}"
if [ "$QUICK" = 1 ]; then
  DEV=(--device cpu --quick); MODELS=(${BENCH_MODELS:-default}); SMOKE_MODEL=tiny-llama
else
  DEV=(--device cuda); MODELS=(${BENCH_MODELS:-llama-1b llama-8b}); SMOKE_MODEL=llama-1b
fi
DONE=(--done "$BENCH_RESULTS")
if [ "${BENCH_FRESH:-0}" != 1 ]; then  # BENCH_FRESH=1: measure again what earlier runs have
  for f in "$ROOT"/benchmarks/gpu/results/*.jsonl; do [ -f "$f" ] && DONE+=("$f"); done
fi
SERVER_PIDFILE="${BENCH_TMP:-/tmp}/radixlm_bench_server.pid"
# our side's engine settings and their label (engine and triton steps take them alike)
ENGINE_ARGS=() TRITON_ARGS=()
for kv in ${BENCH_ENGINE_ARGS:-}; do ENGINE_ARGS+=(--engine-arg "$kv"); TRITON_ARGS+=(--engine-param "$kv"); done
if [ -n "${BENCH_CONFIG_NAME:-}" ]; then
  ENGINE_ARGS+=(--config-name "$BENCH_CONFIG_NAME"); TRITON_ARGS+=(--config-name "$BENCH_CONFIG_NAME")
fi
PREFIX_ARGS=(${BENCH_PREFIX_WORKLOADS:+--prefix-workloads "$BENCH_PREFIX_WORKLOADS"})

left() { echo $((DEADLINE - (SECONDS - T0))); }
# share W REST: seconds for a step of weight W when steps of total weight REST follow it
share() { local l=$(( $(left) - 20 )); (( l < 0 )) && l=0; echo $(( l * $1 / ($1 + $2) )); }

cap() { (( $1 < $2 )) && echo "$1" || echo "$2"; }

step() {  # step NAME BUDGET CMD... (the command gets --budget-s BUDGET appended by callers)
  local name="$1" b="$2"; shift 2
  if [ -n "${BENCH_ONLY:-}" ] && ! [[ "$name" =~ $BENCH_ONLY ]]; then
    echo "== $name: not selected (BENCH_ONLY=$BENCH_ONLY)"; return 0
  fi
  if (( b < 25 )); then echo "== $name: SKIPPED (${b}s left in the deadline)"; return 0; fi
  local hard=$(( b + 40 )); local l; l=$(left); (( hard > l - 5 )) && hard=$(( l - 5 ))
  (( hard < 10 )) && hard=10
  echo "== $name: budget ${b}s (hard limit ${hard}s) at +$((SECONDS - T0))s"
  local t=$SECONDS
  BENCH_PHASE="$PHASE" timeout -k 10 "$hard" "$@"
  local rc=$?
  LAST_RC=$rc
  echo "== $name: rc=$rc after $((SECONDS - t))s (+$((SECONDS - T0))s)"
  if (( rc == 124 || rc == 137 )); then note "$name" timeout "killed at the ${hard}s hard limit"
  elif (( rc != 0 )); then note "$name" error "exit status $rc (see log.txt)"; fi
  return 0
}

note() {  # note NAME STATUS TEXT: one results line for a step (a script that cannot say it)
  BENCH_PHASE="$PHASE" "$PY" - "$BENCH_RESULTS" "$1" "$2" "$3" <<'PY'
import sys
sys.path.insert(0, "benchmarks/gpu")
import common as C
path, name, status, text = sys.argv[1:5]
C.Recorder(path, "suite", "-", "-", {}).write("step", name.replace(" ", "_"), {"detail": text},
                                             status=status, error=None if status == "ok" else text)
PY
}

kill_leftover_server() {  # a tritonserver group left by a killed bench_triton (we started it)
  if [ -f "$SERVER_PIDFILE" ]; then
    local pid; pid="$(cat "$SERVER_PIDFILE")"
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
      echo "run_all: stopping leftover tritonserver group $pid"
      kill -TERM -- "-$pid" 2>/dev/null; sleep 5; kill -KILL -- "-$pid" 2>/dev/null
    fi
    rm -f "$SERVER_PIDFILE"
  fi
}

PY="$BENCH_PY"
LAST_RC=0
PHASE=""
S="$BENCH_SHAPES"
R=(--out "$BENCH_RESULTS")

phase_check() {
  echo "== environment"
  nvidia-smi -L 2>/dev/null || echo "(no nvidia-smi)"
  "$PY" - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0], sys.executable)
for m in ("torch", "triton", "transformers", "numpy", "xgrammar", "matplotlib"):
    try:
        mod = importlib.import_module(m)
        print(f"  {m:13s} {getattr(mod, '__version__', '?')}")
    except Exception as e:
        print(f"  {m:13s} MISSING ({type(e).__name__}: {e})")
try:
    import torch
    print("  cuda:", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")
except Exception as e:
    print("  cuda check failed", e)
EOF
  PYTHONPATH="$CLIENT_PYTHONPATH" "$PY" -c "import grpc, google.protobuf as pb, tritonclient.grpc.aio; print('  client: grpcio', grpc.__version__, 'protobuf', pb.__version__, 'tritonclient ok')" \
    || echo "  client imports FAILED"
  "$RADIXLM_SERVER_PYTHON" -c "
import numpy, sys
from backend.launcher import find_server_files, check_environment
check_environment(); f = find_server_files()
from transformers import AutoTokenizer  # what the model's initialize needs first
import backend.core
print('  server python', sys.version.split()[0], 'numpy', numpy.__version__, 'stub', f.stub)" \
    || echo "  server environment FAILED"
  if [ -d "${BENCH_TMP:-/tmp}/tritonserver" ]; then
    local libs="${BENCH_TMP:-/tmp}/tritonserver/nvidia_pytriton.libs" ts="${BENCH_TMP:-/tmp}/tritonserver/pytriton/tritonserver"
    LD_LIBRARY_PATH="$libs" ldd "$ts/bin/tritonserver" "$ts/python_backend_stubs/3.12/triton_python_backend_stub" \
      | grep -E "not found|libpython" || true
  fi
  if [ "$QUICK" != 1 ]; then
    step kernels "$(cap "$(share 3 3)" 150)" "$PY" tools/check_kernels_gpu.py
    if (( LAST_RC == 0 )); then note kernels ok "tools/check_kernels_gpu.py passed (tables in log.txt)"; fi
  fi
  step smoke "$(cap "$(share 3 0)" 150)" "$PY" benchmarks/gpu/smoke.py --model "$S/$SMOKE_MODEL" "${DEV[0]}" "${DEV[1]}" "${R[@]}"
}

phase_engine() {
  local weights=() total=0 m w b
  for m in "${MODELS[@]}"; do case "$m" in llama-8b) w=5;; llama-1b) w=4;; *) w=2;; esac; weights+=("$w"); total=$((total + w)); done
  local i=0
  for m in "${MODELS[@]}"; do
    w=${weights[$i]}; total=$((total - w)); i=$((i + 1))
    b=$(share "$w" $((total + 1)))
    step "engine $m" "$b" "$PY" benchmarks/gpu/bench_engine.py \
      --model "$S/$m" ${BENCH_ENGINE_MODES:+--modes "$BENCH_ENGINE_MODES"} \
      "${ENGINE_ARGS[@]}" "${PREFIX_ARGS[@]}" "${DEV[@]}" "${R[@]}" "${DONE[@]}" --budget-s "$b"
  done
  if [ "$QUICK" != 1 ]; then  # the default model: offline and prefix rows only
    b=$(share 1 0)
    step "engine default" "$b" "$PY" benchmarks/gpu/bench_engine.py --model "$S/default" \
      --modes offline,prefix "${ENGINE_ARGS[@]}" "${PREFIX_ARGS[@]}" "${DEV[@]}" "${R[@]}" \
      "${DONE[@]}" --budget-s "$b"
  fi
}

phase_baselines() {
  # (name, weight, command) in priority order; the weights split the deadline
  local -a names=() weights=() cmds=()
  local m
  for m in "${MODELS[@]}"; do
    names+=("cache-off $m"); weights+=(3)
    cmds+=("$PY benchmarks/gpu/bench_engine.py --model $S/$m --no-radix-cache --modes prefix,offline")
    names+=("hf $m"); weights+=(6)
    cmds+=("$PY benchmarks/gpu/bench_hf.py --model $S/$m")
  done
  for m in "${MODELS[@]}"; do
    names+=("overlap-off $m"); weights+=(4)
    cmds+=("$PY benchmarks/gpu/bench_engine.py --model $S/$m --no-overlap --modes offline,hbm,online --online-shapes in32_out128")
  done
  local total=0 w i b
  for w in "${weights[@]}"; do total=$((total + w)); done
  for i in "${!names[@]}"; do
    w=${weights[$i]}; total=$((total - w))
    b=$(share "$w" "$total")
    # shellcheck disable=SC2086
    step "${names[$i]}" "$b" ${cmds[$i]} "${DEV[@]}" "${R[@]}" "${DONE[@]}" --budget-s "$b"
  done
}

phase_triton() {
  local total=0 w m b weights=()
  for m in "${MODELS[@]}"; do case "$m" in llama-8b) w=23;; *) w=20;; esac; weights+=("$w"); total=$((total + w)); done
  local i=0
  for m in "${MODELS[@]}"; do
    w=${weights[$i]}; total=$((total - w)); i=$((i + 1))
    b=$(share "$w" "$total")
    PYTHONPATH="$CLIENT_PYTHONPATH" step "triton $m" "$b" "$PY" benchmarks/gpu/bench_triton.py \
      --model "$S/$m" --modes "${BENCH_TRITON_MODES:-offline,online}" "${TRITON_ARGS[@]}" \
      "${DEV[@]}" "${R[@]}" "${DONE[@]}" --budget-s "$b" \
      --server-python "$RADIXLM_SERVER_PYTHON" --server-log "$BENCH_OUT/server-$m.log" \
      --server-pidfile "$SERVER_PIDFILE"
    kill_leftover_server
  done
}

phase_instances() {  # the triton rows again with N model instances in front of one engine
  local n m b
  for n in ${BENCH_INSTANCES:-2 4}; do
    for m in "${MODELS[@]}"; do
      b=$(share 1 0); b=$(cap "$b" "${BENCH_INSTANCES_BUDGET_S:-$b}")
      PYTHONPATH="$CLIENT_PYTHONPATH" step "instances-$n $m" "$b" "$PY" benchmarks/gpu/bench_triton.py \
        --model "$S/$m" --instances "$n" --modes "${BENCH_TRITON_MODES:-offline,online}" \
        "${DEV[@]}" "${R[@]}" "${DONE[@]}" --budget-s "$b" \
        --server-python "$RADIXLM_SERVER_PYTHON" --server-log "$BENCH_OUT/server-$m-x$n.log" \
        --server-pidfile "$SERVER_PIDFILE"
      kill_leftover_server
    done
  done
}

phase_cache() {  # per model: tiers bench (weight 5), then tier on and off (3 each)
  local m b tier ratio left_after n=${#MODELS[@]} i=0
  for m in "${MODELS[@]}"; do
    i=$((i + 1)); left_after=$((11 * (n - i)))
    b=$(share 5 $((left_after + 6)))
    step "cache-tiers $m" "$b" "$PY" benchmarks/gpu/bench_cache_tiers.py --model "$S/$m" \
      "${DEV[@]}" "${R[@]}" "${DONE[@]}" --budget-s "$b"
    for tier in on off; do
      if [ "$tier" = on ]; then ratio=2; b=$(share 3 $((left_after + 3)))
      else ratio=0; b=$(share 3 "$left_after"); fi
      step "tier-$tier $m" "$b" "$PY" benchmarks/gpu/bench_engine.py --model "$S/$m" \
        --modes prefix,offline --engine-arg "host_cache_ratio=$ratio" --config-name "tier-$tier" \
        "${DEV[@]}" "${R[@]}" "${DONE[@]}" --budget-s "$b"
    done
  done
}

phase_openai() {  # the OpenAI layer's cost against direct gRPC streaming
  local m="${BENCH_OPENAI_MODEL:-llama-8b}" b
  [ "$QUICK" = 1 ] && m=default
  b=$(share 1 0)
  PYTHONPATH="$CLIENT_PYTHONPATH" step "openai $m" "$b" "$PY" benchmarks/gpu/bench_openai_overhead.py \
    --model "$S/$m" "${DEV[@]}" "${R[@]}" --budget-s "$b" \
    --server-python "$RADIXLM_SERVER_PYTHON" --openai-python "$PY" \
    --server-pidfile "$SERVER_PIDFILE"
  kill_leftover_server
}

phase_peer() {
  # --done reads this run's results only: a ratio pairs two rows of one run (one machine
  # instance), so no row is taken over from an earlier run
  local cfgs=(${BENCH_PEER_CONFIGS:-async}) m c b
  local run_done=(--done "$BENCH_RESULTS") prefix=(--prefix-workloads "${BENCH_PREFIX_WORKLOADS:-few-shot}")
  # weights of the deadline: a vLLM start compiles for 1-3 minutes, ours starts in ~20 s
  local wv=9 we=3 wt=4 remaining
  remaining=$(( ${#MODELS[@]} * (${#cfgs[@]} * wv + we + wt) ))
  if [ "$QUICK" != 1 ]; then
    LAST_RC=0
    step "peer-install" "$(cap "$(share 1 1)" 240)" bash benchmarks/gpu/peer.sh install
    if (( LAST_RC != 0 )); then echo "== peer: vLLM is not installed (see above); phase stopped"; return 0; fi
  fi
  local vsite="${VLLM_SITE:-${BENCH_TMP:-/tmp}/vsite}"
  for m in "${MODELS[@]}"; do
    for c in "${cfgs[@]}"; do
      remaining=$((remaining - wv)); b=$(share "$wv" "$remaining")
      PYTHONPATH="$vsite:${PYTHONPATH:-}" step "vllm-$c $m" "$b" "$PY" benchmarks/gpu/vllm_peer.py \
        --model "$S/$m" --config "$c" --modes offline,prefix "${prefix[@]}" \
        "${DEV[@]}" "${R[@]}" "${run_done[@]}" --budget-s "$b"
      [ "$QUICK" = 1 ] || nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null \
        | sed 's/^/== GPU memory in use after the vLLM step: /'
    done
    remaining=$((remaining - we)); b=$(share "$we" "$remaining")
    step "peer-engine $m" "$b" "$PY" benchmarks/gpu/bench_engine.py --model "$S/$m" \
      --modes offline,prefix "${prefix[@]}" "${ENGINE_ARGS[@]}" \
      "${DEV[@]}" "${R[@]}" "${run_done[@]}" --budget-s "$b"
    remaining=$((remaining - wt)); b=$(share "$wt" "$remaining")
    PYTHONPATH="$CLIENT_PYTHONPATH" step "peer-triton $m" "$b" "$PY" benchmarks/gpu/bench_triton.py \
      --model "$S/$m" --modes offline "${TRITON_ARGS[@]}" \
      "${DEV[@]}" "${R[@]}" "${run_done[@]}" --budget-s "$b" \
      --server-python "$RADIXLM_SERVER_PYTHON" --server-log "$BENCH_OUT/server-peer-$m.log" \
      --server-pidfile "$SERVER_PIDFILE"
    kill_leftover_server
  done
}

for PHASE in "$@"; do
  echo "=== phase $PHASE at +$((SECONDS - T0))s ($(left)s left)"
  case "$PHASE" in
    check) phase_check ;;
    engine) phase_engine ;;
    baselines) phase_baselines ;;
    triton) phase_triton ;;
    instances) phase_instances ;;
    cache) phase_cache ;;
    openai) phase_openai ;;
    peer) phase_peer ;;
    report) "${BENCH_REPORT_PY:-$PY}" benchmarks/gpu/report.py ;;
    *) echo "unknown phase $PHASE (check engine baselines triton instances cache openai peer report)" ;;
  esac
done
kill_leftover_server
"$PY" - "$BENCH_RESULTS" "$BENCH_RUN_ID" <<'EOF'
import collections, json, sys
path, run = sys.argv[1], sys.argv[2]
count = collections.Counter()
try:
    for line in open(path):
        rec = json.loads(line)
        if rec.get("run_id") == run:
            count[rec["status"]] += 1
            if rec["status"] != "ok":
                print(f"  {rec['status']:9s} {rec['key']}: {(rec.get('error') or '').splitlines()[0][:150] if rec.get('error') else ''}")
except FileNotFoundError:
    pass
print("run_all: results of this run:", dict(count))
EOF
echo "run_all: finished in $((SECONDS - T0))s"
