"""Helpers of scripts/profile-dispatches.sh (standard library only).

inputs MLIR ENTRY POS0 VALID NPY_DIR
    Prints the `--input` flags of entry point ENTRY of a kvsnap module's MLIR, in argument
    order (the order of `graphs::entry_point`'s arguments): the chunk's ids 5 or embedding rows
    0.01, `pos0` and `valid` (as tensors and again as host integers), `head` 1, every float
    tensor 0.01 and every integer tensor 0. A dispatch's time does not depend on the values,
    only on the shapes and on `pos0`/`valid`/`head`, which pick what runs. Tensors of more
    than 64 Ki elements are passed as .npy files written into NPY_DIR (once per shape):
    iree-benchmark-module fills a splat input through a host mapping of device memory, which
    on an NVIDIA Vulkan driver took minutes for the 671 MB embedding table.

summary JSONL CALLS TOP
    Reads `iree-profile dispatch --format=jsonl` of CALLS calls and prints, per call, the
    dispatch count, the sum of the dispatches' device times, and the TOP executables by time.
"""

import json
import re
import struct
import sys
from pathlib import Path

# Elements above which an input is written as a file instead of a splat.
SPLAT_LIMIT = 1 << 16

# Element types of the modules' tensors: their .npy type and struct format.
TYPES = {"f32": ("<f4", "<f"), "i32": ("<i4", "<i"), "i8": ("|i1", "<b")}


def signature(mlir: Path, entry: str) -> list[str]:
    """The argument types of `func.func @entry(...)`, in order."""
    head = f"func.func @{entry}("
    with mlir.open() as f:
        for line in f:
            if line.lstrip().startswith(head):
                args = line.split(head, 1)[1].split(") ->", 1)[0]
                return re.findall(r"%\d+: (tensor<[^>]*>|i32)", args)
    names = re.findall(r"func\.func @(\w+)\(", mlir.read_text())
    sys.exit(f"profile_dispatches: no entry point {entry} in {mlir}; it has {', '.join(names)}")


def npy(path: Path, elem: str, dims: list[int], value) -> None:
    """Writes a .npy of `elem` (a key of TYPES) and shape `dims` holding `value` everywhere,
    unless it exists."""
    if path.exists():
        return
    descr, fmt = TYPES[elem]
    header = "{'descr': '%s', 'fortran_order': False, 'shape': (%s,), }" % (
        descr,
        ", ".join(map(str, dims)),
    )
    # Magic (6) + version (2) + length (2) + header + newline: a multiple of 64 bytes.
    header += " " * (63 - (len(header) + 10) % 64) + "\n"
    count = 1
    for d in dims:
        count *= d
    size = struct.calcsize(fmt)
    chunk = struct.pack(fmt, value) * (1 << 20)
    tmp = path.with_suffix(".partial")
    with tmp.open("wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode())
        left = count
        while left:
            n = min(left, 1 << 20)
            f.write(chunk[: size * n])
            left -= n
    tmp.rename(path)


def inputs(mlir: str, entry: str, pos0: str, valid: str, npy_dir: str) -> None:
    types = signature(Path(mlir), entry)
    # ids/emb, pos0, valid, head, pos0_host, valid_host (graphs::entry_point).
    scalars = {1: pos0, 2: valid, 3: "1", 4: pos0, 5: valid}
    flags = []
    for k, ty in enumerate(types):
        if ty == "i32":
            flags.append(f"--input={scalars.get(k, '0')}")
            continue
        shape = ty[len("tensor<") : -1]
        *dims, elem = shape.split("x")
        dims = [int(d) for d in dims]
        if elem not in TYPES:
            sys.exit(f"profile_dispatches: argument {k} of {entry} is a {ty}")
        count = 1
        for d in dims:
            count *= d
        value = 0.01 if elem == "f32" else (5 if k == 0 else 0)
        if k in scalars:
            flags.append(f"--input={shape}={scalars[k]}")
        elif count > SPLAT_LIMIT:
            path = Path(npy_dir) / f"{shape}.npy"
            npy(path, elem, dims, value)
            flags.append(f"--input=@{path}")
        else:
            flags.append(f"--input={shape}={value}")
    print(" ".join(flags))


def summary(jsonl: str, calls: str, top: str) -> None:
    calls, top = int(calls), int(top)
    with open(jsonl) as f:
        rows = [json.loads(line) for line in f if line.startswith("{")]
    # Device timestamps (Vulkan's `dispatch_group`) or host execution spans (local-task's
    # `host_dispatch_group`).
    groups = [r for r in rows if r.get("type") in ("dispatch_group", "host_dispatch_group")]
    if not groups:
        sys.exit(f"profile_dispatches: no dispatch timings in {jsonl}")
    dispatches = sum(g["count"] for g in groups) / calls
    total = sum(g["total_ns"] for g in groups) / calls / 1e6
    print(
        f"{dispatches:.0f} dispatches a call, {len(groups)} executables, "
        f"{total:.3f} ms of dispatch time a call ({calls} calls)"
    )
    print(f"{'ms/call':>8} {'n/call':>6} {'each us':>8} {'min us':>7}  executable  workgroups x size")
    for g in sorted(groups, key=lambda g: -g["total_ns"])[:top]:
        print(
            f"{g['total_ns'] / calls / 1e6:8.3f} {g['count'] / calls:6.0f} "
            f"{g['avg_ns'] / 1e3:8.1f} {g['min_ns'] / 1e3:7.1f}  {g['key']}  "
            f"{g.get('last_workgroup_count')} x {g.get('last_workgroup_size')}"
        )


if __name__ == "__main__":
    commands = {"inputs": (inputs, 5), "summary": (summary, 3)}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        sys.exit(__doc__)
    fn, argc = commands[sys.argv[1]]
    if len(sys.argv) != argc + 2:
        sys.exit(__doc__)
    fn(*sys.argv[2:])
