#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (CPU, native, no curl) from the sources vendored in the
# llama-cpp-python sdist on PyPI, into .llamacpp/. Skips the work when the binary already runs.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PY="${PY:-.venv/bin/python}"
ROOT="${LLAMACPP_DIR:-.llamacpp}"
JOBS="${JOBS:-2}"
BIN="$ROOT/bin/llama-server"

if [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; then
    echo "llama-server already built: $BIN"
    "$BIN" --version 2>&1 | tail -n 2
    exit 0
fi

mkdir -p "$ROOT/download" "$ROOT/bin"
SDIST="$ROOT/download/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
    "$PY" -m pip download --quiet --no-binary :all: --no-deps --dest "$ROOT/download" \
        "llama-cpp-python==$VERSION"
fi
SRC="$ROOT/src/llama_cpp_python-$VERSION"
if [ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]; then
    rm -rf "$ROOT/src" && mkdir -p "$ROOT/src"
    tar -xzf "$SDIST" -C "$ROOT/src"
fi

BUILD="$ROOT/build"
nice cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
nice cmake --build "$BUILD" --config Release --target llama-server -j "$JOBS"
cp "$BUILD/bin/llama-server" "$BIN"
"$BIN" --version 2>&1 | tail -n 2
