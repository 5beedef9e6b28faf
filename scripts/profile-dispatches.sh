#!/usr/bin/env bash
# Per-dispatch device times of one entry point of an exported kvsnap module, by the IREE 3.13
# runtime tools from PyPI (iree-benchmark-module and iree-profile: not needed by kvsnap itself).
# Run by hand, like scripts/llamacpp-baseline.sh; docs/IREE.md says what it found.
#
#   scripts/profile-dispatches.sh MODULE_DIR ENTRY [POS0] [VALID] [CALLS] [TOP]
#
#   MODULE_DIR  a `kvsnap export` directory (its .vmfb, and its .mlir for the signature)
#   ENTRY       an entry point: chunk_emb_c1 (Vulkan's decode step), chunk_ids_c1_s1024, ...
#   POS0 VALID  the call's first row and its valid rows (default 860 1: a step after the
#               catalog prefix)
#   CALLS TOP   calls timed (default 10) and executables listed (default 15)
#
# The device follows the module: `vulkan` (device 0; lavapipe without a GPU) for vulkan-spirv,
# `local-task` for llvm-cpu. The tools come from `pip install iree-base-runtime==3.13.0` into
# target/iree-runtime-venv, or from $IREE_TOOLS (a directory holding iree-benchmark-module and
# iree-profile, for a machine without PyPI). Inputs are constants (scripts/profile_dispatches.py);
# the large ones are written once as .npy files under target/profile-inputs (about 1.1 GB for
# the real model). Prints the tool's wall time per call, then the dispatches' device times.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ $# -ge 2 ] || { sed -n '2,19p' "$0" >&2; exit 2; }
DIR="$1" ENTRY="$2" POS0="${3:-860}" VALID="${4:-1}" CALLS="${5:-10}" TOP="${6:-15}"
VERSION=3.13.0

shopt -s nullglob
vmfbs=("$DIR"/kvsnap.*.vmfb)
[ "${#vmfbs[@]}" -eq 1 ] || { echo "profile-dispatches: $DIR holds ${#vmfbs[@]} kvsnap.*.vmfb, expected one (a \`kvsnap export\` directory)" >&2; exit 1; }
VMFB="${vmfbs[0]}"
MLIR="${VMFB%.vmfb}.mlir"
[ -f "$MLIR" ] || { echo "profile-dispatches: $MLIR is missing (the export writes it beside the vmfb)" >&2; exit 1; }
case "$VMFB" in
    *.vulkan-spirv.vmfb) DEVICE=vulkan MODE=dispatch-events ;;
    *.llvm-cpu.vmfb) DEVICE=local-task MODE=host-execution ;;
    *) echo "profile-dispatches: unknown target of $VMFB" >&2; exit 1 ;;
esac

if [ -n "${IREE_TOOLS:-}" ]; then
    TOOLS="$IREE_TOOLS"
else
    VENV="$ROOT/target/iree-runtime-venv"
    if [ ! -x "$VENV/bin/iree-profile" ]; then
        echo "profile-dispatches: installing iree-base-runtime==$VERSION into $VENV"
        python3 -m venv "$VENV"
        "$VENV/bin/pip" install -q "iree-base-runtime==$VERSION"
    fi
    TOOLS="$VENV/bin"
fi
for tool in iree-benchmark-module iree-profile; do
    [ -x "$TOOLS/$tool" ] || { echo "profile-dispatches: $TOOLS/$tool not found" >&2; exit 1; }
done

NPY="$ROOT/target/profile-inputs"
mkdir -p "$NPY"
# (Assigned first: `set -e` stops at a failed substitution there, not inside a here-string.)
ARGS="$(python3 "$ROOT/scripts/profile_dispatches.py" inputs "$MLIR" "$ENTRY" "$POS0" "$VALID" "$NPY")"
read -r -a INPUTS <<< "$ARGS"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

echo "profile-dispatches: $ENTRY of $VMFB on $DEVICE, pos0 $POS0, valid $VALID, $CALLS calls"
"$TOOLS/iree-benchmark-module" --module="$VMFB" --device="$DEVICE" --function="$ENTRY" \
    "${INPUTS[@]}" --benchmark_min_time="${CALLS}x" \
    --device_profiling_mode="$MODE" --device_profiling_output="$OUT/p.ireeprof" 2>&1 \
    | grep -E "real_time|rror" || true
[ -s "$OUT/p.ireeprof" ] || { echo "profile-dispatches: the benchmark wrote no profile" >&2; exit 1; }
"$TOOLS/iree-profile" dispatch --format=jsonl "$OUT/p.ireeprof" > "$OUT/dispatch.jsonl"
python3 "$ROOT/scripts/profile_dispatches.py" summary "$OUT/dispatch.jsonl" "$CALLS" "$TOP"
