"""Writes an all-F32 copy of a GGUF: every quantised tensor dequantised, metadata kept.

The result holds exactly the float32 weights kvsnap computes with (kvsnap dequantises the same
blocks at import), so llama.cpp runs on the same numbers and reads the same bytes per token.

    python f32_gguf.py SRC.gguf DST.gguf   (with llama.cpp's gguf-py on PYTHONPATH)
"""

import sys

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize


def main(src: str, dst: str) -> None:
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # written by GGUFWriter itself
        if name == "general.file_type":
            writer.add_uint32(name, 0)  # LLAMA_FTYPE_ALL_F32
        elif field.types[0] == GGUFValueType.ARRAY:
            writer.add_array(name, field.contents())
        else:
            writer.add_key_value(name, field.contents(), field.types[0])
    for tensor in reader.tensors:
        shape = [int(d) for d in reversed(tensor.shape)]
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape)
        writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"f32_gguf: {len(reader.tensors)} tensors written to {dst}", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: f32_gguf.py SRC.gguf DST.gguf")
    main(sys.argv[1], sys.argv[2])
