#!/usr/bin/env bash
# llama.cpp on this machine, on the same float32 weights and the same catalog scenario as
# `kvsnap bench catalog`: the baseline issue 7 asks kvsnap to beat. Run by hand (not part of the
# test command): the first run builds llama.cpp (about 5 minutes on 2 cores).
#   1. llama.cpp's source from PyPI (the llama-cpp-python sdist vendors it, pinned below), built
#      with cmake: libllama for scripts/llamacpp/turn.cpp, and llama-bench;
#   2. an all-F32 GGUF of the model (scripts/llamacpp/f32_gguf.py: every tensor dequantised as
#      kvsnap's import does);
#   3. the catalog prompt split as the bench splits it (`kvsnap bench workload`);
#   4. turn: prefill the prefix, save the sequence state, then per turn restore it, decode the
#      utterance and 15 greedy steps; writes target/llamacpp/catalog.json;
#   5. llama-bench: prompt processing of the prefix length and 15-token generation.
# Everything goes to target/llamacpp/. LLAMACPP_THREADS sets the threads (default: all cores).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
WORK="$ROOT/target/llamacpp"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
GGUF_IN="$ROOT/models/gemma-3-270m/gemma-3-270m-q4_k_m.gguf"
GGUF_F32="$WORK/gemma-3-270m-f32.gguf"
THREADS="${LLAMACPP_THREADS:-$(nproc)}"

[ -f "$GGUF_IN" ] || { echo "llamacpp-baseline: $GGUF_IN is missing: run scripts/setup.sh first" >&2; exit 1; }
KVSNAP="$ROOT/target/release/kvsnap"
[ -x "$KVSNAP" ] || { echo "llamacpp-baseline: $KVSNAP is missing: run scripts/setup.sh first" >&2; exit 1; }
[ -x "$ROOT/.venv/bin/cmake" ] || { echo "llamacpp-baseline: .venv/bin/cmake is missing: run scripts/setup.sh first" >&2; exit 1; }
export PATH="$ROOT/.venv/bin:$PATH"
mkdir -p "$WORK"

if [ ! -x "$WORK/venv/bin/python" ]; then
    echo "llamacpp-baseline: a venv for the download and the conversion ..."
    python3 -m venv "$WORK/venv"
    "$WORK/venv/bin/pip" install -q numpy==2.4.6 pyyaml==6.0.4 scikit-build-core==1.1.2
fi

if [ ! -d "$SRC" ]; then
    echo "llamacpp-baseline: llama.cpp's source (llama-cpp-python $VERSION sdist) ..."
    # Only the sdist is wanted; its metadata step needs scikit-build-core and cmake, not a build.
    "$WORK/venv/bin/pip" download -q "llama-cpp-python==$VERSION" --no-deps \
        --no-binary llama-cpp-python --no-build-isolation -d "$WORK"
    echo "$SHA256  $WORK/llama_cpp_python-$VERSION.tar.gz" | sha256sum -c --quiet
    tar -xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
fi

if [ ! -x "$SRC/build/bin/llama-bench" ]; then
    echo "llamacpp-baseline: building llama.cpp (native CPU, release) ..."
    cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF >"$WORK/cmake.log" 2>&1
    cmake --build "$SRC/build" -j"$(nproc)" --target llama llama-bench >"$WORK/build.log" 2>&1
fi

echo "llamacpp-baseline: building turn ..."
g++ -O2 -std=c++17 "$ROOT/scripts/llamacpp/turn.cpp" -I"$SRC/include" -I"$SRC/ggml/include" \
    -L"$SRC/build/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$SRC/build/bin" -o "$WORK/turn"

if [ ! -f "$GGUF_F32" ]; then
    echo "llamacpp-baseline: writing the all-F32 GGUF ..."
    PYTHONPATH="$SRC/gguf-py" "$WORK/venv/bin/python" "$ROOT/scripts/llamacpp/f32_gguf.py" \
        "$GGUF_IN" "$GGUF_F32.partial"
    mv "$GGUF_F32.partial" "$GGUF_F32"
fi

"$KVSNAP" bench workload --ids-out "$WORK"
PREFIX_TOKENS="$(wc -l <"$WORK/prefix.ids")"

echo
echo "== llama.cpp: the catalog scenario ($THREADS threads)"
"$WORK/turn" "$GGUF_F32" "$WORK" "$WORK/catalog.json" 20 15 "$THREADS" 2>"$WORK/turn.log"
echo "(JSON: $WORK/catalog.json)"

echo
echo "== llama-bench: prompt processing of $PREFIX_TOKENS tokens, 15-token generation"
"$SRC/build/bin/llama-bench" -m "$GGUF_F32" -p "$PREFIX_TOKENS" -n 15 -t "$THREADS" -r 3 \
    -b 1024 -ub 1024 2>/dev/null
