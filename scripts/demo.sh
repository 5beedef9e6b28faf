#!/usr/bin/env bash
# The main job: set up (idempotent), fetch the real Gemma 3 270M if needed, then serve the
# catalog scenario from a prefix snapshot and check it against the oracle goldens.
# Extra arguments go to `kvsnap demo` (e.g. --turns 5).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
"$KVSNAP" demo --model models/gemma-3-270m --goldens goldens/gemma-3-270m.visible.json "$@"
