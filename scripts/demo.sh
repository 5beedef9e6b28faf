#!/usr/bin/env bash
# The main job: set up (idempotent: installs, builds, fetches the real Gemma 3 270M if needed),
# then
#   1. `kvsnap call`: tool calls against the example TV catalog, served from a cached prefix
#      snapshot, with per-turn latency next to the stateless cost it avoided;
#   2. `kvsnap demo`: the oracle's catalog prompt served from a prefix snapshot, every produced
#      position checked against the oracle goldens.
# KVSNAP_BACKEND picks the backend (reference, iree-cpu, iree-vulkan; default reference).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
BACKEND="${KVSNAP_BACKEND:-reference}"

echo
echo "== kvsnap call: tool calls against examples/tv-catalog.json ($BACKEND)"
"$KVSNAP" call --model models/gemma-3-270m --backend "$BACKEND" --catalog examples/tv-catalog.json \
    "set the volume to 20" \
    "switch to channel 7" \
    "record the news on Arte tomorrow at 20:15 every week"

echo
echo "== kvsnap demo: the oracle's catalog prompt from a prefix snapshot, checked against the goldens"
"$KVSNAP" demo --model models/gemma-3-270m --backend "$BACKEND" \
    --goldens goldens/gemma-3-270m.visible.json --turns 3
