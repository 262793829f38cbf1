# Set-up on the GPU machine, first thing in every device call:  source benchmarks/gpu/setup.sh
# (run_all.sh sources it). Idempotent: a second call in the same machine only re-exports.
#
# From the carried .whl/ (made by fetch_wheels.sh here):
#   /tmp/site         xgrammar 0.2.9 + deps (engine processes: PYTHONPATH)
#   /tmp/client       tritonclient[grpc] 2.73.0, grpcio, protobuf 6.x (the gRPC client only)
#   /tmp/tritonserver pytriton/tritonserver/... + nvidia_pytriton.libs (tritonserver 2.51)
#   /tmp/v            venv overlay for the Python backend stub : made with the
#                     base python3.12 of /opt/torch/.venv, --without-pip; numpy 1.26.4 in its
#                     site-packages, and a .pth adding the repo, /tmp/site, /tmp/tritonserver
#                     and /opt/torch/.venv's site-packages (torch, transformers)
#   /tmp/shapes       llama-1b, llama-8b, qwen3-8b, gemma3-1b, phi3-mini, default, tiny-llama (shapes.py)
# BENCH_TMP moves /tmp/* elsewhere (a dry run on a shared machine).
# Exports: BENCH_ROOT BENCH_PY PYTHONPATH CLIENT_PYTHONPATH RADIXLM_SERVER_PYTHON
#          BENCH_SHAPES BENCH_OUT BENCH_RESULTS BENCH_LOG TVM_FFI_DISABLE_TORCH_C_DLPACK
# Elsewhere (no /opt/torch/.venv, e.g. a CPU dry run here) it only exports, with the repo's
# .venv as BENCH_PY and RADIXLM_SERVER_PYTHON, and writes /tmp/shapes.

_radixlm_bench_setup() {
  local t0=$SECONDS
  local root; root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
  export BENCH_ROOT="$root"
  local w="$root/.whl"
  export TVM_FFI_DISABLE_TORCH_C_DLPACK=1  # tvm-ffi (xgrammar) would JIT a torch addon at import
  export PYTHONUNBUFFERED=1
  local tmp="${BENCH_TMP:-/tmp}"  # where the unpacked pieces go (a dry run elsewhere may move it)
  export BENCH_SHAPES="$tmp/shapes"
  if [ -z "${BENCH_PY:-}" ]; then
    if [ -x /opt/torch/.venv/bin/python3 ]; then BENCH_PY=/opt/torch/.venv/bin/python3
    elif [ -x "$root/.venv/bin/python" ]; then BENCH_PY="$root/.venv/bin/python"
    else BENCH_PY="$(command -v python3)"; fi
  fi
  export BENCH_PY
  local pyver; pyver="$("$BENCH_PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"

  # results: $OUT on the device machine (the tool brings it back), else benchmarks/gpu/results
  if [ -n "${OUT:-}" ]; then export BENCH_OUT="$OUT"
  else export BENCH_OUT="${BENCH_OUT:-$root/benchmarks/gpu/results/local}"; fi
  mkdir -p "$BENCH_OUT"
  export BENCH_RESULTS="$BENCH_OUT/results.jsonl" BENCH_LOG="$BENCH_OUT/log.txt"

  _untar() {  # _untar ARCHIVE DEST_PARENT NAME: extract unless this archive is already there
    local archive="$1" parent="$2" name="$3"
    [ -f "$archive" ] || { echo "setup: missing $archive (run fetch_wheels.sh here, carry .whl)"; return 1; }
    local stamp; stamp="$(stat -c '%s %Y' "$archive")"
    if [ "$(cat "$parent/$name/.radixlm_stamp" 2>/dev/null)" != "$stamp" ]; then
      rm -rf "${parent:?}/$name.tmp" && mkdir -p "$parent/$name.tmp"
      tar -xJf "$archive" -C "$parent/$name.tmp" || return 1
      rm -rf "${parent:?}/$name"
      # archives hold one top folder named like the group (site/, client/, stub/) or, for
      # the server, pytriton/ + nvidia_pytriton.libs/
      if [ -d "$parent/$name.tmp/$name" ]; then mv "$parent/$name.tmp/$name" "$parent/$name"; rm -rf "$parent/$name.tmp"
      else mv "$parent/$name.tmp" "$parent/$name"; fi
      echo "$stamp" > "$parent/$name/.radixlm_stamp"
      echo "setup: unpacked $(basename "$archive") -> $parent/$name"
    fi
  }

  if [ "$pyver" = "3.12" ] && [ -d "$w" ]; then
    mkdir -p "$tmp"
    _untar "$w/site.tar.xz" "$tmp" site || return 1
    _untar "$w/client.tar.xz" "$tmp" client || return 1
    _untar "$w/stub.tar.xz" "$tmp" stub || return 1
    _untar "$w/tritonserver.tar.xz" "$tmp" tritonserver || return 1
    export PYTHONPATH="$tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    export CLIENT_PYTHONPATH="$tmp/client:$tmp/site"  # grpcio needs typing_extensions (in site)
    # the stub's venv overlay: /usr/bin/python3.12 (the stub loads the
    # system libpython3.12, whose stdlib must match), else the base of BENCH_PY's venv
    local base home purelib sp="$tmp/v/lib/python3.12/site-packages"
    base=/usr/bin/python3.12
    if [ ! -x "$base" ]; then
      home="$(sed -n 's/^home *= *//p' "$(dirname "$(dirname "$BENCH_PY")")/pyvenv.cfg" 2>/dev/null)"
      base="${home:+$home/python3.12}"
      [ -x "$base" ] || base="$BENCH_PY"
    fi
    if [ ! -x "$tmp/v/bin/python3" ]; then
      "$base" -m venv --without-pip "$tmp/v" || { echo "setup: venv with $base failed"; return 1; }
    fi
    if [ ! -d "$sp/numpy" ] || [ "$(cat "$sp/.radixlm_stamp" 2>/dev/null)" != "$(cat "$tmp/stub/.radixlm_stamp")" ]; then
      rm -rf "$sp/numpy" "$sp"/numpy-*.dist-info "$sp/numpy.libs"
      cp -a "$tmp"/stub/numpy "$tmp"/stub/numpy-*.dist-info "$tmp"/stub/numpy.libs "$sp/"
      cp "$tmp/stub/.radixlm_stamp" "$sp/.radixlm_stamp"
    fi
    # The GPU image's scipy and scikit-learn are built for numpy 2; under the stub's
    # numpy 1.26 transformers' import of them fails and takes AutoTokenizer down with it
    # (seen 2026-11-30). A None entry in sys.modules makes find_spec report them absent,
    # so transformers never imports them. A .pth "import" line, not sitecustomize.py: the
    # system Python's own sitecustomize (Debian/Ubuntu) comes first on sys.path.
    rm -f "$sp/sitecustomize.py"
    printf 'import sys; sys.modules.setdefault("scipy", None); sys.modules.setdefault("sklearn", None)\n' \
      > "$sp/radixlm_hide_numpy2_builds.pth"
    purelib="$("$BENCH_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    printf '%s\n' "$root" "$tmp/site" "$tmp/tritonserver" "$purelib" > "$sp/radixlm_bench.pth"
    export RADIXLM_SERVER_PYTHON="$tmp/v/bin/python3"
  else
    echo "setup: $BENCH_PY is Python $pyver, not the GPU machine's 3.12: using its own packages"
    export CLIENT_PYTHONPATH="${PYTHONPATH:-}"
    export RADIXLM_SERVER_PYTHON="${RADIXLM_SERVER_PYTHON:-$BENCH_PY}"
  fi

  # model folders (tokenizer from the carried .whl/tok, else models/default)
  local tok="$w/tok"
  [ -f "$tok/tokenizer.json.xz" ] || [ -f "$tok/tokenizer.json" ] || tok="$root/models/default"
  if [ ! -f "$BENCH_SHAPES/phi3-mini/config.json" ] || [ ! -f "$BENCH_SHAPES/default/tokenizer.json" ]; then
    "$BENCH_PY" "$root/benchmarks/gpu/shapes.py" --tokenizer-from "$tok" --out "$BENCH_SHAPES" || return 1
  fi
  echo "setup: done in $((SECONDS - t0))s (BENCH_PY=$BENCH_PY, server python=$RADIXLM_SERVER_PYTHON, results -> $BENCH_RESULTS)"
}
_radixlm_bench_setup || { echo "setup: FAILED"; false; }
