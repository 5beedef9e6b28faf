#!/usr/bin/env bash
# The JNI bridge's Java test: builds the cdylib and the `expected` example (the Rust API's
# tokens), compiles the Java API and its test with javac, and runs the test against the built
# library on the tiny model and, when present, the real one (required when
# KVSNAP_REQUIRE_MODEL=1), on each backend of KVSNAP_JNI_BACKENDS (default `reference iree-cpu`,
# plus `iree-vulkan` when IREE opens a Vulkan device, lavapipe included; the tokens of every
# backend are compared with the Rust reference's). KVSNAP_JNI_REAL_VULKAN=0 skips the real model
# on iree-vulkan (about 19 s on lavapipe with the module cached). It also exports three llvm-cpu
# modules for the `moduleDir` checks. Closes with `jni: N passed, N failed`; exits non-zero on a failure.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
WORK="$TARGET/jni-test"
REAL="${KVSNAP_MODEL_DIR:-$ROOT/models/gemma-3-270m}"
# cmake and iree-compile (scripts/setup-iree.sh installs them into .venv).
[[ -d "$ROOT/.venv/bin" ]] && export PATH="$ROOT/.venv/bin:$PATH"

echo "== jni: build the library and the expected-tokens example"
cargo build --release -p kvsnap-jni --lib --example expected
EXPECTED="$TARGET/release/examples/expected"
VULKAN=false
"$EXPECTED" vulkan 2>/dev/null && VULKAN=true
if [[ -n "${KVSNAP_JNI_BACKENDS:-}" ]]; then
    read -r -a BACKENDS <<<"$KVSNAP_JNI_BACKENDS"
elif [[ "$VULKAN" == true ]]; then
    BACKENDS=(reference iree-cpu iree-vulkan)
else
    BACKENDS=(reference iree-cpu)
    echo "(no Vulkan device: iree-vulkan not run)"
fi
echo "backends: ${BACKENDS[*]}"
case "$(uname -s)" in
    Darwin) LIB="$TARGET/release/libkvsnap_jni.dylib" ;;
    *) LIB="$TARGET/release/libkvsnap_jni.so" ;;
esac

rm -rf "$WORK"
mkdir -p "$WORK/classes"

echo "== jni: expected tokens from the Rust API"
# flow arguments: prefix length, turns, utterance length, steps per turn, seed.
"$EXPECTED" tiny "$WORK/tiny"
"$EXPECTED" flow "$WORK/tiny" 40 3 6 5 7 >"$WORK/tiny.expected"

echo "== jni: exported modules for the moduleDir checks (tiny model; another capacity; another window)"
"$EXPECTED" module "$WORK/tiny" "$WORK/module-tiny"
"$EXPECTED" module "$WORK/tiny" "$WORK/module-capacity" 64
"$EXPECTED" module "$WORK/tiny" "$WORK/module-other" other-window
# The first model is where the thread and error checks run: the tiny one on the first backend.
MODELS=(--modules "$WORK/module-tiny" "$WORK/module-capacity" 64 "$WORK/module-other")
for b in "${BACKENDS[@]}"; do
    MODELS+=(--model tiny "$b" "$WORK/tiny" "$WORK/tiny.expected")
done
if [[ -f "$REAL/config.json" && -f "$REAL/model.safetensors" ]]; then
    "$EXPECTED" flow "$REAL" 96 2 12 6 11 >"$WORK/real.expected"
    for b in "${BACKENDS[@]}"; do
        if [[ "$b" == iree-vulkan && "${KVSNAP_JNI_REAL_VULKAN:-1}" == 0 ]]; then
            MODELS+=(--skip "gemma-3-270m (iree-vulkan)" "KVSNAP_JNI_REAL_VULKAN=0")
        else
            MODELS+=(--model gemma-3-270m "$b" "$REAL" "$WORK/real.expected")
        fi
    done
elif [[ "${KVSNAP_REQUIRE_MODEL:-0}" == 1 ]]; then
    echo "test-jni.sh: KVSNAP_REQUIRE_MODEL=1 but there is no model at $REAL (run scripts/setup.sh)" >&2
    exit 1
else
    MODELS+=(--skip gemma-3-270m "no model at $REAL (run scripts/setup.sh; KVSNAP_REQUIRE_MODEL=1 makes this a failure)")
fi

echo "== jni: javac"
javac -Xlint:all -Werror -d "$WORK/classes" jni/java/dev/kvsnap/*.java jni/java/test/dev/kvsnap/*.java

echo "== jni: Java test against $LIB"
# -Xcheck:jni makes the JVM validate every JNI call the bridge makes.
java -Xcheck:jni -Dkvsnap.library.path="$LIB" -Dkvsnap.test.vulkan="$VULKAN" -cp "$WORK/classes" dev.kvsnap.JniTest "${MODELS[@]}"
