#!/usr/bin/env bash
# The whole test suite: set up (idempotent, includes the real model), lint, run every test in
# release with the real model required, then the golden parity runs through the CLI.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The run needs about 3.5 GB of disk (target/ 0.9, .venv/ 0.9, models/ 1.3, downloads): say
# up front how much there is, so that a run that fills the disk reads as what it is.
df -Pm "$ROOT" | awk 'NR == 2 {
    print "test.sh: " $4 " MB of disk free under " $6
    if ($4 < 4096) print "test.sh: warning: the run needs about 3.5 GB (more where the cargo" \
        " registry and pip cache start empty): expect \"No space left on device\""
}'
# Each step says how long the run has taken so far, so a slow step shows in the log.
section() { echo "== $1 ($((SECONDS / 60)) min $((SECONDS % 60)) s in)"; }
source "$ROOT/scripts/setup.sh"
cd "$ROOT"

section "format and lints"
cargo fmt --all -- --check
# The reliability rows also run on iree-vulkan (lavapipe here): about 3 minutes more.
FEATURES=kvsnap-reliability/iree-vulkan
cargo clippy --release --workspace --all-targets --features "$FEATURES" -- -D warnings
# Public items are documented and every intra-doc link resolves.
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --workspace --release

section "cargo test (release, real model required)"
export KVSNAP_REQUIRE_MODEL=1
export KVSNAP_MODEL_DIR="$ROOT/models/gemma-3-270m"
cargo test --release --workspace --no-fail-fast --features "$FEATURES"

section "parity: tiny model goldens, every backend (iree-vulkan on lavapipe)"
TINY="$ROOT/target/kvsnap-tiny"
"$KVSNAP" tiny-model --out "$TINY"
for backend in reference iree-cpu iree-vulkan; do
    "$KVSNAP" parity --model "$TINY" --goldens goldens/tiny.json --backend "$backend"
done

section "parity: real model, visible oracle goldens"
REAL_GOLDENS=goldens/gemma-3-270m.visible.json
"$KVSNAP" parity --model models/gemma-3-270m --goldens "$REAL_GOLDENS" --backend reference
"$KVSNAP" parity --model models/gemma-3-270m --goldens "$REAL_GOLDENS" --backend iree-cpu
# On an AVX-512 host the run above links kvsnap's panel-product kernel into the module; this one
# runs IREE's own code for every product, as hosts without AVX-512 do (a second compile, about
# a minute on 2 cores).
KVSNAP_OWN_KERNELS=0 "$KVSNAP" parity --model models/gemma-3-270m --goldens "$REAL_GOLDENS" \
    --backend iree-cpu
# lavapipe is 10-40x slower than llvm-cpu: CI runs the stated subset `short` + `catalog_tv` (882
# tokens: the incremental run's extends and steps wrap the 512-key window), incremental runs only:
# the one-shot runs took as long again (7 of a 63-minute run on a 2-core Zen 3), and a one-shot
# prefill across a window runs above on the tiny model's 6-token one. The full set's run is in
# docs/BENCHMARKS.md.
"$KVSNAP" parity --model models/gemma-3-270m --goldens "$REAL_GOLDENS" --backend iree-vulkan \
    --cases short,catalog_tv --runs incremental

section "the reference's portable kernels (what ARM CPUs run: no AVX-512 or AVX2)"
# The x86 kernels kept off by KVSNAP_PORTABLE_KERNELS: the reference's tests and its real
# goldens through the kernels no run above reaches on an x86 machine (about 40 s).
KVSNAP_PORTABLE_KERNELS=1 cargo test --release -p kvsnap-reference
KVSNAP_PORTABLE_KERNELS=1 "$KVSNAP" parity --model models/gemma-3-270m --goldens "$REAL_GOLDENS" \
    --backend reference
section "JNI: the reference-only library (no IREE feature), its lints and Rust tests"
cargo clippy --release -p kvsnap-jni --no-default-features --all-targets -- -D warnings
cargo test --release -p kvsnap-jni --no-default-features

section "JNI: the Java API and test against the built cdylib"
bash scripts/test-jni.sh

section "the scripts' Python helpers (standard library only)"
(cd scripts && python3 -W error -m unittest test_profile_dispatches)
echo "test.sh: all passed in $((SECONDS / 60)) min $((SECONDS % 60)) s"
