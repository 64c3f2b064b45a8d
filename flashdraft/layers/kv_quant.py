"""KV cache storage types, as llama.cpp's --cache-type-k / --cache-type-v name them: float types kept as tensors of
that dtype, and 32-value blocks with an fp16 scale (and min) in ggml's layouts, quantized with ggml's reference
rounding (the `gguf` package's quantizers, bit for bit) as rows are written and expanded as they are read.

A `KVCodec` turns rows [..., head_dim] into what the cache stores and back."""
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import Tensor

Q = GGMLQuantizationType
FLOAT_KV_TYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
BLOCK_KV_TYPES = {"q8_0": Q.Q8_0, "q5_0": Q.Q5_0, "q5_1": Q.Q5_1, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1}
KV_CACHE_TYPES = (*FLOAT_KV_TYPES, *BLOCK_KV_TYPES)


def _fp16_bytes(x: Tensor) -> Tensor:
    return x.to(torch.float16).view(torch.uint8)


def _inverse(d: Tensor) -> Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))


def _nibbles(q: Tensor) -> Tensor:
    """Values [n, 32] (< 16 after masking) -> 16 bytes: the first 16 in the low nibbles, the last 16 in the high."""
    return (q[:, :16] & 0xF) | (q[:, 16:] << 4)


def _high_bits(q: Tensor) -> Tensor:
    """Bit 4 of each of 32 values -> 4 bytes, little-endian bit order."""
    bits = ((q >> 4) & 1).view(-1, 4, 8)
    return (bits << torch.arange(8, device=q.device, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)


def _signed_max(blocks: Tensor) -> Tensor:
    """The value of largest magnitude in each block (the first such, as numpy's argmax), sign kept."""
    return blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))


def quantize_blocks(blocks: Tensor, qtype: GGMLQuantizationType) -> Tensor:
    """float32 blocks [n, 32] -> stored bytes [n, type size], as ggml's reference quantizers."""
    if qtype == Q.Q8_0:
        d = blocks.abs().amax(-1, keepdim=True) / 127
        x = blocks * _inverse(d)
        q = (x.sign() * (x.abs() + 0.5).floor()).to(torch.int8).view(torch.uint8)
        return torch.cat([_fp16_bytes(d), q], -1)
    if qtype in (Q.Q4_0, Q.Q5_0):
        levels = 8 if qtype == Q.Q4_0 else 16
        d = _signed_max(blocks) / -levels
        q = (blocks * _inverse(d) + (levels + 0.5)).trunc().clamp(0, 2 * levels - 1).to(torch.uint8)
        parts = [_fp16_bytes(d)] + ([_high_bits(q)] if qtype == Q.Q5_0 else []) + [_nibbles(q)]
        return torch.cat(parts, -1)
    lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    top = 15 if qtype == Q.Q4_1 else 31
    d = (hi - lo) / top
    q = ((blocks - lo) * _inverse(d) + 0.5).trunc().clamp(0, top).to(torch.uint8)
    parts = [_fp16_bytes(d), _fp16_bytes(lo)] + ([_high_bits(q)] if qtype == Q.Q5_1 else []) + [_nibbles(q)]
    return torch.cat(parts, -1)


@dataclass(frozen=True)
class KVCodec:
    """How one of K or V is stored: `name` is a KV_CACHE_TYPES entry, `dtype` the model's (for "auto")."""
    name: str
    dtype: torch.dtype

    @property
    def qtype(self) -> GGMLQuantizationType | None:
        return BLOCK_KV_TYPES.get(self.name)

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.qtype is not None else FLOAT_KV_TYPES.get(self.name, self.dtype)

    def row_size(self, head_dim: int) -> int:
        """Stored elements per head row (bytes for block types)."""
        if self.qtype is None:
            return head_dim
        block, size = GGML_QUANT_SIZES[self.qtype]
        if head_dim % block:
            raise ValueError(f"KV cache type {self.name} needs a head size divisible by {block}, got {head_dim}")
        return head_dim // block * size

    def bytes_per_row(self, head_dim: int) -> int:
        return self.row_size(head_dim) * torch.empty(0, dtype=self.storage_dtype).element_size()

    def encode(self, x: Tensor) -> Tensor:
        """Rows [..., head_dim] -> stored [..., row_size]."""
        if self.qtype is None:
            return x.to(self.storage_dtype)
        block, _ = GGML_QUANT_SIZES[self.qtype]
        raw = quantize_blocks(x.float().reshape(-1, block), self.qtype)
        return raw.reshape(*x.shape[:-1], -1)

    def decode(self, stored: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """Stored [..., row_size] -> rows [..., head_dim] in `dtype` (default: the stored float type)."""
        if self.qtype is None:
            return stored if dtype is None else stored.to(dtype)
        from flashdraft.formats.gguf import BLOCK_DEQUANTISERS  # (formats imports the model families)
        _, size = GGML_QUANT_SIZES[self.qtype]
        values = BLOCK_DEQUANTISERS[self.qtype](stored.reshape(-1, size))
        return values.reshape(*stored.shape[:-1], -1).to(dtype or self.dtype)


def kv_codecs(cache_types: tuple[str, str] | None, dtype: torch.dtype) -> tuple[KVCodec, KVCodec]:
    """(K codec, V codec); None or "auto": the model's dtype."""
    names = cache_types or ("auto", "auto")
    for name in names:
        if name != "auto" and name not in KV_CACHE_TYPES:
            raise ValueError(f"unknown KV cache type {name!r} (supported: {', '.join(KV_CACHE_TYPES)})")
    return KVCodec(names[0], dtype), KVCodec(names[1], dtype)
