#!/usr/bin/env bash
# Installs what the IREE backend needs to build and run, idempotently:
#   - apt: libclang-dev (bindgen for eerie-sys), gcc/g++ (the IREE runtime's C build),
#          mesa-vulkan-drivers + libvulkan1 (lavapipe: Vulkan without a GPU), glslang-tools
#          (glslangValidator: the Vulkan modules' own SPIR-V kernels, iree-backend/kernels)
#   - pip into the project's .venv: iree-base-compiler==3.13.0 (iree-compile matching the runtime
#     that eerie-sys 0.5.0 vendors) and cmake==3.31.10 (eerie-sys needs cmake >= 3.26)
# Afterwards build with `.venv/bin` on PATH, e.g. `PATH="$PWD/.venv/bin:$PATH" cargo build -p kvsnap-iree`.
# Runs as root on a fresh Debian machine; a no-op when everything is already there.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVSNAP_VENV:-$ROOT/.venv}"
IREE_COMPILER_VERSION="3.13.0"
CMAKE_VERSION="3.31.10"
APT_PACKAGES=(libclang-dev gcc g++ make mesa-vulkan-drivers libvulkan1 glslang-tools python3 python3-venv)

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

missing=()
for p in "${APT_PACKAGES[@]}"; do
    status="$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)"
    if [ "$status" != "install ok installed" ]; then
        missing+=("$p")
    fi
done
if [ "${#missing[@]}" -gt 0 ]; then
    echo "setup-iree: installing apt packages: ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
else
    echo "setup-iree: apt packages present"
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup-iree: creating $VENV"
    python3 -m venv "$VENV"
fi

pip_has() { # name version (output captured first: with pipefail, grep -q closing the pipe early
    # would make pip's SIGPIPE fail the check)
    local info
    info="$("$VENV/bin/python" -m pip show "$1" 2>/dev/null || true)"
    grep -qx "Version: $2" <<<"$info"
}
want=()
pip_has iree-base-compiler "$IREE_COMPILER_VERSION" || want+=("iree-base-compiler==$IREE_COMPILER_VERSION")
pip_has cmake "$CMAKE_VERSION" || want+=("cmake==$CMAKE_VERSION")
if [ "${#want[@]}" -gt 0 ]; then
    echo "setup-iree: pip installing into $VENV: ${want[*]}"
    "$VENV/bin/python" -m pip install -q "${want[@]}"
else
    echo "setup-iree: pip packages present"
fi

compiler_version="$("$VENV/bin/iree-compile" --version)"
cmake_version="$("$VENV/bin/cmake" --version)"
echo "setup-iree: ${compiler_version//$'\n'/ }"
echo "setup-iree: ${cmake_version%%$'\n'*}"
