#!/usr/bin/env bash
# Builds llama.cpp's `llama-server`, the peer in the side-by-side CPU benchmarks (issues 14, 25), and its
# `llama-quantize` (issue 25's model ladder), from the llama.cpp sources vendored in the llama-cpp-python
# sdist: the package index is the only network we use. The sources stay in CACHE_DIR/src, so its
# `convert_hf_to_gguf.py` (with `gguf-py/` on PYTHONPATH) is the converter that goes with these binaries.
# Idempotent: existing binaries are reused. Prints llama-server's path as the last line of stdout;
# llama-quantize lies beside it.
#
# Usage: scripts/build_llama_server.sh [CACHE_DIR]
#   CACHE_DIR: default envs.PAGEDSERVE_LLAMA_CPP_DIR (common/envs.py reads that variable and its default)
#   $PYTHON: the interpreter whose pip downloads the sdist (default: .venv/bin/python, else python3)
#   $LLAMA_CPP_PYTHON_VERSION: pin the sdist version (default: the newest on the index)
#   $JOBS: parallel compile jobs (default 2)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
JOBS="${JOBS:-2}"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
CACHE="${1:-$("$PYTHON" -c 'from pagedserve.common import envs; print(envs.PAGEDSERVE_LLAMA_CPP_DIR)')}"
BIN="$CACHE/build/bin/llama-server"
QUANTIZE="$CACHE/build/bin/llama-quantize"
if [ -x "$BIN" ] && [ -x "$QUANTIZE" ]; then
  echo "$BIN"
  exit 0
fi
log() { echo "build_llama_server: $*" >&2; }
trap 'log "failed (line $LINENO, exit $?)"' ERR

for tool in gcc g++ make; do
  command -v "$tool" >/dev/null 2>&1 || { log "missing $tool (apt-get install build-essential)"; exit 1; }
done
CMAKE="$(command -v cmake || true)"
if [ -z "$CMAKE" ]; then
  log "cmake not found; installing it into $PYTHON's environment"
  "$PYTHON" -m pip install --quiet --disable-pip-version-check cmake
  CMAKE="$(dirname "$PYTHON")/cmake"
  [ -x "$CMAKE" ] || { log "pip installed cmake but $CMAKE is missing"; exit 1; }
fi

mkdir -p "$CACHE"
SRC="$CACHE/src"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  DL="$CACHE/sdist"
  mkdir -p "$DL"
  shopt -s nullglob
  TARBALLS=("$DL"/llama_cpp_python-*.tar.gz "$DL"/llama-cpp-python-*.tar.gz)
  if [ ${#TARBALLS[@]} -eq 0 ]; then
    SPEC="llama-cpp-python${LLAMA_CPP_PYTHON_VERSION:+==$LLAMA_CPP_PYTHON_VERSION}"
    log "downloading the $SPEC sdist"
    "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: -d "$DL" "$SPEC"
    TARBALLS=("$DL"/llama_cpp_python-*.tar.gz "$DL"/llama-cpp-python-*.tar.gz)
  fi
  [ ${#TARBALLS[@]} -gt 0 ] || { log "no sdist tarball in $DL"; exit 1; }
  TARBALL="${TARBALLS[0]}"
  tar -xzf "$TARBALL" -C "$DL"
  VENDORS=("$DL"/*/vendor/llama.cpp)
  shopt -u nullglob
  VENDOR="${VENDORS[0]:-}"
  [ -n "$VENDOR" ] && [ -f "$VENDOR/CMakeLists.txt" ] || { log "no vendored llama.cpp in $TARBALL"; exit 1; }
  rm -rf "$SRC" && mv "$VENDOR" "$SRC"
  basename "$TARBALL" > "$SRC/.from_sdist"
  rm -rf "$DL"
fi

log "configuring in $CACHE/build (sources from $(cat "$SRC/.from_sdist" 2>/dev/null || echo unknown))"
# Static libraries make one self-contained binary; tests, examples and other tools are skipped so only
# what llama-server and llama-quantize link gets compiled.
# Without AMX: on a CPU with it (Sapphire Rapids), -march=native compiles ggml's AMX backend, and this
# llama.cpp's (llama-cpp-python 0.3.36's) segfaults in ggml_backend_amx_mul_mat on its first graph, any model,
# any -np (gdb backtrace in docs/cpu_performance.md, 2026-11-28 midday); --no-repack avoids it but also drops
# the AVX512 Q4_0 repack, a far slower peer. An explicit -mno-* wins over -march=native in any order.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
"$CMAKE" -S "$SRC" -B "$CACHE/build" \
  -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON \
  -DCMAKE_C_FLAGS="$NO_AMX" \
  -DCMAKE_CXX_FLAGS="$NO_AMX" \
  -DLLAMA_CURL=OFF \
  -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON \
  -DGGML_BUILD_TESTS=OFF \
  -DGGML_BUILD_EXAMPLES=OFF >&2
log "compiling llama-server and llama-quantize with $JOBS jobs (about 9 minutes on 2 cores)"
"$CMAKE" --build "$CACHE/build" --target llama-server llama-quantize -j "$JOBS" >&2
for built in "$BIN" "$QUANTIZE"; do
  [ -x "$built" ] || { log "build finished but $built is missing"; exit 1; }
done
echo "$BIN"
