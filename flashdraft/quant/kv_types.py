"""KV cache storage types, as llama.cpp's --cache-type-k / --cache-type-v name them: float types kept as tensors of
that dtype, and 32-value blocks with an fp16 scale (and min) in ggml's layouts, quantized with ggml's reference
rounding (the `gguf` package's quantizers, bit for bit; iq4_nl as llama.cpp's CUDA copy kernel rounds it) as rows
are written. Plus the rotated types `turbo3` / `turbo4` (BeeLlama's names, after TurboQuant): each group of up to
128 values of a head vector is divided by its norm, rotated by a fixed randomised Hadamard transform (which
makes its coordinates nearly Gaussian, N(0, 1/group)), and each coordinate is stored as the index of the nearest
entry of a 3- or 4-bit Lloyd-Max codebook for that Gaussian at the best of a few scales (SCALE_SEARCH), with one
fp16 scale that gives the decoded group the original norm. Attention can consume them in the rotated domain
(rotate q, un-rotate the output). Block types are stored rotated too where the head size is a multiple of 64
(`ROTATE_BLOCKS`), as llama.cpp's cache is since its attn_rot: the same rotation, then ggml's blocks of the rotated
row.

A stored row holds exactly its type's bytes, but laid out by field rather than by block, so that the attention
kernel reads the quantized values with wide aligned loads: a block type's row is every block's quants, then every
scale, then every min, then every block's fifth bits (`to_blocks` gives back ggml's blocks); a rotated type's row
is every group's codes, then every group's scale, with a 4-bit group's codes as two nibble planes (value c in byte
c % (g/2), the high nibble for the second half) and a 3-bit group's as four 2-bit planes (value c in byte c % (g/4),
bits 2 (c // (g/4))) followed by one bit plane (byte c % (g/8), bit c // (g/8)).

A `KVFormat` says how one of K or V is stored: its row size, its tables, whether it rotates (layers/kv_quant.KVCodec
turns rows into those bytes and back)."""
import functools
import math
import os
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import Tensor

from flashdraft.quant.iq4 import IQ4_NL_VALUES

Q = GGMLQuantizationType
FLOAT_KV_TYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
BLOCK_KV_TYPES = {"q8_0": Q.Q8_0, "q5_0": Q.Q5_0, "q5_1": Q.Q5_1, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1,
                  "iq4_nl": Q.IQ4_NL}
ROTATED_KV_TYPES = {"turbo3": 3, "turbo4": 4}  # bits per stored value
KERNEL_QUANTIZED = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")  # on CUDA, written by kernels/kv_quantize.py
KV_CACHE_TYPES = (*FLOAT_KV_TYPES, *BLOCK_KV_TYPES, *ROTATED_KV_TYPES)
ROTATION_GROUP = 128  # values per rotated group (a smaller power-of-two head is one group)
ROTATION_SEED = 42
# A rotated group's codes come from the best of these scales (times the Gaussian's norm / sqrt(g)): a group whose
# coordinates are not Gaussian-shaped (one past the outer level, or all near a level) fits another scale better.
# Qwen2.5-0.5B's keys: relative squared error 8.8e-3 -> 6.9e-3 at turbo4, its 99.9th percentile 3.0e-2 -> 1.3e-2
# (docs/perf-history.md, 2026-12-05 CPU). 1.0 is one of them: a group never fits worse than at the Gaussian's scale.
SCALE_SEARCH = tuple(1 + k / 20 for k in range(-6, 11))
# Block types are stored rotated too where the head size is a multiple of 64, as llama.cpp's KV cache does
# (attn_rot_k / attn_rot_v, on by default for quantized types; LLAMA_ATTN_ROT_DISABLE=1 turns it off there and
# here): a head's outlier channels (Qwen2's key bias) then no longer set the scale of every block they sit in.
# Qwen2.5-0.5B, q8_0 keys, llama-perplexity's protocol: KL 1.37e-2 without, 2.07e-3 with (docs/perf-history.md,
# 2026-12-04 CPU).
ROTATE_BLOCKS = os.environ.get("LLAMA_ATTN_ROT_DISABLE", "0") in ("", "0")


_TABLES: dict[tuple, Tensor] = {}


def table(kind: str, arg: int, device: torch.device | str) -> Tensor:
    """Constant tables on a device, made once (KVCache makes them before any CUDA graph capture)."""
    key = (kind, arg, str(torch.device(device)))
    if key not in _TABLES:
        if kind == "iq4_nl":
            table = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32)
        elif kind == "levels":
            table = torch.tensor(lloyd_max_codebook(arg), dtype=torch.float32)
        elif kind == "midpoints":  # between adjacent levels: a coordinate's code is how many lie below it
            levels = torch.tensor(lloyd_max_codebook(arg), dtype=torch.float32)
            table = (levels[1:] + levels[:-1]) / 2
        elif kind == "rotation_signs":
            table = (_input_signs(arg) / math.sqrt(arg)).float()
        elif kind == "search":  # the inverses of SCALE_SEARCH's scales, as the write kernel multiplies by them
            table = (1 / torch.tensor(SCALE_SEARCH, dtype=torch.float64)).float()
        else:
            table = _rotation_cpu(arg)
        _TABLES[key] = table.to(device)
    return _TABLES[key]


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
    values = table("iq4_nl", 0, blocks.device)
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


def _input_signs(group: int) -> Tensor:
    return torch.randint(0, 2, (group,), generator=torch.Generator().manual_seed(ROTATION_SEED)) * 2 - 1


@functools.cache
def _rotation_cpu(group: int) -> Tensor:
    """R [group, group], orthogonal: the normalised (Sylvester) Hadamard matrix times a fixed random sign per input."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < group:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * _input_signs(group)[None, :] / math.sqrt(group)).float()


def rotation(group: int, device: torch.device | str = "cpu") -> Tensor:
    return table("rotation", group, device)


def rotation_signs(group: int, device: torch.device | str = "cpu") -> Tensor:
    """R's input signs over sqrt(group), float32 [group]: what the kernels' fast transform needs (kernels/rotation)."""
    return table("rotation_signs", group, device)


def rotation_group(head_dim: int) -> int:
    group = min(head_dim, ROTATION_GROUP)
    if group & (group - 1) or head_dim % group:
        raise ValueError(f"rotated KV cache types need a power-of-two head size or a multiple of {ROTATION_GROUP}, "
                         f"got {head_dim}")
    return group


# (offset, size) of each field in a ggml block, in the order a planar row stores them: quants, scale, min, fifth bits
BLOCK_FIELDS = {Q.Q8_0: ((2, 32), (0, 2)), Q.Q4_0: ((2, 16), (0, 2)), Q.IQ4_NL: ((2, 16), (0, 2)),
                Q.Q4_1: ((4, 16), (0, 2), (2, 2)), Q.Q5_0: ((6, 16), (0, 2), (2, 4)),
                Q.Q5_1: ((8, 16), (0, 2), (2, 2), (4, 4))}


def blocks_to_row(blocks: Tensor, qtype: GGMLQuantizationType) -> Tensor:
    """ggml blocks [..., n, size] -> planar rows [..., n * size]."""
    return torch.cat([blocks[..., off:off + size].flatten(-2) for off, size in BLOCK_FIELDS[qtype]], -1)


def row_to_blocks(rows: Tensor, qtype: GGMLQuantizationType) -> Tensor:
    """Planar rows [..., n * size] -> ggml blocks [..., n, size]."""
    _, size = GGML_QUANT_SIZES[qtype]
    n = rows.shape[-1] // size
    fields, at = {}, 0
    for off, width in BLOCK_FIELDS[qtype]:
        fields[off] = rows[..., at:at + n * width].unflatten(-1, (n, width))
        at += n * width
    return torch.cat([fields[off] for off in sorted(fields)], -1)


def _pack_codes(codes: Tensor, bits: int) -> Tensor:
    """codes [n, g] (< 2^bits) -> [n, g * bits / 8] bytes in the planes of the module docstring."""
    g = codes.shape[-1]
    c = codes.to(torch.uint8)
    if bits == 4:
        return c[:, :g // 2] | (c[:, g // 2:] << 4)
    low = c & 3
    q = g // 4
    planes = low[:, :q] | (low[:, q:2 * q] << 2) | (low[:, 2 * q:3 * q] << 4) | (low[:, 3 * q:] << 6)
    high = (c >> 2).view(c.shape[0], 8, g // 8)  # bit plane: value c at byte c % (g/8), bit c // (g/8)
    bit_plane = (high << torch.arange(8, device=c.device, dtype=torch.uint8)[None, :, None]).sum(1, dtype=torch.uint8)
    return torch.cat([planes, bit_plane], -1)


def _unpack_codes(packed: Tensor, bits: int, g: int) -> Tensor:
    p = packed.long()
    if bits == 4:
        return torch.cat([p & 15, p >> 4], -1)
    q = g // 4
    low = torch.cat([(p[:, :q] >> (2 * u)) & 3 for u in range(4)], -1)
    bit_plane = p[:, q:]  # [n, g / 8]
    high = ((bit_plane[:, None, :] >> torch.arange(8, device=p.device)[None, :, None]) & 1).flatten(1)
    return low | (high << 2)


def quantize_rotated(groups: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """float32 groups [n, g] -> (packed codes [n, g * bits / 8] of the rotated, normalised group, fp16 scale
    bytes [n, 2]). Each SCALE_SEARCH scale gives codes (the levels nearest to the unit group times the scale's
    inverse); a group keeps those whose levels point closest to its direction (the largest unit . levels /
    |levels|, the first of equal ones), stored with the scale that keeps its norm. (On CUDA,
    kernels/kv_quantize.quantize_rotated_rows does the same in one kernel.)"""
    g = groups.shape[1]
    levels, midpoints = table("levels", bits, groups.device), table("midpoints", bits, groups.device)
    norm = groups.norm(dim=-1, keepdim=True)
    unit = (groups @ rotation(g, groups.device).T) * (math.sqrt(g) * _inverse(norm))  # ~ N(0, 1) per coordinate
    codes = torch.zeros(unit.shape, dtype=torch.long, device=unit.device)
    best = torch.full((unit.shape[0],), -math.inf, device=unit.device)
    length2 = torch.zeros_like(best)  # |levels[codes]|^2 of the codes kept
    for inverse in table("search", 0, groups.device):
        trial = torch.bucketize((unit * inverse).contiguous(), midpoints)
        level = levels[trial]
        dot, trial_length2 = (unit * level).sum(-1), (level * level).sum(-1)
        fit = dot * dot.abs() / trial_length2
        better = fit > best
        codes = torch.where(better[:, None], trial, codes)
        best = torch.where(better, fit, best)
        length2 = torch.where(better, trial_length2, length2)
    scale = norm * _inverse(length2.sqrt()[:, None])  # the decoded group keeps the norm
    return _pack_codes(codes, bits), _fp16_bytes(scale)


@dataclass(frozen=True)
class KVFormat:
    """How one of K or V is stored: `name` is a KV_CACHE_TYPES entry, `dtype` the model's (for "auto"). Rows are
    encoded and decoded by layers/kv_quant.KVCodec."""
    name: str
    dtype: torch.dtype

    @property
    def qtype(self) -> GGMLQuantizationType | None:
        return BLOCK_KV_TYPES.get(self.name)

    @property
    def bits(self) -> int | None:
        """Bits per value of a rotated type (None for the others)."""
        return ROTATED_KV_TYPES.get(self.name)

    def rotates(self, head_dim: int) -> bool:
        """Whether rows are stored rotated (layers/kv_quant.rotate): the turbo types always, block types where the
        head size is a multiple of 64 (ROTATE_BLOCKS). Attention over the stored rows meets them with a rotated
        query and rotates its output back. (llama.cpp rotates a 192-value head by 64-value groups; the rotated
        types' groups are 128 values or the whole head.)"""
        group = min(head_dim, ROTATION_GROUP)
        return self.bits is not None or (ROTATE_BLOCKS and self.qtype is not None and head_dim % 64 == 0
                                         and head_dim % group == 0)  # (a 192-value head: plain blocks)

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

    def prepare(self, device: torch.device | str, head_dim: int) -> None:
        """Make the type's constant tables on `device` now (not inside a CUDA graph capture)."""
        if self.name == "iq4_nl":  # its torch dequantizer's levels
            table("iq4_nl", 0, device)
        if self.bits is not None:
            table("levels", self.bits, device)
            table("midpoints", self.bits, device)
            table("search", 0, device)
        if self.rotates(head_dim):  # (the kernels' fast transform: R itself serves the CPU path only, made on use)
            rotation_signs(rotation_group(head_dim), device)

    def kernel_writes(self, head_dim: int) -> bool:
        """Whether CUDA rows of this block type are quantized by kernels/kv_quantize.py's block kernels."""
        return self.name in KERNEL_QUANTIZED and head_dim & (head_dim - 1) == 0

    def to_blocks(self, stored: Tensor) -> Tensor:
        """A block type's stored rows [..., row_size] -> ggml's blocks [..., head_dim / 32, block size]."""
        return row_to_blocks(stored, self.qtype)

    def head_dim(self, row_size: int) -> int:
        if self.bits is not None:  # 2 + group * bits / 8 bytes per group; heads under 128 are one group
            full = 2 + ROTATION_GROUP * self.bits // 8
            return row_size // full * ROTATION_GROUP if row_size >= full else (row_size - 2) * 8 // self.bits
        if self.qtype is None:
            return row_size
        block, size = GGML_QUANT_SIZES[self.qtype]
        return row_size // size * block

    def decode_rotated(self, stored: Tensor) -> Tensor:
        """A rotated type's rows [..., row_size] -> float32 rows in the rotated domain [..., head_dim]."""
        head_dim = self.head_dim(stored.shape[-1])
        group = rotation_group(head_dim)
        n, code_bytes = head_dim // group, group * self.bits // 8
        flat = stored.reshape(-1, stored.shape[-1])
        codes = _unpack_codes(flat[:, :n * code_bytes].reshape(-1, code_bytes), self.bits, group)
        scales = flat[:, n * code_bytes:].contiguous().view(torch.float16).float().reshape(-1, 1)
        values = table("levels", self.bits, stored.device)[codes] * scales
        return values.reshape(*stored.shape[:-1], head_dim)
