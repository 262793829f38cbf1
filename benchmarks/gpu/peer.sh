#!/usr/bin/env bash
# vLLM 0.26.0 on the GPU machine, the peer the suite measures beside us (vllm_peer.py and
# run_all.sh's `peer` phase):   bash benchmarks/gpu/peer.sh ACTION [ACTION ...]
#
#   take     move the pieces of every carried .vllm-peer/cK/ into $VLLM_PIECES (/tmp/vl)
#   install  join the pieces and install vLLM and its missing dependencies into $VLLM_SITE
#            (/tmp/vsite), nothing else on the machine changes; idempotent (a stamp names
#            the pieces installed); fails, saying which piece is missing, when one has not
#            arrived
#   check    import vllm from $VLLM_SITE and print its version
#
# The pieces (the wheel in parts, then a tar of the dependency wheels, ~45 MiB each) are
# made here by ../shared/peer/vllm/fetch.sh .vllm-peer; a device call carries at most
# 64 MiB, so each call carries one folder (carry: [".vllm-peer/cK"]) and runs `peer.sh take`,
# back to back (the machine's /tmp lasts only while it stays warm); the call with the last
# piece runs `peer.sh take install`. Then: PYTHONPATH=$VLLM_SITE:$PYTHONPATH python ...
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PIECES="${VLLM_PIECES:-${BENCH_TMP:-/tmp}/vl}"
SITE="${VLLM_SITE:-${BENCH_TMP:-/tmp}/vsite}"
WHEEL=vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
STAMP="$SITE/.radixlm_vllm_stamp"

python_312() {  # the GPU machine's Python (pip picks wheels by the running interpreter)
  if [ -n "${VLLM_INSTALL_PY:-}" ]; then echo "$VLLM_INSTALL_PY"; return 0; fi  # a dry run elsewhere
  local p
  for p in "${BENCH_PY:-}" /opt/torch/.venv/bin/python3 python3; do
    [ -n "$p" ] && command -v "$p" >/dev/null 2>&1 || continue
    if "$p" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then echo "$p"; return 0; fi
  done
  echo "peer: no Python 3.12 found (BENCH_PY, /opt/torch/.venv/bin/python3, python3)" >&2
  return 1
}

take() {
  mkdir -p "$PIECES"
  local d n=0
  for d in "$ROOT"/.vllm-peer/c*/; do
    [ -d "$d" ] || continue
    if compgen -G "$d*" >/dev/null; then
      echo "peer: taking $(cd "$d" && ls | tr '\n' ' ')from $d"; mv "$d"* "$PIECES/"; n=$((n + 1))
    fi
  done
  (( n > 0 )) || echo "peer: no carried .vllm-peer/cK/ with pieces in it"
  echo "peer: $PIECES holds: $(ls "$PIECES" 2>/dev/null | tr '\n' ' ')"
}

parts_in_order() {  # parts_in_order PREFIX: the files PREFIX00, PREFIX01, ... with no gap
  local prefix="$1" i=0 f out=()
  while f="$(printf '%s%02d' "$prefix" "$i")"; [ -f "$f" ]; do out+=("$f"); i=$((i + 1)); done
  local all; all=$(compgen -G "${prefix}*" | wc -l)
  if (( ${#out[@]} == 0 )); then echo "peer: missing ${prefix}00" >&2; return 1; fi
  if (( all != ${#out[@]} )); then
    echo "peer: a gap among $(basename "$prefix")*: have $(cd "$(dirname "$prefix")" && ls "$(basename "$prefix")"* | tr '\n' ' ')" >&2
    return 1
  fi
  printf '%s\n' "${out[@]}"
}

pieces_listing() {  # the pieces with their sizes: the stamp of what is installed
  (cd "$PIECES" && stat -c '%n %s' vllm.whl.part* deps.tar* 2>/dev/null | sort)
}

missing_help() {
  echo "peer: carry .vllm-peer/c1 ... cN one per call with 'bash benchmarks/gpu/peer.sh take'," \
       "back to back on one warm machine; then 'peer.sh install'" >&2
}

install() {
  local py; py="$(python_312)"
  if [ -f "$STAMP" ] && PYTHONPATH="$SITE" "$py" -c 'import vllm' 2>/dev/null; then
    if [ ! -e "$PIECES/vllm.whl.part00" ] || [ "$(pieces_listing)" = "$(sed 1d "$STAMP")" ]; then
      echo "peer: vLLM already installed in $SITE ($(head -1 "$STAMP"))"; return 0
    fi
  fi
  local t0=$SECONDS wparts dparts
  wparts="$(parts_in_order "$PIECES/vllm.whl.part")" || { missing_help; return 1; }
  if [ -f "$PIECES/deps.tar" ]; then dparts=""
  else dparts="$(parts_in_order "$PIECES/deps.tar.part")" || { missing_help; return 1; }; fi
  local listing; listing="$(pieces_listing)"
  # shellcheck disable=SC2086
  cat $wparts > "$PIECES/$WHEEL"
  if ! "$py" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).namelist()' "$PIECES/$WHEEL" 2>/dev/null; then
    echo "peer: the joined wheel is cut short (the last vllm.whl.part is missing?): have" \
         "$(cd "$PIECES" && ls vllm.whl.part* | tr '\n' ' ')" >&2
    rm -f "$PIECES/$WHEEL"; missing_help; return 1
  fi
  # shellcheck disable=SC2086
  [ -z "$dparts" ] || cat $dparts > "$PIECES/deps.tar"
  rm -rf "$PIECES/deps"
  if ! tar -xf "$PIECES/deps.tar" -C "$PIECES" 2>/dev/null || ! compgen -G "$PIECES/deps/*.whl" >/dev/null \
     || ! "$py" -c 'import sys, zipfile; [zipfile.ZipFile(w).namelist() for w in sys.argv[1:]]' "$PIECES"/deps/*.whl 2>/dev/null; then
    echo "peer: deps.tar is cut short (the last deps.tar.part is missing?)" >&2; missing_help; return 1
  fi
  rm -rf "$SITE" && mkdir -p "$SITE"
  if "$py" -m pip --version >/dev/null 2>&1; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
      "$PIECES/$WHEEL" "$PIECES"/deps/*.whl
  else  # no pip in this Python: a wheel is a zip whose top level is the install
    echo "peer: $py has no pip; unpacking the wheels"
    "$py" - "$SITE" "$PIECES/$WHEEL" "$PIECES"/deps/*.whl <<'PY'
import pathlib, shutil, sys, zipfile
site = pathlib.Path(sys.argv[1])
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(site)
for data in site.glob("*.data"):  # purelib/platlib parts of a wheel belong at the top
    for kind in ("purelib", "platlib"):
        if (data / kind).is_dir():
            shutil.copytree(data / kind, site, dirs_exist_ok=True)
    shutil.rmtree(data)
PY
  fi
  local version
  # the entry points the benchmark uses: they import most of vLLM's dependencies
  version="$(PYTHONPATH="$SITE" "$py" -c 'import vllm; from vllm import LLM, SamplingParams; print(vllm.__version__)')" || {
    echo "peer: installed, but importing vllm.LLM fails under $py (a dependency missing? see above)" >&2; return 1; }
  printf 'vllm %s\n%s\n' "$version" "$listing" > "$STAMP"
  # the joined files go (disk); the pieces stay: the stamp lists them
  rm -f "$PIECES/$WHEEL"; rm -rf "$PIECES/deps"; [ -z "$dparts" ] || rm -f "$PIECES/deps.tar"
  echo "peer: vLLM $version installed in $SITE in $((SECONDS - t0))s"
}

check() {
  local py; py="$(python_312)"
  PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$py" -c 'import vllm; from vllm import LLM; print("peer: vllm", vllm.__version__, "from", vllm.__file__)'
}

[ $# -ge 1 ] || { sed -n '2,16p' "$0"; exit 2; }
for action in "$@"; do
  case "$action" in
    take) take ;;
    install) install ;;
    check) check ;;
    *) echo "peer: unknown action $action (take install check)" >&2; exit 2 ;;
  esac
done
