"""Write a copy of a GGUF file with its quantized weights re-encoded in another type.

    python scripts/requantize_gguf.py SRC.gguf DST.gguf --type Q8_0
    python scripts/requantize_gguf.py \\
        .cache/default-model/gguf/SmolLM2-135M-Instruct.Q4_1.gguf \\
        bench/results/gguf-weights/SmolLM2-135M-Instruct.Q8_0.gguf --type Q8_0

Every weight tensor of two or more dimensions stored quantized (or in F16/BF16) is dequantized
with `gguf.quants.dequantize` and quantized again with `gguf.quants.quantize` in `--type`; a
tensor already in that type is copied byte for byte. F32 tensors (the norms) and every metadata
key and value (architecture parameters, tokenizer, chat template, ...) are copied as they are,
in their order, except `general.file_type`, which names the new type (LlamaFileType, e.g.
MOSTLY_Q8_0). A tensor whose rows do not split into `--type`'s blocks keeps its own type (and is
listed). Re-encoding adds no information: a Q8_0 copy of a Q4_1 file holds the Q4_1 values to
within Q8_0's rounding, in a layout that other kernels read.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
    GGUFWriter,
    Keys,
    LlamaFileType,
    ReaderTensor,
)
from gguf.quants import dequantize, quant_shape_to_byte_shape, quantize

# --type: (the tensors' type, general.file_type)
TYPES: dict[str, tuple[GGMLQuantizationType, LlamaFileType]] = {
    "Q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "Q5_1": (GGMLQuantizationType.Q5_1, LlamaFileType.MOSTLY_Q5_1),
    "Q5_0": (GGMLQuantizationType.Q5_0, LlamaFileType.MOSTLY_Q5_0),
    "Q4_1": (GGMLQuantizationType.Q4_1, LlamaFileType.MOSTLY_Q4_1),
    "Q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "BF16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
    "F16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
}
# source types that are kept whatever --type says (full-precision floats and integers)
KEPT = {
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F64,
    GGMLQuantizationType.I8,
    GGMLQuantizationType.I16,
    GGMLQuantizationType.I32,
    GGMLQuantizationType.I64,
}


def log(message: str) -> None:
    print(f"[requantize_gguf] {message}", flush=True)


def re_encoded(tensor: ReaderTensor, qtype: GGMLQuantizationType) -> bool:
    """Whether `tensor` gets `qtype`: a 2-D (or more) weight stored quantized or in 16 bits,
    whose rows split into `qtype`'s blocks."""
    if tensor.tensor_type in KEPT or tensor.tensor_type == qtype or len(tensor.shape) < 2:
        return False
    block_size = GGML_QUANT_SIZES[qtype][0]
    return int(tensor.shape[0]) % block_size == 0  # shape[0]: the row length (ne0)


def copy_fields(reader: GGUFReader, writer: GGUFWriter, file_type: LlamaFileType) -> None:
    """Every key/value of `reader` into `writer`, in order, with `general.file_type` replaced
    (added at the end if the source has none). The GGUF.* fields and the architecture are the
    writer's own."""
    wrote_file_type = False
    for field in reader.fields.values():
        if field.name == Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        if field.name == Keys.General.FILE_TYPE:
            writer.add_file_type(int(file_type))
            wrote_file_type = True
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    if not wrote_file_type:
        writer.add_file_type(int(file_type))


def requantize(source: Path, destination: Path, type_name: str) -> dict[str, int]:
    """Write the copy; the number of tensors re-encoded, copied and kept for their shape."""
    qtype, file_type = TYPES[type_name]
    reader = GGUFReader(source, "r")
    architecture = reader.get_field(Keys.General.ARCHITECTURE)
    if architecture is None:
        raise SystemExit(f"{source}: no {Keys.General.ARCHITECTURE} key")
    writer = GGUFWriter(destination, arch=str(architecture.contents()), endianess=reader.endianess)
    alignment = reader.get_field(Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = int(alignment.contents())
    copy_fields(reader, writer, file_type)

    counts = {"re-encoded": 0, "copied": 0, "kept (shape)": 0}
    for tensor in reader.tensors:
        if re_encoded(tensor, qtype):
            rows = tuple(int(n) for n in reversed(tensor.shape))  # numpy order: (..., row length)
            byte_shape = quant_shape_to_byte_shape(rows, qtype)
            n_bytes = int(np.prod(byte_shape))
            if qtype == GGMLQuantizationType.F16:  # quantize() gives float16 values, not bytes
                writer.add_tensor_info(tensor.name, rows, np.dtype(np.float16), n_bytes, qtype)
            else:
                writer.add_tensor_info(tensor.name, byte_shape, np.dtype(np.uint8), n_bytes, qtype)
            counts["re-encoded"] += 1
        else:
            data = tensor.data
            writer.add_tensor_info(
                tensor.name, data.shape, data.dtype, data.nbytes, tensor.tensor_type
            )
            kept_for_shape = tensor.tensor_type not in KEPT and tensor.tensor_type != qtype
            if kept_for_shape and len(tensor.shape) >= 2:
                log(f"{tensor.name}: rows of {int(tensor.shape[0])} do not split into "
                    f"{type_name} blocks; kept as {tensor.tensor_type.name}")  # fmt: skip
                counts["kept (shape)"] += 1
            else:
                counts["copied"] += 1

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        if re_encoded(tensor, qtype):
            values = dequantize(tensor.data, tensor.tensor_type)
            data = quantize(values, qtype)
        else:
            data = tensor.data
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="the GGUF file to read")
    parser.add_argument("destination", type=Path, help="the GGUF file to write")
    parser.add_argument("--type", default="Q8_0", choices=list(TYPES), help="the new weight type")
    parser.add_argument("--force", action="store_true", help="overwrite the destination")
    args = parser.parse_args(argv)
    if args.destination.resolve() == args.source.resolve():
        parser.error("the destination is the source")
    if args.destination.exists() and not args.force:
        parser.error(f"{args.destination} exists (--force overwrites it)")
    args.destination.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    partial = args.destination.with_name(args.destination.name + ".partial")
    try:
        counts = requantize(args.source, partial, args.type)
        partial.replace(args.destination)
    finally:
        partial.unlink(missing_ok=True)
    size = args.destination.stat().st_size / 2**20
    log(f"wrote {args.destination} ({size:.1f} MiB, {args.type}) in "
        f"{time.perf_counter() - started:.1f} s: "
        + ", ".join(f"{n} {what}" for what, n in counts.items()))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
