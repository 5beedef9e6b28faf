"""Tests of scripts/profile_dispatches.py (run by scripts/test.sh: python3 -m unittest)."""

import ast
import contextlib
import io
import json
import struct
import tempfile
import unittest
from pathlib import Path

import profile_dispatches as pd

# An entry point's signature as `kvsnap export` writes it (generic syntax, one line), with the
# argument kinds the modules have: ids, pos0/valid tensors, head/pos0_host/valid_host by value,
# a large f32 weight, a small norm, a large i8 screen and a large i32 ring positions table.
MLIR = (
    "module @kvsnap {\n"
    "  func.func @other(%0: tensor<1xi32>) -> (tensor<i32>) {\n"
    "  }\n"
    "  func.func @chunk_ids_c1(%0: tensor<1xi32>, %1: tensor<i32>, %2: tensor<i32>, %3: i32, "
    "%4: i32, %5: i32, %6: tensor<300x300xf32>, %7: tensor<640xf32>, %8: tensor<70000xi8>, "
    "%9: tensor<70000xi32>) -> (tensor<i32>, tensor<640xf32>) {\n"
    "  }\n"
    "}\n"
)


def read_npy(path: Path):
    """(descr, shape, payload bytes) of a version 1.0 .npy, checking its framing."""
    data = path.read_bytes()
    assert data[:8] == b"\x93NUMPY\x01\x00", data[:8]
    (length,) = struct.unpack("<H", data[8:10])
    assert (10 + length) % 64 == 0, length
    header = ast.literal_eval(data[10 : 10 + length].decode())
    return header["descr"], header["shape"], data[10 + length :]


class Inputs(unittest.TestCase):
    def run_inputs(self, pos0="860", valid="1"):
        with tempfile.TemporaryDirectory() as tmp:
            mlir = Path(tmp) / "m.mlir"
            mlir.write_text(MLIR)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                pd.inputs(str(mlir), "chunk_ids_c1", pos0, valid, tmp)
            files = {p.name: read_npy(p) for p in Path(tmp).glob("*.npy")}
            return out.getvalue().split(), files, tmp

    def test_flags_follow_the_signature(self):
        flags, files, tmp = self.run_inputs(pos0="860", valid="1")
        self.assertEqual(
            flags,
            [
                "--input=1xi32=5",
                "--input=i32=860",
                "--input=i32=1",
                "--input=1",
                "--input=860",
                "--input=1",
                f"--input=@{tmp}/300x300xf32.npy",
                "--input=640xf32=0.01",
                f"--input=@{tmp}/70000xi8.npy",
                f"--input=@{tmp}/70000xi32.npy",
            ],
        )

    def test_large_inputs_are_npy_files_of_their_type(self):
        _, files, _ = self.run_inputs()
        descr, shape, payload = files["300x300xf32.npy"]
        self.assertEqual((descr, shape, len(payload)), ("<f4", (300, 300), 4 * 90000))
        (first,) = struct.unpack("<f", payload[:4])
        self.assertEqual(struct.pack("<f", first), struct.pack("<f", 0.01))
        descr, shape, payload = files["70000xi8.npy"]
        self.assertEqual((descr, shape, payload), ("|i1", (70000,), bytes(70000)))
        descr, shape, payload = files["70000xi32.npy"]
        self.assertEqual((descr, shape, payload), ("<i4", (70000,), bytes(4 * 70000)))

    def test_an_unknown_entry_point_names_the_module_s(self):
        with tempfile.TemporaryDirectory() as tmp:
            mlir = Path(tmp) / "m.mlir"
            mlir.write_text(MLIR)
            with self.assertRaises(SystemExit) as e:
                pd.inputs(str(mlir), "chunk_emb_c1", "0", "1", tmp)
        self.assertIn("no entry point chunk_emb_c1", str(e.exception.code))
        self.assertIn("other, chunk_ids_c1", str(e.exception.code))


class Summary(unittest.TestCase):
    def test_per_call_figures_and_the_slowest_first(self):
        def group(kind, key, count, total_ns):
            return {
                "type": kind,
                "key": key,
                "count": count,
                "total_ns": total_ns,
                "avg_ns": total_ns / count,
                "min_ns": total_ns / count,
                "last_workgroup_count": [2, 1, 1],
                "last_workgroup_size": [64, 1, 1],
            }

        rows = [
            {"type": "dispatch_summary", "total_dispatches": 6},
            group("dispatch_group", "small", 4, 400_000),
            group("dispatch_group", "big", 2, 3_000_000),
            group("host_dispatch_group", "host", 2, 1_000_000),
        ]
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "d.jsonl"
            path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                pd.summary(str(path), "2", "2")
        lines = out.getvalue().splitlines()
        self.assertEqual(
            lines[0],
            "4 dispatches a call, 3 executables, 2.200 ms of dispatch time a call (2 calls)",
        )
        self.assertTrue(lines[2].split()[:2] == ["1.500", "1"] and "big" in lines[2], lines[2])
        self.assertIn("host", lines[3])
        self.assertEqual(len(lines), 4)

    def test_a_profile_without_timings_is_an_error(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "d.jsonl"
            path.write_text(json.dumps({"type": "dispatch_summary"}) + "\n")
            with self.assertRaises(SystemExit) as e:
                pd.summary(str(path), "1", "5")
        self.assertIn("no dispatch timings", str(e.exception.code))


if __name__ == "__main__":
    unittest.main()
