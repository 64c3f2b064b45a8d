"""A GGUF (version 3) writer that needs numpy alone: metadata, the tensor table, then each tensor's stored bytes
streamed from a generator, so a file larger than memory is written a piece at a time. It lets the benchmarks write
random-weight files on machines without the `gguf` package; formats/gguf.py reads them back.

    w = GGUFWriter("qwen35")
    w.add("qwen35.block_count", U32, 65)
    w.add_tensor("output_norm.weight", "F32", (5120,), lambda: iter([np.ones(5120, np.float32)]))
    w.write(path)
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

# GGUF value types (gguf.GGUFValueType)
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_PACK = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q",
         I64: "<q", F64: "<d"}

# ggml tensor types this writer lays out: (type id, values a block, bytes a block), as ggml.h and GGML_QUANT_SIZES
GGML_TYPES: dict[str, tuple[int, int, int]] = {
    "F32": (0, 1, 4), "F16": (1, 1, 2), "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210), "BF16": (30, 1, 2),
}
ALIGNMENT = 32  # general.alignment's default: every tensor's data starts on it


def tensor_nbytes(qtype: str, shape: tuple[int, ...]) -> int:
    """Stored bytes of a tensor of `shape` (torch order: its rows of shape[-1] values last)."""
    _, block, size = GGML_TYPES[qtype]
    if shape[-1] % block:
        raise ValueError(f"{qtype} rows of {shape[-1]} values are not whole blocks of {block}")
    return int(np.prod(shape, dtype=np.int64)) // block * size


@dataclass
class Tensor:
    name: str
    qtype: str
    shape: tuple[int, ...]  # torch order, as formats/gguf.py reports it (ggml's dims reversed)
    chunks: Callable[[], Iterator[np.ndarray]]  # the stored bytes in order, any dtype, any number of pieces

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.qtype, self.shape)


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _value(kind: int, value: Any, item: int | None = None) -> bytes:
    if kind == STRING:
        return _string(value)
    if kind == ARRAY:
        if item is None:
            raise ValueError("an array needs its element type")
        head = struct.pack("<IQ", item, len(value))
        if item == STRING:
            return head + b"".join(_string(v) for v in value)
        return head + np.asarray(value, dtype=np.dtype(_PACK[item])).tobytes()
    return struct.pack(_PACK[kind], value)


class GGUFWriter:
    """Collects key/values and tensors, then writes them in the order added."""

    def __init__(self, arch: str):
        self.kv: dict[str, tuple[int, Any, int | None]] = {}
        self.tensors: list[Tensor] = []
        self.add("general.architecture", STRING, arch)

    def add(self, key: str, kind: int, value: Any, item: int | None = None) -> None:
        """One key: its GGUF value type (an array's element type in `item`) and value."""
        self.kv[key] = (kind, value, item)

    def add_tensor(self, name: str, qtype: str, shape: tuple[int, ...],
                   chunks: Callable[[], Iterator[np.ndarray]]) -> None:
        self.tensors.append(Tensor(name, qtype, tuple(int(d) for d in shape), chunks))

    def header(self) -> bytes:
        """Everything before the data section: magic, counts, key/values, tensor table, padding."""
        out = [b"GGUF", struct.pack("<IQQ", 3, len(self.tensors), len(self.kv))]
        out += [_string(k) + struct.pack("<I", kind) + _value(kind, v, item) for k, (kind, v, item) in self.kv.items()]
        offset = 0
        for t in self.tensors:
            dims = tuple(reversed(t.shape))
            out.append(_string(t.name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, GGML_TYPES[t.qtype][0],
                                                     offset))
            offset += -(-t.nbytes // ALIGNMENT) * ALIGNMENT
        head = b"".join(out)
        return head + bytes(-len(head) % ALIGNMENT)

    def file_size(self) -> int:
        return len(self.header()) + sum(-(-t.nbytes // ALIGNMENT) * ALIGNMENT for t in self.tensors)

    def write(self, path: str | Path) -> int:
        """Writes the file; returns its size. Each tensor's pieces must add up to its stored bytes."""
        with open(path, "wb") as f:
            f.write(self.header())
            for t in self.tensors:
                written = 0
                for piece in t.chunks():
                    data = np.ascontiguousarray(piece).view(np.uint8).reshape(-1)
                    f.write(memoryview(data))
                    written += data.size
                if written != t.nbytes:
                    raise ValueError(f"{t.name}: {written} bytes written, its {t.qtype} {t.shape} holds {t.nbytes}")
                f.write(bytes(-written % ALIGNMENT))
            return f.tell()
