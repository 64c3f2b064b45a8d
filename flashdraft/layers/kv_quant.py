"""KV cache storage types, as llama.cpp's --cache-type-k / --cache-type-v name them: float types kept as tensors of
that dtype, and 32-value blocks with an fp16 scale (and min) in ggml's layouts, quantized with ggml's reference
rounding (the `gguf` package's quantizers, bit for bit; iq4_nl as llama.cpp's CUDA copy kernel rounds it) as rows
are written. Plus the rotated types `turbo3` / `turbo4` (BeeLlama's names, after TurboQuant): each group of up to
128 values of a head vector is divided by its norm, rotated by a fixed randomised Hadamard transform (which
makes its coordinates nearly Gaussian, N(0, 1/group)), and each coordinate is stored as the index of the nearest
entry of a 3- or 4-bit Lloyd-Max codebook for that Gaussian, with one fp16 scale that gives the decoded group
the original norm. Attention can consume them in the rotated domain (rotate q, un-rotate the output).

A `KVCodec` turns rows [..., head_dim] into what the cache stores and back."""
import functools
import math
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import Tensor

Q = GGMLQuantizationType
FLOAT_KV_TYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
BLOCK_KV_TYPES = {"q8_0": Q.Q8_0, "q5_0": Q.Q5_0, "q5_1": Q.Q5_1, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1,
                  "iq4_nl": Q.IQ4_NL}
ROTATED_KV_TYPES = {"turbo3": 3, "turbo4": 4}  # bits per stored value
KV_CACHE_TYPES = (*FLOAT_KV_TYPES, *BLOCK_KV_TYPES, *ROTATED_KV_TYPES)
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # kvalues_iq4nl
ROTATION_GROUP = 128  # values per rotated group (a smaller power-of-two head is one group)
ROTATION_SEED = 42


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


def _quantize_iq4_nl(blocks: Tensor) -> Tensor:
    """As llama.cpp's quantize_f32_iq4_nl_block: the scale from the value of largest magnitude, each value to the
    nearest table entry (a tie to the upper one), then the least-squares scale for those entries weighted by x^2."""
    values = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32, device=blocks.device)
    d = _signed_max(blocks) / values[0]
    x = blocks * _inverse(d)
    upper = torch.searchsorted(values, x.contiguous(), right=True).clamp(1, 15)
    idx = torch.where(x - values[upper - 1] < values[upper] - x, upper - 1, upper)
    idx = torch.where(x <= values[0], 0, torch.where(x >= values[15], 15, idx))
    v = values[idx]
    w = blocks * blocks
    sumqx, sumq2 = (w * v * blocks).sum(-1, keepdim=True), (w * v * v).sum(-1, keepdim=True)
    d = torch.where(sumq2 > 0, sumqx / torch.where(sumq2 > 0, sumq2, 1), d)
    return torch.cat([_fp16_bytes(d), _nibbles(idx.to(torch.uint8))], -1)


def quantize_blocks(blocks: Tensor, qtype: GGMLQuantizationType) -> Tensor:
    """float32 blocks [n, 32] -> stored bytes [n, type size], as ggml's reference quantizers."""
    if qtype == Q.IQ4_NL:
        return _quantize_iq4_nl(blocks)
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


@functools.cache
def lloyd_max_codebook(bits: int) -> tuple[float, ...]:
    """The 2^bits reconstruction levels minimising the mean squared error for a standard Gaussian (Lloyd's
    iteration: boundaries at midpoints, levels at the conditional means of their intervals)."""
    n = 1 << bits
    levels = torch.linspace(-2.5, 2.5, n, dtype=torch.float64)
    pdf = lambda t: torch.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda t: 0.5 * (1 + torch.erf(t / math.sqrt(2)))  # noqa: E731
    inf = torch.tensor([math.inf], dtype=torch.float64)
    for _ in range(500):
        edges = torch.cat([-inf, (levels[1:] + levels[:-1]) / 2, inf])
        a, b = edges[:-1], edges[1:]
        levels = (pdf(a) - pdf(b)) / (cdf(b) - cdf(a))
    return tuple(levels.tolist())


@functools.cache
def _rotation_cpu(group: int) -> Tensor:
    """R [group, group], orthogonal: the normalised Hadamard matrix times a fixed random sign per input."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < group:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (group,), generator=torch.Generator().manual_seed(ROTATION_SEED)) * 2 - 1
    return (h * signs[None, :] / math.sqrt(group)).float()


def rotation(group: int, device: torch.device | str = "cpu") -> Tensor:
    return _rotation_cpu(group).to(device)


def rotate(x: Tensor, inverse: bool = False) -> Tensor:
    """x [..., D] -> each group of its last dimension times R (into a rotated type's domain) or R^T (back)."""
    group = rotation_group(x.shape[-1])
    r = rotation(group, x.device)
    groups = x.float().unflatten(-1, (-1, group))
    return (groups @ (r if inverse else r.T)).flatten(-2).to(x.dtype)


def rotation_group(head_dim: int) -> int:
    group = min(head_dim, ROTATION_GROUP)
    if group & (group - 1) or head_dim % group:
        raise ValueError(f"rotated KV cache types need a power-of-two head size or a multiple of {ROTATION_GROUP}, "
                         f"got {head_dim}")
    return group


def _pack_bits(codes: Tensor, bits: int) -> Tensor:
    """codes [n, g] (< 2^bits) -> [n, g * bits / 8] bytes, little-endian: value i at bits bits*i .. bits*i+bits-1."""
    n, g = codes.shape
    bit = (codes.long()[:, :, None] >> torch.arange(bits, device=codes.device)) & 1  # [n, g, bits]
    return (bit.reshape(n, -1, 8) << torch.arange(8, device=codes.device)).sum(-1).to(torch.uint8)


def _unpack_bits(packed: Tensor, bits: int, g: int) -> Tensor:
    n = packed.shape[0]
    bit = (packed.long()[:, :, None] >> torch.arange(8, device=packed.device)) & 1  # [n, bytes, 8]
    return (bit.reshape(n, g, bits) << torch.arange(bits, device=packed.device)).sum(-1)


def quantize_rotated(groups: Tensor, bits: int) -> Tensor:
    """float32 groups [n, g] -> [n, 2 + g * bits / 8] bytes: the fp16 scale, then the packed codebook indices of
    the rotated, normalised group."""
    g = groups.shape[1]
    levels = torch.tensor(lloyd_max_codebook(bits), dtype=torch.float32, device=groups.device)
    norm = groups.norm(dim=-1, keepdim=True)
    unit = groups * _inverse(norm)
    rotated = unit @ rotation(g, groups.device).T * math.sqrt(g)  # coordinates ~ N(0, 1)
    codes = torch.bucketize(rotated.contiguous(), (levels[1:] + levels[:-1]) / 2)
    decoded = levels[codes]
    scale = norm * _inverse(decoded.norm(dim=-1, keepdim=True))  # the decoded group keeps the norm
    return torch.cat([_fp16_bytes(scale), _pack_bits(codes, bits)], -1)


def rotated_values(stored: Tensor, bits: int, g: int) -> Tensor:
    """Stored groups [n, bytes] -> the decoded group in the rotated domain [n, g] (scale x codebook level)."""
    levels = torch.tensor(lloyd_max_codebook(bits), dtype=torch.float32, device=stored.device)
    scale = stored[:, :2].contiguous().view(torch.float16).float()
    return levels[_unpack_bits(stored[:, 2:], bits, g)] * scale


@dataclass(frozen=True)
class KVCodec:
    """How one of K or V is stored: `name` is a KV_CACHE_TYPES entry, `dtype` the model's (for "auto")."""
    name: str
    dtype: torch.dtype

    @property
    def qtype(self) -> GGMLQuantizationType | None:
        return BLOCK_KV_TYPES.get(self.name)

    @property
    def bits(self) -> int | None:
        """Bits per value of a rotated type (None for the others)."""
        return ROTATED_KV_TYPES.get(self.name)

    @property
    def packed(self) -> bool:
        """Rows stored as bytes (block or rotated types) rather than floats."""
        return self.qtype is not None or self.bits is not None

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.packed else FLOAT_KV_TYPES.get(self.name, self.dtype)

    def row_size(self, head_dim: int) -> int:
        """Stored elements per head row (bytes for block and rotated types)."""
        if self.bits is not None:
            group = rotation_group(head_dim)
            return head_dim // group * (2 + group * self.bits // 8)
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
        if self.bits is not None:
            group = rotation_group(x.shape[-1])
            raw = quantize_rotated(x.float().reshape(-1, group), self.bits)
            return raw.reshape(*x.shape[:-1], -1)
        if self.qtype is None:
            return x.to(self.storage_dtype)
        block, _ = GGML_QUANT_SIZES[self.qtype]
        raw = quantize_blocks(x.float().reshape(-1, block), self.qtype)
        return raw.reshape(*x.shape[:-1], -1)

    def decode(self, stored: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """Stored [..., row_size] -> rows [..., head_dim] in `dtype` (default: the stored float type)."""
        if self.bits is not None:
            rotated = self.decode_rotated(stored)
            group = rotation_group(rotated.shape[-1])
            values = (rotated.reshape(-1, group) @ rotation(group, stored.device)).reshape(rotated.shape)
            return values.to(dtype or self.dtype)
        if self.qtype is None:
            return stored if dtype is None else stored.to(dtype)
        from flashdraft.formats.gguf import BLOCK_DEQUANTISERS  # (formats imports the model families)
        _, size = GGML_QUANT_SIZES[self.qtype]
        values = BLOCK_DEQUANTISERS[self.qtype](stored.reshape(-1, size))
        return values.reshape(*stored.shape[:-1], -1).to(dtype or self.dtype)


    def decode_rotated(self, stored: Tensor) -> Tensor:
        """A rotated type's rows [..., row_size] -> float32 rows in the rotated domain [..., head_dim]."""
        per_group = 2 + ROTATION_GROUP * self.bits // 8
        row = stored.shape[-1]
        # one group per row for small heads: row = 2 + head_dim * bits / 8
        group = ROTATION_GROUP if row % per_group == 0 and row >= per_group else (row - 2) * 8 // self.bits
        g_bytes = 2 + group * self.bits // 8
        values = rotated_values(stored.reshape(-1, g_bytes), self.bits, group)
        return values.reshape(*stored.shape[:-1], -1)


def kv_codecs(cache_types: tuple[str, str] | None, dtype: torch.dtype) -> tuple[KVCodec, KVCodec]:
    """(K codec, V codec); None or "auto": the model's dtype."""
    names = cache_types or ("auto", "auto")
    for name in names:
        if name != "auto" and name not in KV_CACHE_TYPES:
            raise ValueError(f"unknown KV cache type {name!r} (supported: {', '.join(KV_CACHE_TYPES)})")
    return KVCodec(names[0], dtype), KVCodec(names[1], dtype)
