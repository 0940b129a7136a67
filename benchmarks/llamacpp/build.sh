#!/usr/bin/env bash
# Build llama.cpp's llama-bench, llama-batched-bench, llama-completion and libllama from the llama.cpp that the
# llama-cpp-python sdist vendors (vendor/llama.cpp: it has the DeepSeek-V4 graph,
# src/models/deepseek4.cpp, and its converter). Built outside the repository.
#
#   benchmarks/llamacpp/build.sh [WORK_DIR]      (default: $LLAMA_BUILD or /work/llama_build)
#
# Env: LLAMA_CPP_PYTHON_VERSION (0.3.36), SDIST (a downloaded sdist, else pip fetches it),
# JOBS (make -j, default 2). Prints the llama.cpp source dir and the bin dir on its last two lines.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
WORK="${1:-${LLAMA_BUILD:-/work/llama_build}}"
JOBS="${JOBS:-2}"
mkdir -p "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  SDIST="${SDIST:-}"
  if [ -z "$SDIST" ]; then
    python -m pip download "llama-cpp-python==$VERSION" --no-deps --no-binary :all: -d "$WORK/sdist" >&2
    SDIST="$(ls "$WORK"/sdist/llama_cpp_python-"$VERSION".tar.gz)"
  fi
  tar xzf "$SDIST" -C "$WORK"
fi
BUILD="$WORK/build-$VERSION"
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF >&2
# llama-cli needs the server build (LLAMA_BUILD_SERVER); llama-completion is the plain CLI. The
# shared libllama (BUILD_SHARED_LIBS, the default) is what the sdist's ctypes bindings load.
cmake --build "$BUILD" --config Release -j "$JOBS" \
  --target llama-bench llama-batched-bench llama-completion llama >&2
echo "$SRC"
echo "$BUILD/bin"
