"""GGUF block-quantized weights used as they are stored: a fused dequantize + matrix product for a few rows
(decode, verify and draft steps: 1-64 rows), and a dequantize kernel (prefill: one matrix at a time into a
reused scratch buffer, then cuBLAS).

A weight is its file's bytes, one row per output feature: `qweight [N, K / block * block_bytes]` uint8. Each
program takes BLOCK_N output rows and walks K in chunks of 256 weights (one K-quant super-block, or eight
32-weight blocks of the older types), unpacks the chunk in registers into a [BLOCK_N, 256] tile in the
weights' natural order and multiplies it with the matching [BLOCK_M, 256] slice of x on the tensor cores.
Rows of x are taken 16 at a time whatever M is, so a row's result does not depend on how many rows share the
call (a plain step and a verify step give the same bits for the same token).

Layouts follow ggml-common.h (block_q4_0 ... block_iq4_xs); the unpacking below mirrors
formats/gguf.py's torch dequantisers, and the tests hold both to the `gguf` package's reference.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

from flashdraft.kernels import gguf_gemv, split_k
from flashdraft.kernels.iq4 import iq4_value
from flashdraft.quant.ggml import PADDED_BLOCK_BYTES

try:
    from flashdraft.kernels import gguf_mma
except ImportError:  # a Triton without Gluon: the tensor-core kernel below takes every verify width
    gguf_mma = None

CHUNK = 256  # weights per K step: one super-block, or eight 32-weight blocks
BLOCK_M = 16

# GGML type id -> (weights per block, bytes per block); the kernel's QTYPE is the GGML id
TYPES = {"Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34),
         "Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176),
         "Q6_K": (14, 256, 210), "IQ4_NL": (20, 32, 18), "IQ4_XS": (23, 256, 136)}
TYPE_IDS = {name: ident for name, (ident, _, _) in TYPES.items()}


def block_bytes(qtype: str) -> int:
    """Bytes per block as the kernels keep them (layers/quantized.py pads Q6_K's)."""
    return PADDED_BLOCK_BYTES.get(qtype, (0, TYPES[qtype][2]))[1]


def chunk_bytes(qtype: str) -> int:
    return block_bytes(qtype) * CHUNK // TYPES[qtype][1]


# ------------------------------------------------------------------------------------------ unpacking
# Each takes p [BLOCK_N] (a pointer per row to the chunk's first byte) and ok [BLOCK_N] (row in range) and
# returns the chunk's 256 weights [BLOCK_N, 256] in float32, in order.

@triton.jit
def _f16(p, ok):
    """Little-endian fp16 at p (any shape) -> float32."""
    lo = tl.load(p, mask=ok, other=0).to(tl.uint16)
    hi = tl.load(p + 1, mask=ok, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibbles(b, BN: tl.constexpr):
    """Bytes [..., 16] -> [..., 32]: the 16 low nibbles, then the 16 high ones (the older types' order)."""
    pair = tl.join(b & 15, b >> 4)  # [..., 16, 2]
    return tl.reshape(tl.permute(pair, (0, 1, 3, 2)), (BN, 8, 32))


@triton.jit
def _blocks(c, ok, K):
    """Chunk c's eight 32-weight blocks (a row may end inside the chunk): (their indices [8], mask [N, 8], the same
    [N, 8, 1]). A missing block's scale loads as 0."""
    j = 8 * c + tl.arange(0, 8)
    ok2 = ok[:, None] & (j < K // 32)[None, :]
    return j, ok2, ok2[:, :, None]


@triton.jit
def _q8_0(row, c, ok, K, BN: tl.constexpr):
    """Q8_0 as quant/ggml.field_planes keeps it: a row's K int8 values, then its K / 32 fp16 scales."""
    j = tl.arange(0, 8)
    ok2 = ok[:, None] & (8 * c + j < K // 32)[None, :]
    d = _f16(row[:, None] + K + 2 * (8 * c + j)[None, :], ok2)
    q = tl.load(row[:, None, None] + 256 * c + 32 * j[None, :, None] + tl.arange(0, 32)[None, None, :],
                mask=ok2[:, :, None], other=0).to(tl.int8, bitcast=True)
    return tl.reshape(d[:, :, None] * q.to(tl.float32), (BN, 256))


@triton.jit
def _q4_x(row, c, ok, K, HAS_MIN: tl.constexpr, BN: tl.constexpr):
    """Q4_0 / Q4_1 as quant/ggml.field_planes keeps them: a row's blocks' 16 nibble bytes, then their d (and m)."""
    j, ok2, ok3 = _blocks(c, ok, K)
    scales = row[:, None] + K // 2 + (2 + 2 * HAS_MIN) * j[None, :]
    d = _f16(scales, ok2)
    q = _nibbles(tl.load(row[:, None, None] + 16 * j[None, :, None] + tl.arange(0, 16)[None, None, :], mask=ok3,
                         other=0), BN).to(tl.float32)
    if HAS_MIN:
        w = d[:, :, None] * q + _f16(scales + 2, ok2)[:, :, None]
    else:
        w = d[:, :, None] * (q - 8.0)
    return tl.reshape(w, (BN, 256))


@triton.jit
def _q5_x(row, c, ok, K, HAS_MIN: tl.constexpr, BN: tl.constexpr):
    """Q5_0 / Q5_1 as quant/ggml.field_planes keeps them: a row's blocks' 16 nibble bytes, then their 4 bytes
    of fifth bits, then their d (and m)."""
    j, ok2, ok3 = _blocks(c, ok, K)
    scales = row[:, None] + K // 2 + K // 8 + (2 + 2 * HAS_MIN) * j[None, :]
    d = _f16(scales, ok2)
    qh = tl.zeros([BN, 8], tl.uint32)
    for i in tl.static_range(4):
        qh = qh | (tl.load(row[:, None] + K // 2 + 4 * j[None, :] + i, mask=ok2, other=0).to(tl.uint32) << (8 * i))
    low = _nibbles(tl.load(row[:, None, None] + 16 * j[None, :, None] + tl.arange(0, 16)[None, None, :], mask=ok3,
                           other=0), BN)
    high = (qh[:, :, None] >> tl.arange(0, 32)[None, None, :].to(tl.uint32)) & 1
    q = (low.to(tl.uint32) | (high << 4)).to(tl.float32)
    if HAS_MIN:
        w = d[:, :, None] * q + _f16(scales + 2, ok2)[:, :, None]
    else:
        w = d[:, :, None] * (q - 16.0)
    return tl.reshape(w, (BN, 256))


@triton.jit
def _iq4_nl(row, c, ok, K, BN: tl.constexpr):
    """IQ4_NL as quant/ggml.field_planes keeps it: a row's blocks' 16 nibble bytes, then their d."""
    j, ok2, ok3 = _blocks(c, ok, K)
    d = _f16(row[:, None] + K // 2 + 2 * j[None, :], ok2)
    q = _nibbles(tl.load(row[:, None, None] + 16 * j[None, :, None] + tl.arange(0, 16)[None, None, :], mask=ok3,
                         other=0), BN)
    return tl.reshape(d[:, :, None] * iq4_value(q), (BN, 256))


@triton.jit
def _iq4_xs(row, c, ok, K, BN: tl.constexpr):
    """IQ4_XS as quant/ggml.field_planes keeps it: a row's super-blocks' 128 nibble bytes (by lane,
    quant/ggml.by_lane: sub-block j's byte 4t + i at 32t + 4j + i), then their 8-byte headers (d, scales_h,
    scales_l)."""
    ok2, ok3 = ok[:, None], ok[:, None, None]
    p = row + K // 256 * 128 + 8 * c
    d = _f16(p, ok)
    scales_h = (tl.load(p + 2, mask=ok, other=0).to(tl.uint32) |
                (tl.load(p + 3, mask=ok, other=0).to(tl.uint32) << 8))
    ib = tl.arange(0, 8)
    scales_l = tl.load(p[:, None] + 4 + ib[None, :] // 2, mask=ok2, other=0).to(tl.uint32)
    low = (scales_l >> (4 * (ib[None, :] % 2)).to(tl.uint32)) & 15
    high = (scales_h[:, None] >> (2 * ib[None, :]).to(tl.uint32)) & 3
    dl = d[:, None] * ((low | (high << 4)).to(tl.float32) - 32.0)  # [N, 8]
    b = tl.arange(0, 16)[None, None, :]
    qs = tl.load(row[:, None, None] + 128 * c + 32 * (b // 4) + 4 * ib[None, :, None] + b % 4, mask=ok3, other=0)
    return tl.reshape(dl[:, :, None] * iq4_value(_nibbles(qs, BN)), (BN, 256))


@triton.jit
def _k_scales(p, ok, BN: tl.constexpr):
    """Q4_K/Q5_K's eight 6-bit scales and mins, packed in 12 bytes at p: ([N, 8], [N, 8]) float32."""
    i = tl.arange(0, 4)
    a = tl.load(p[:, None] + i[None, :], mask=ok[:, None], other=0)
    b = tl.load(p[:, None] + 4 + i[None, :], mask=ok[:, None], other=0)
    c = tl.load(p[:, None] + 8 + i[None, :], mask=ok[:, None], other=0)
    sc = tl.join(a & 63, (c & 15) | ((a >> 6) << 4))  # [N, 4, 2]: scale j and scale j + 4
    mn = tl.join(b & 63, (c >> 4) | ((b >> 6) << 4))
    sc = tl.reshape(tl.permute(sc, (0, 2, 1)), (BN, 8)).to(tl.float32)
    mn = tl.reshape(tl.permute(mn, (0, 2, 1)), (BN, 8)).to(tl.float32)
    return sc, mn


@triton.jit
def _k_nibbles(p, ok, BN: tl.constexpr):
    """128 bytes at p (quant/ggml.lane_grouped: group g's bytes 8p..8p+7 at 32p + 8g) -> [N, 8, 32] 4-bit
    values in order: sub-block 2g is group g's low nibbles, 2g + 1 its high ones."""
    c = tl.arange(0, 32)
    b = tl.load(p[:, None, None] + 8 * tl.arange(0, 4)[None, :, None] + (c // 8 * 32 + c % 8)[None, None, :],
                mask=ok[:, None, None], other=0)
    pair = tl.join(b & 15, b >> 4)  # [N, 4, 32, 2]
    return tl.reshape(tl.permute(pair, (0, 1, 3, 2)), (BN, 8, 32))


@triton.jit
def _q4_k(p, ok, BN: tl.constexpr):
    d, dmin = _f16(p, ok), _f16(p + 2, ok)
    sc, mn = _k_scales(p + 4, ok, BN)
    q = _k_nibbles(p + 16, ok, BN).to(tl.float32)
    w = (d[:, None] * sc)[:, :, None] * q - (dmin[:, None] * mn)[:, :, None]
    return tl.reshape(w, (BN, 256))


@triton.jit
def _q5_k(p, ok, BN: tl.constexpr):
    d, dmin = _f16(p, ok), _f16(p + 2, ok)
    sc, mn = _k_scales(p + 4, ok, BN)
    qh = tl.load(p[:, None] + 16 + tl.arange(0, 32)[None, :], mask=ok[:, None], other=0)  # bit j: sub-block j
    high = (qh[:, None, :] >> tl.arange(0, 8)[None, :, None].to(tl.uint8)) & 1
    q = (_k_nibbles(p + 48, ok, BN) | (high << 4)).to(tl.float32)
    w = (d[:, None] * sc)[:, :, None] * q - (dmin[:, None] * mn)[:, :, None]
    return tl.reshape(w, (BN, 256))


@triton.jit
def _two_bits(b, BN: tl.constexpr):
    """Bytes [N, 2, 32] -> [N, 256]: the 2-bit fields at shifts 0, 2, 4, 6 (half h, shift k, byte c -> 128h + 32k + c)."""
    k = (2 * tl.arange(0, 4)).to(tl.uint8)
    q = (b[:, :, None, :] >> k[None, None, :, None]) & 3
    return tl.reshape(q, (BN, 256))


@triton.jit
def _q6_k(p, ok, BN: tl.constexpr):
    ok3 = ok[:, None, None]
    ql = tl.load(p[:, None, None] + 64 * tl.arange(0, 2)[None, :, None] + tl.arange(0, 64)[None, None, :],
                 mask=ok3, other=0)  # [N, 2, 64]
    low = tl.reshape(tl.permute(tl.join(ql & 15, ql >> 4), (0, 1, 3, 2)), (BN, 256))  # 128h + 64s + c
    qh = tl.load(p[:, None, None] + 128 + 32 * tl.arange(0, 2)[None, :, None] + tl.arange(0, 32)[None, None, :],
                 mask=ok3, other=0)
    q = (low | (_two_bits(qh, BN) << 4)).to(tl.float32) - 32.0
    scales = tl.load(p[:, None] + 192 + tl.arange(0, 16)[None, :], mask=ok[:, None], other=0)
    dl = _f16(p + 208, ok)[:, None] * scales.to(tl.int8, bitcast=True).to(tl.float32)  # [N, 16]
    return tl.reshape(dl[:, :, None] * tl.reshape(q, (BN, 16, 16)), (BN, 256))


@triton.jit
def _q2_k(p, ok, BN: tl.constexpr):
    scales = tl.load(p[:, None] + tl.arange(0, 16)[None, :], mask=ok[:, None], other=0)
    qs = tl.load(p[:, None, None] + 16 + 32 * tl.arange(0, 2)[None, :, None] + tl.arange(0, 32)[None, None, :],
                 mask=ok[:, None, None], other=0)
    d, dmin = _f16(p + 80, ok), _f16(p + 82, ok)
    dl = d[:, None] * (scales & 15).to(tl.float32)
    ml = dmin[:, None] * (scales >> 4).to(tl.float32)
    q = tl.reshape(_two_bits(qs, BN).to(tl.float32), (BN, 16, 16))
    return tl.reshape(dl[:, :, None] * q - ml[:, :, None], (BN, 256))


@triton.jit
def _q3_k(p, ok, BN: tl.constexpr):
    ok2, ok3 = ok[:, None], ok[:, None, None]
    s8 = tl.load(p[:, None] + 96 + tl.arange(0, 8)[None, :], mask=ok2, other=0)
    low = tl.reshape(tl.permute(tl.join(s8 & 15, s8 >> 4), (0, 2, 1)), (BN, 16))  # 8 * shift + byte
    s4 = tl.load(p[:, None] + 104 + tl.arange(0, 4)[None, :], mask=ok2, other=0)
    high = tl.reshape((s4[:, None, :] >> (2 * tl.arange(0, 4)).to(tl.uint8)[None, :, None]) & 3, (BN, 16))
    dl = _f16(p + 108, ok)[:, None] * ((low | (high << 4)).to(tl.float32) - 32.0)  # [N, 16]
    qs = tl.load(p[:, None, None] + 32 + 32 * tl.arange(0, 2)[None, :, None] + tl.arange(0, 32)[None, None, :],
                 mask=ok3, other=0)
    hmask = tl.load(p[:, None] + tl.arange(0, 32)[None, :], mask=ok2, other=0)
    bits = tl.reshape((hmask[:, None, :] >> tl.arange(0, 8).to(tl.uint8)[None, :, None]) & 1, (BN, 256))  # 32j + c
    q = _two_bits(qs, BN).to(tl.float32) - 4.0 * (1 - bits).to(tl.float32)  # a set bit means no -4 offset
    return tl.reshape(dl[:, :, None] * tl.reshape(q, (BN, 16, 16)), (BN, 256))


@triton.jit
def _unpack(row, c, ok, K, QTYPE: tl.constexpr, CHUNK_BYTES: tl.constexpr, BN: tl.constexpr):
    """Chunk c (256 weights) of the rows starting at `row` [BLOCK_N]. The 32-weight types' rows may end inside a
    chunk (K-quant rows hold whole chunks); they, Q8_0 and IQ4_XS are kept in planes by field and addressed from
    the row's start, the K-quants by their chunk's bytes."""
    p = row + c * CHUNK_BYTES
    if QTYPE == 2:
        w = _q4_x(row, c, ok, K, False, BN)
    elif QTYPE == 3:
        w = _q4_x(row, c, ok, K, True, BN)
    elif QTYPE == 6:
        w = _q5_x(row, c, ok, K, False, BN)
    elif QTYPE == 7:
        w = _q5_x(row, c, ok, K, True, BN)
    elif QTYPE == 8:
        w = _q8_0(row, c, ok, K, BN)
    elif QTYPE == 10:
        w = _q2_k(p, ok, BN)
    elif QTYPE == 11:
        w = _q3_k(p, ok, BN)
    elif QTYPE == 12:
        w = _q4_k(p, ok, BN)
    elif QTYPE == 13:
        w = _q5_k(p, ok, BN)
    elif QTYPE == 14:
        w = _q6_k(p, ok, BN)
    elif QTYPE == 20:
        w = _iq4_nl(row, c, ok, K, BN)
    else:
        w = _iq4_xs(row, c, ok, K, BN)
    return w


# ------------------------------------------------------------------------------------------ kernels

@triton.jit(do_not_specialize=["M", "stride_xm", "stride_om"])
def _matmul_kernel(x_ptr, w_ptr, out_ptr, M, N, K, chunks_per_split, stride_xm, stride_wn, stride_os, stride_om,
                   QTYPE: tl.constexpr, CHUNK_BYTES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Partial products over one split of K: out [splits, M, N] float32 (or the product in x's dtype: one split)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    k = tl.arange(0, 256)
    p = w_ptr + rows.to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    first = split * chunks_per_split
    last = tl.minimum(first + chunks_per_split, tl.cdiv(K, 256))
    for c in range(first, last):
        w = _unpack(p, c, row_ok, K, QTYPE, CHUNK_BYTES, BLOCK_N)
        x = tl.load(x_ptr + m[:, None] * stride_xm + c * 256 + k[None, :], mask=m_ok[:, None] & (c * 256 + k < K)[None, :],
                    other=0.0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    tl.store(out_ptr + split * stride_os + m[:, None] * stride_om + rows[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & row_ok[None, :])


@triton.jit
def _dequantize_kernel(w_ptr, out_ptr, N, K, stride_wn, stride_on, QTYPE: tl.constexpr,
                       CHUNK_BYTES: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.program_id(1)
    row_ok = rows < N
    w = _unpack(w_ptr + rows.to(tl.int64) * stride_wn, c, row_ok, K, QTYPE, CHUNK_BYTES, BLOCK_N)
    k = c * 256 + tl.arange(0, 256)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_on + k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (k < K)[None, :])


def row_bytes(qtype: str, k: int) -> int:
    return k // TYPES[qtype][1] * block_bytes(qtype)


def _check(qweight: Tensor, qtype: str, k: int) -> None:
    if qtype not in TYPES:
        raise ValueError(f"no GGUF kernel for {qtype} (kernels: {', '.join(TYPES)})")
    block = TYPES[qtype][1]
    if k % block:
        raise ValueError(f"{qtype} needs in_features divisible by {block}, got {k}")
    if qweight.dtype != torch.uint8 or qweight.shape[1] != row_bytes(qtype, k):
        raise ValueError(f"{qtype} weight of {tuple(qweight.shape)} bytes does not hold {k} inputs per row")


# The fastest of benchmarks/kernels/gguf_kernels.py --sweep on an H200 (docs/perf-history.md, 2026-12-03 H200): BLOCK_N
# 16-64 x 4-8 warps x 528-1056 programs spread 0.79-1.53 ms over the 8B's four matrix shapes; BLOCK_N 32 since
# 2026-12-04 (H200, 16 rows: Q4_K 0.152 ms against 0.158 at 64, Q6_K 0.194 against 0.225).
BLOCK_N = 32
NUM_WARPS = 4
TARGET_PROGRAMS = 1056  # about eight programs per SM of an H100/H200


def splits_for(n: int, k: int) -> tuple[int, int]:
    """(K splits, chunks per split): rows alone give too few programs for a small N (k/v projections) or a long
    K (down projections). Depends on the matrix only, never on the row count M, so a token's result is the
    same bits in a plain step and in a verify step."""
    chunks = triton.cdiv(k, CHUNK)
    per_split = triton.cdiv(chunks, max(1, min(chunks, TARGET_PROGRAMS // triton.cdiv(n, BLOCK_N))))
    return triton.cdiv(chunks, per_split), per_split


def _route(x: Tensor, qtypes: list[str], k: int) -> str:
    """Which kernels take x [M, K] times matrices of these types: "mma" (gguf_mma.MIN_ROWS-16 rows), "gemv" (up to
    gguf_gemv.MAX_ROWS rows, or up to gguf_gemv.ROWS where the mma kernels do not take them) or "dot" (the
    tensor-core kernel below: the other types and row counts). The integer and the mma kernels give a row the same
    bits (kernels/split_k.py), so a row verified in a block equals the row decoded alone; the tensor-core kernel
    keeps the types neither reads (Q2_K, Q3_K) for every row count. Parts of a fused matrix share the integer or the
    mma kernels' rounded x only where all of them take them."""
    if gguf_mma is not None and all(gguf_mma.covers(q, x.shape[0], x) for q in qtypes):
        return "mma"
    if x.shape[0] <= gguf_gemv.ROWS and all(gguf_gemv.covers(q, k) for q in qtypes):
        return "gemv"
    return "dot"


def _dot(x: Tensor, qweight: Tensor, qtype: str, k: int, summed: bool) -> Tensor:
    """The tensor-core kernel: [M, N] in x's dtype, or (summed=False) its partial sums [splits, M, N]
    (split_k.outputs)."""
    m, n = x.shape[0], qweight.shape[0]
    splits, per_split = splits_for(n, k)
    out, partial = split_k.outputs(x, n, splits, summed=summed)
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(m, BLOCK_M), splits)
    _matmul_kernel[grid](x, qweight, partial, M=m, N=n, K=k, chunks_per_split=per_split, stride_xm=x.stride(0),
                         stride_wn=qweight.stride(0), stride_os=partial.stride(0), stride_om=partial.stride(1),
                         QTYPE=TYPE_IDS[qtype], CHUNK_BYTES=chunk_bytes(qtype), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                         num_warps=NUM_WARPS)
    split_k.finish(partial, out)
    return out if summed else partial


def _in_chunks(x: Tensor, qtypes: list[str], k: int) -> bool:
    """More rows than one launch of the exact kernels takes (a batch of verify blocks), every 16-row chunk of which
    they take: the product then runs chunk by chunk, so each row keeps the bits it has decoded alone."""
    return x.shape[0] > gguf_gemv.ROWS and _route(x[:gguf_gemv.ROWS], qtypes, k) != "dot"


def _chunked(product, x: Tensor) -> Tensor:
    return torch.cat([product(x[i:i + gguf_gemv.ROWS]) for i in range(0, x.shape[0], gguf_gemv.ROWS)])


def _product(x: Tensor, qweight: Tensor, qtype: str, k: int) -> Tensor:
    if _in_chunks(x, [qtype], k):
        return _chunked(lambda rows: _product(rows, qweight, qtype, k), x)
    route = _route(x, [qtype], k)
    if route == "mma":
        return gguf_mma.matmul(x, qweight, qtype, k)
    if route == "gemv":
        return gguf_gemv.gemv(x, qweight, qtype, k)
    return _dot(x, qweight, qtype, k, summed=True)


@torch.library.custom_op("flashdraft::gguf_matmul", mutates_args=())
def gguf_matmul(x: Tensor, qweight: Tensor, qtype: str, k: int, bias: Tensor | None = None) -> Tensor:
    """x [M, K] (M <= 64 in practice) @ dequantize(qweight [N, bytes])^T (+ bias) -> [M, N] in x's dtype. Up to 16
    rows of a type they cover take the integer or the int8 mma kernels (`_route`; x rounded to 8 bits per 32 or 256
    values, gguf_gemv.x_group), more rows 16 at a time (`_in_chunks`); the rest multiply in x's dtype on the tensor
    cores."""
    _check(qweight, qtype, k)
    out = _product(x.contiguous(), qweight, qtype, k)
    return out if bias is None else out + bias


@gguf_matmul.register_fake
def _(x: Tensor, qweight: Tensor, qtype: str, k: int, bias: Tensor | None = None) -> Tensor:
    return x.new_empty(x.shape[0], qweight.shape[0])


@torch.library.custom_op("flashdraft::gguf_matmul_parts", mutates_args=())
def gguf_matmul_parts(x: Tensor, qweights: list[Tensor], qtypes: str, k: int) -> Tensor:
    """x [M, K] @ [dequantize(part 0); dequantize(part 1); ...]^T -> [M, sum of N]: a fused q/k/v or gate/up whose
    parts keep their own types (qtypes: comma-separated). For the integer and int8 mma kernels' row counts x is
    quantized once and every part writes its columns of one output; otherwise the parts' products are
    concatenated."""
    return _parts_product(x.contiguous(), qweights, qtypes.split(","), k)


def _parts_product(x: Tensor, qweights: list[Tensor], types: list[str], k: int) -> Tensor:
    if _in_chunks(x, types, k):
        return _chunked(lambda rows: _parts_product(rows, qweights, types, k), x)
    route = _route(x, types, k)
    if route == "gemv":
        return gguf_gemv.gemv_parts(x, qweights, types, k)
    if route == "mma":
        return gguf_mma.matmul_parts(x, qweights, types, k)
    return torch.cat([_product(x, w, q, k) for w, q in zip(qweights, types)], dim=-1)


@gguf_matmul_parts.register_fake
def _(x: Tensor, qweights: list[Tensor], qtypes: str, k: int) -> Tensor:
    return x.new_empty(x.shape[0], sum(w.shape[0] for w in qweights))


@torch.library.custom_op("flashdraft::gguf_matmul_partials", mutates_args=())
def gguf_matmul_partials(x: Tensor, qweights: list[Tensor], qtypes: str, k: int) -> list[Tensor]:
    """gguf_matmul_parts' products left as each part's partial sums [splits, M, N] over the splits of K (int64 fixed
    point from the integer and mma kernels, float32 from the tensor-core kernel; one split: the product in x's
    dtype), for a torch.compile graph to add (split_k.add_splits) inside the kernel that reads them, in place of
    sum launches."""
    types = qtypes.split(",")
    for w, q in zip(qweights, types):
        _check(w, q, k)
    x = x.contiguous()
    if _in_chunks(x, types, k):  # one "split" per part: its product
        return [p.contiguous() for p in _parts_product(x, qweights, types, k)[None].split([w.shape[0] for w in qweights], dim=-1)]
    route = _route(x, types, k)
    if route == "gemv":
        return gguf_gemv.gemv_parts(x, qweights, types, k, summed=False)
    if route == "mma":
        return gguf_mma.matmul_parts(x, qweights, types, k, summed=False)
    return [_dot(x, w, q, k, summed=False) for w, q in zip(qweights, types)]


@gguf_matmul_partials.register_fake
def _(x: Tensor, qweights: list[Tensor], qtypes: str, k: int) -> list[Tensor]:
    exact = _route(x, qtypes.split(","), k) != "dot"
    return [x.new_empty(count, x.shape[0], w.shape[0], dtype=split_k.partial_dtype(x, count, exact))
            for w, count in zip(qweights, split_counts(x, qweights, qtypes.split(","), k))]


def split_counts(x: Tensor, qweights: list[Tensor], qtypes: list[str], k: int) -> list[int]:
    """How many partial sums `gguf_matmul_partials` returns for each part (shapes and device only: fake tensors
    do)."""
    if _in_chunks(x, qtypes, k):
        return [1] * len(qweights)
    route = _route(x, qtypes, k)
    if route == "mma":
        return [gguf_mma.splits_for(w.shape[0], k, q, x.shape[0])[0] for w, q in zip(qweights, qtypes)]
    if route == "gemv":
        return [gguf_gemv.splits_for(w.shape[0], k, gguf_gemv.config(q, k))[0] for w, q in zip(qweights, qtypes)]
    return [splits_for(w.shape[0], k)[0] for w in qweights]


def dequantize_gguf(qweight: Tensor, qtype: str, k: int, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
    """qweight [N, bytes] -> [N, K] in dtype (into `out` when given: a reused scratch buffer)."""
    _check(qweight, qtype, k)
    n = qweight.shape[0]
    out = torch.empty(n, k, device=qweight.device, dtype=dtype) if out is None else out[:n * k].view(n, k)
    block_n = 16
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, CHUNK))](qweight, out, n, k,
                                                              qweight.stride(0), out.stride(0),
                                                              QTYPE=TYPE_IDS[qtype], CHUNK_BYTES=chunk_bytes(qtype),
                                                              BLOCK_N=block_n)
    return out
