"""Integer dot products for a few rows of x against GGUF weights of the 4-, 5-, 6- and 8-bit types (decode, verify and
draft steps): the shape of llama.cpp's mmvq, written for Triton.

x is first quantized to 8 bits (`quantize_rows`: int8 packed four to an int32 word, a float scale per 32 values
or, for the K types, IQ4_XS and Q8_0's rows of whole 256-groups, per 256 (`x_group`), and the scaled sum per 32
values). The weight kernels then read each row's bytes as 32-bit words, mask the 4-, 5- or 6-bit fields out of a
word four at a time, and multiply them with x's bytes by `dp4a` (four int8 products summed into an int32), so a
weight costs about a quarter of an instruction per row of x instead of an unpack, a conversion and a multiply.
Where x has one scale a super-block (rounded per 256) a super-block's sub-block products times their integer
scales are summed exactly in int32 and converted once, with the minimum's term dmin * sum(m * sum(x)) (k_value);
the 32-weight types' scales apply per 32 weights. Each super-block's (or block's) float32 value is added to int64
fixed-point sums (kernels/split_k.to_fixed), exactly, so the order does not matter: each row of x goes through the
same instructions whatever the row count (1-16), and the int8 mma kernels (kernels/gguf_mma.py: 3-16 rows, K tiled
otherwise) compute the same values, so a token's result has the same bits whichever kernel and row count computes
it (a decoded row and a verified block: greedy speculation is lossless).

The IQ4 types map each nibble through a 16-entry int8 table (kvalues_iq4nl) by byte permutes (PRMT), eight
nibbles in six of them (x quantized in the lookup's order), so their words also go to `dp4a`.

Layouts: ggml-common.h's block_q4_0 ... block_q8_0, block_iq4_nl, block_q4_K, block_q5_K, block_q6_K (kept padded
to 212 bytes, so every block starts on a word) and block_iq4_xs. Q8_0, IQ4_XS and the 32-weight block types are
kept in planes by field (quant/ggml.field_planes: values, then fifth bits, then scales; the same bytes), so
their values are read as aligned words. Q2_K/Q3_K keep the tensor-core kernel.

Launched with programmatic dependent launch on Hopper (kernels/pdl.py): a program issues its weight loads before it
waits for the kernel that wrote x, and lets the next kernel be placed at the end of an iteration, past that wait
(right after the wait, Q4_K and Q5_K took 8-13 more registers under Triton 3.6 for sm_90).
"""
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from flashdraft.kernels import pdl, split_k
from flashdraft.kernels.iq4 import iq4_nibbles, iq4_table, iq4_table_words
from flashdraft.kernels.pdl import start_dependents, wait_for_inputs
from flashdraft.kernels.split_k import from_fixed, to_fixed
from flashdraft.quant.ggml import FIELD_PLANES

QK8 = 32  # x values per 8-bit block
GEMV_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
BLOCK32_IDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "IQ4_NL": 20}  # GGML type ids
# Row counts from gguf_mma.MIN_ROWS take the int8 mma kernels where they cover the type, else up to MAX_ROWS these (each
# row of x costs the integer kernels its own dot products and reductions: H200, the 8B's four matrices, Q4_K: 0.065 ms
# for one row, 0.345 ms for 16, against 0.150 and 0.155 for a tensor-core kernel; docs/perf-history.md, 2026-12-03
# H200), else these kernels up to ROWS, in groups of MAX_ROWS rows on the grid's third axis: a verified row then has
# the bits of the same row decoded alone.
MAX_ROWS = 4
ROWS = 16
ROW_BUCKETS = (1, 2, 4, 8, 16)  # the kernels are compiled per bucket: rows of x are unrolled

# tile: BLOCK_N output rows x SB super-blocks (the 32-weight types: 8-block groups) per iteration; chosen on an H200
# by benchmarks/kernels/gguf_kernels.py --gemv-sweep.
# (software-pipelined loads, tl.range num_stages 2-3, ran slower at every tile: H200, 2026-12-04).
CONFIG = {"BLOCK_N": 4, "SB": 16, "num_warps": 4, "target_programs": 2112}
# Q6_K: 0.195 ms against 0.218 (8B + Gemma shapes; H200, 2026-12-04); IQ4_XS 8 x 8 with its nibbles by lane: the 8B's
# decode step 2.921-2.933 ms against 3.158 at 16 x 8, 3.014 at 16 x 4, 3.254 at 8 x 16 (H100, 2026-12-06;
# in the file's order 16 x 8 had won, 3.010 against 3.049 at 8 x 8). IQ4_NL: not swept.
# maxnreg: the register count the kernel had when timed (unmasked loads took Q8_0 94 -> 108 under Triton 3.6 for
# sm_90, no spills at the cap: fewer programs per SM otherwise).
TYPE_CONFIGS = {"Q6_K": dict(CONFIG, BLOCK_N=8, SB=8), "IQ4_XS": dict(CONFIG, BLOCK_N=8, SB=8),
                "Q8_0": dict(CONFIG, maxnreg=96)}
# small tiles: the CPU tests' shapes
INTERPRETED = {"BLOCK_N": 64, "SB": 1, "num_warps": 1, "target_programs": 64}


def _emulate() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dp4a(a, b, EMULATE: tl.constexpr):
    """Sum of the four signed byte products of int32 words a and b."""
    if EMULATE:
        s = ((a << 24) >> 24) * ((b << 24) >> 24)
        s += ((a << 16) >> 24) * ((b << 16) >> 24)
        s += ((a << 8) >> 24) * ((b << 8) >> 24)
        s += (a >> 24) * (b >> 24)
    else:
        s = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, tl.zeros_like(a)],
                                      dtype=tl.int32, is_pure=True, pack=1)
    return s


@triton.jit
def _half(bits):
    """The low 16 bits of int32 `bits` as an fp16 value -> float32."""
    return (bits & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, d_ptr, s_ptr, K, stride_x, stride_q, stride_qb, stride_d, BLOCKS: tl.constexpr,
                     ORDER: tl.constexpr, STEP: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr):
    """x [M, K] -> q [M, K / 4] int32 (four int8 per word; a row's blocks stride_qb words apart), d [M, K / 32]
    scales, s [M, K / 32] = sum(q) as float32 (exact; STEP floats apart: 2 writes them side by side). One scale per GROUP (32 or
    256) values: per 256 every block of a group gets the same d.
    ORDER 0: each block's values in order; IQ4_ORDER: word 2t holds values 4t, 16 + 4t, 4t + 1, 17 + 4t and word
    2t + 1 values 4t + 2, 18 + 4t, 4t + 3, 19 + 4t (the order `iq4_nibbles` gives a weight word's values)."""
    wait_for_inputs(PDL)
    start_dependents(PDL)
    m = tl.program_id(0)
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    ok = b < K // 32
    w, byte = tl.arange(0, 8), tl.arange(0, 4)
    if ORDER == 0:
        within = w[:, None] * 4 + byte[None, :]
    else:
        within = 4 * (w[:, None] // 2) + 2 * (w[:, None] % 2) + byte[None, :] // 2 + 16 * (byte[None, :] % 2)
    col = b[:, None, None] * 32 + within[None, :, :]
    x = tl.load(x_ptr + m * stride_x + col, mask=ok[:, None, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)
    if GROUP == 256:  # the largest of each 8 blocks, for all 8
        PER: tl.constexpr = BLOCKS // 8
        amax = tl.reshape(tl.broadcast_to(tl.max(tl.reshape(amax, [PER, 8]), axis=1)[:, None], [PER, 8]), [BLOCKS])
    d = amax / 127.0
    inv = tl.where(d > 0, 1.0 / tl.where(d > 0, d, 1.0), 0.0)
    q = tl.floor(x * inv[:, None, None] + 0.5).to(tl.int32)
    q = tl.minimum(tl.maximum(q, -127), 127)
    words = tl.sum((q & 0xFF) << (byte * 8)[None, None, :], axis=2)
    tl.store(q_ptr + m * stride_q + b[:, None] * stride_qb + w[None, :], words, mask=ok[:, None])
    tl.store(d_ptr + m * stride_d + b * STEP, d, mask=ok)
    tl.store(s_ptr + m * stride_d + b * STEP, tl.sum(tl.sum(q, axis=2), axis=1).to(tl.float32), mask=ok)


IQ4_ORDER = 1  # quantize_rows' order for the IQ4 kernels
IQ4_TYPES = ("IQ4_NL", "IQ4_XS")


# x's rounding group per weight type: the types whose blocks are 256 weights with small integer sub-block scales round x
# per 256 (llama.cpp's CPU Q8_K), so the int8 mma kernels sum a super-block's sub-block products in int32 and convert
# once (docs/perf-history.md, 2026-12-05 CPU: per 256 costs what per 32 costs in KL); Q8_0 too where a row is whole
# groups of 256 (its mma kernel then scales x once per 8 blocks); the other 32-weight types round per 32. Decode and
# verify round alike, so a token's greedy choice does not depend on which computed it.
GROUP_256 = ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS")


def x_group(qtype: str, k: int) -> int:
    return 256 if qtype in GROUP_256 or (qtype == "Q8_0" and k % 256 == 0) else QK8


def quantize_rows(x: Tensor, order: int = 0, group: int = QK8) -> tuple[Tensor, Tensor, Tensor]:
    """x [M, K] -> (q [M, K / 4] int32, d [M, K / 32], s [M, K / 32]: each block's scale and the sum of its
    values) as `_quantize_kernel` writes them."""
    m, k = x.shape
    d = torch.empty(m, k // QK8, device=x.device, dtype=torch.float32)
    s = torch.empty_like(d)
    q = torch.empty(m, k // 4, device=x.device, dtype=torch.int32)
    return _quantize_into(x, q, q.stride(0), 8, d, s, order, 1, group), d, s


def quantize_rows_paired(x: Tensor, group: int = QK8) -> tuple[Tensor, Tensor]:
    """x [M, K] -> (q [M, K / 4] int32, [M, K / 32] int64: each block's d and sum side by side, one 8-byte load)."""
    m, k = x.shape
    pairs = torch.empty(m, k // QK8, 2, device=x.device, dtype=torch.float32)
    q = torch.empty(m, k // 4, device=x.device, dtype=torch.int32)
    _quantize_into(x, q, q.stride(0), 8, pairs[..., 0], pairs[..., 1], 0, 2, group)
    return q, pairs.view(torch.int64)[..., 0]


TILE_ROWS = 16  # rows of x quantize_rows_tiled lays side by side


def quantize_rows_tiled(x: Tensor, group: int = QK8, order: int = 0) -> tuple[Tensor, Tensor]:
    """x [M <= 16, K] -> quantize_rows_paired's values and pairs with the rows of each block side by side: q [K / 32,
    16, 32] int8 (block b's 32 values of row m at q[b, m]), pairs [K / 32, 16] int64. The int8 mma kernels
    (kernels/gguf_mma.py) read a B fragment or a block's scales in one or two L1 wavefronts this way, where rows K
    apart took eight. Rows past M are left unwritten."""
    m, k = x.shape
    assert m <= TILE_ROWS, m
    q = torch.empty(k // QK8, TILE_ROWS, QK8, device=x.device, dtype=torch.int8)
    pairs = torch.empty(k // QK8, TILE_ROWS, 2, device=x.device, dtype=torch.float32)
    _quantize_into(x, q.view(torch.int32), 8, 8 * TILE_ROWS, pairs[..., 0].T, pairs[..., 1].T, order, 2 * TILE_ROWS,
                   group)
    return q, pairs.view(torch.int64)[..., 0]


def _quantize_into(x: Tensor, q: Tensor, stride_q: int, stride_qb: int, d: Tensor, s: Tensor, order: int,
                   step: int, group: int) -> Tensor:
    m, k = x.shape
    assert group == QK8 or k % group == 0, (k, group)
    blocks = 16
    _quantize_kernel[(m, triton.cdiv(k // QK8, blocks))](x, q, d, s, k, x.stride(0), stride_q, stride_qb,
                                                          d.stride(0), BLOCKS=blocks, ORDER=order, STEP=step,
                                                          GROUP=group, **pdl.launch(x))
    return q


@triton.jit
def _k_scale_bytes(a, b, c, i):
    """Q4_K/Q5_K's 6-bit scale and min of sub-block i (a tensor of 0..7), int32, from the 12 scale bytes as words a,
    b, c (each [..., 1]): ggml's get_scale_min_k4."""
    lo = i < 4
    sh = (i % 4) * 8  # sub-blocks 0-3 and 4-7 are the bytes of two words (llama.cpp's word form)
    sc = (tl.where(lo, a & 0x3F3F3F3F, (c & 0x0F0F0F0F) | ((a >> 2) & 0x30303030)) >> sh) & 0xFF
    mn = (tl.where(lo, b & 0x3F3F3F3F, ((c >> 4) & 0x0F0F0F0F) | ((b >> 2) & 0x30303030)) >> sh) & 0xFF
    return sc, mn


@triton.jit
def _row_tile(N, BLOCK_N: tl.constexpr, BM: tl.constexpr):
    """A program's output rows (axis 0 of the grid; axis 1 is its split of K) and their accumulator:
    (split, rows, row_ok, w_rows = the weight rows it reads, mi = the rows of x [BM], acc [BM, BLOCK_N] in int64
    fixed point, kernels/split_k.to_fixed: each super-block's (or block's) value added exactly, in any order).
    Loads take no row masks (a masked load costs a zeroed register and a predicate): rows past N read row N - 1
    (w_rows), rows of x past M read row M - 1 (`_x_row`), and `_store_rows` leaves both out."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    return (tl.program_id(1), rows, rows < N, tl.minimum(rows, N - 1), tl.arange(0, BM),
            tl.zeros([BM, BLOCK_N], tl.int64))


@triton.jit
def _row_group(xq_ptr, xd_ptr, xs_ptr, out_ptr, M, stride_xq, stride_xd, stride_om, BM: tl.constexpr,
               GROUPS: tl.constexpr):
    """GROUPS: rows of x in groups of BM on the grid's third axis (a verify block's rows in parallel programs, not
    unrolled in one): this group's x, scales, sums and output rows, and how many rows it has left."""
    if GROUPS:
        g = tl.program_id(2) * BM
        xq_ptr += tl.multiple_of(g * stride_xq, 8)  # K / 4 words a row, K a multiple of 32
        xd_ptr += g * stride_xd
        xs_ptr += g * stride_xd
        out_ptr += g * stride_om
        M -= g
    return xq_ptr, xd_ptr, xs_ptr, out_ptr, M


@triton.jit
def _x_row(m: tl.constexpr, M):
    """The row of x that unrolled row m reads: m, or M - 1 past the rows there are (row 0 is always there: a
    constant keeps its loads' alignment known, so they stay 16-byte loads)."""
    return 0 if m == 0 else tl.minimum(tl.zeros([1], tl.int32) + m, M - 1)  # a tensor, also under the interpreter


@triton.jit
def _split_range(s, last, WHOLE: tl.constexpr):
    """(the super-blocks (or blocks) s an iteration reads, a float 1 or 0 for each): s and 1 where every split is whole
    iterations (WHOLE, from the matrix's shape); else s clamped into the split, those past its end read again and
    weighted 0 (their scales zeroed). Either way no load takes a mask (a masked load costs a zeroed register and
    a predicate)."""
    keep = tl.full(s.shape, 1.0, tl.float32)
    if not WHOLE:
        keep = (s < last).to(tl.float32)
        s = tl.minimum(s, last - 1)
    return s, keep


@triton.jit
def _add_row(acc, mi, m, contrib):
    """acc with contrib [BLOCK_N] added to row m of x's (rows of x are unrolled: m is a constant)."""
    return tl.where(mi[:, None] == m, acc + contrib[None, :], acc)


@triton.jit
def _store_rows(out_ptr, acc, split, stride_os, stride_om, mi, M, rows, row_ok):
    """acc as int64 partial sums, or (one split) the product in out's float dtype."""
    if out_ptr.dtype.element_ty != tl.int64:
        acc = from_fixed(acc)
    tl.store(out_ptr + split * stride_os + mi[:, None] * stride_om + rows[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(mi < M)[:, None] & row_ok[None, :])


@triton.jit
def k_value(isum, d, xd, msum, dmin):
    """A Q4_K/Q5_K super-block's value, the one formula every route takes (kernels/gguf_mma.py too): the exact sums
    isum = sum(sc * (w . x)) and msum = sum(m * sum(x)) scaled, float32, with one explicit fused multiply-add (an
    implicit contraction could differ between kernels)."""
    return tl.fma(isum.to(tl.float32), d * xd, -(msum * (dmin * xd)))


@triton.jit(do_not_specialize=["M", "stride_xq", "stride_xd", "stride_om"])
def _kquant_kernel(xq_ptr, xd_ptr, xs_ptr, w_ptr, out_ptr, M, N, K, sb_per_split, stride_xq, stride_xd, stride_wu,
                   stride_os, stride_om, FIVE_BITS: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr,
                   SB: tl.constexpr, ROW_ALIGN: tl.constexpr, WHOLE: tl.constexpr, EMULATE: tl.constexpr,
                   GROUPS: tl.constexpr, PDL: tl.constexpr):
    """Q4_K (144-byte super-blocks: d, dmin, 12 scale bytes, 128 nibble bytes) or Q5_K (176: the same with 32 bytes
    of fifth bits before the nibbles). w as int32 words; group g's 32 bytes hold sub-block 2g in their low nibbles
    and 2g + 1 in their high ones, stored as quant/ggml.lane_grouped keeps them: word 8p + 2g + j of the 32
    is group g's word 2p + j."""
    WORDS: tl.constexpr = 44 if FIVE_BITS else 36
    QS: tl.constexpr = 12 if FIVE_BITS else 4
    xq_ptr, xd_ptr, xs_ptr, out_ptr, M = _row_group(xq_ptr, xd_ptr, xs_ptr, out_ptr, M, stride_xq, stride_xd, stride_om, BM,
                                                    GROUPS)
    split, rows, row_ok, w_rows, mi, acc = _row_tile(N, BLOCK_N, BM)
    sbi, g, t = tl.arange(0, SB), tl.arange(0, 4), tl.arange(0, 8)
    first = split * sb_per_split
    last = tl.minimum(first + sb_per_split, K // 256)
    row_base = w_ptr + w_rows.to(tl.int64)[:, None] * (stride_wu * ROW_ALIGN)
    for s0 in range(first, last, SB):
        s = s0 + sbi
        s, keep = _split_range(s, last, WHOLE)
        base = row_base + s[None, :] * WORDS
        head = tl.load(base)
        d, dmin = _half(head) * keep[None, :], _half(head >> 16) * keep[None, :]
        a = tl.load(base + 1)[:, :, None]
        b = tl.load(base + 2)[:, :, None]
        c = tl.load(base + 3)[:, :, None]
        sc_lo, mn_lo = _k_scale_bytes(a, b, c, 2 * g[None, None, :])
        sc_hi, mn_hi = _k_scale_bytes(a, b, c, 2 * g[None, None, :] + 1)
        m_lo, m_hi = mn_lo.to(tl.float32), mn_hi.to(tl.float32)  # [N, SB, 4]
        # [N, SB, 4, 8]: stored word 8p + 2g + j, group g's word 2p + j
        words = tl.load(base[:, :, None, None] + QS + g[None, None, :, None] * 8 + t[None, None, None, :])
        # into group order in registers (no data movement): [N, SB, 4 (group), 8 (its words in order)]
        words = tl.reshape(tl.permute(tl.reshape(words, (BLOCK_N, SB, 4, 4, 2)), (0, 1, 3, 2, 4)), (BLOCK_N, SB, 4, 8))
        lo = words & 0x0F0F0F0F
        hi = (words >> 4) & 0x0F0F0F0F
        if FIVE_BITS:  # bit 2g of qh byte l is sub-block 2g's fifth bit for weight l, bit 2g + 1 sub-block 2g + 1's
            qh = tl.load(base[:, :, None] + 4 + t[None, None, :])[:, :, None, :]
            sh = 2 * g[None, None, :, None]
            lo = lo | (((qh >> sh) & 0x01010101) << 4)
            hi = hi | (((qh >> (sh + 1)) & 0x01010101) << 4)
        wait_for_inputs(PDL)  # x only after the weight loads are issued
        for m in tl.static_range(BM):
            xm = _x_row(m, M)
            xw = xq_ptr + xm * stride_xq + s[:, None, None] * 64 + g[None, :, None] * 16 + t[None, None, :]
            x_lo = tl.load(xw)  # [SB, 4, 8]
            x_hi = tl.load(xw + 8)
            isum = tl.sum(sc_lo * tl.sum(_dp4a(lo, x_lo[None], EMULATE), axis=3) +
                          sc_hi * tl.sum(_dp4a(hi, x_hi[None], EMULATE), axis=3), axis=2)  # [N, SB]
            xd = tl.load(xd_ptr + xm * stride_xd + s * 8)[None, :]  # [1, SB]
            xb = xm * stride_xd + s[:, None] * 8 + 2 * g[None, :]
            # sum(m * sum(x)): small integers, exact in float32 in any order
            msum = tl.sum(m_lo * tl.load(xs_ptr + xb)[None] + m_hi * tl.load(xs_ptr + xb + 1)[None], axis=2)
            acc = _add_row(acc, mi, m, tl.sum(to_fixed(k_value(isum, d, xd, msum, dmin)), axis=1))
        start_dependents(PDL)
    wait_for_inputs(PDL)  # (also where a program had no iterations)
    _store_rows(out_ptr, acc, split, stride_os, stride_om, mi, M, rows, row_ok)


@triton.jit
def _signed6(v):
    """Bytes of v in 0..63 -> the signed bytes v - 32, four at a time (no borrow crosses a byte: bit 5 set means
    v - 32 = v & 31, clear means v - 32 + 256 = v | 0xE0)."""
    return (v & 0x1F1F1F1F) | (((~v) & 0x20202020) * 7)


@triton.jit
def _q6_scales(pair):
    """Two int8 scales in an int16 (sign-extended to int32) [N, SB, 2] -> the scales [N, SB, 2, 2], int32 (low byte
    for weights 0..15 of the 32, high byte for 16..31)."""
    u = tl.arange(0, 2)[None, None, None, :]
    p = pair[:, :, :, None]
    return tl.where(u == 1, (p << 16) >> 24, (p << 24) >> 24)


@triton.jit
def _dot16(v, x, EMULATE: tl.constexpr):
    """[N, SB, 2, 2, 4] words . [SB, 2, 2, 4] words -> [N, SB, 2, 2] int32 (16 products each)."""
    return tl.sum(_dp4a(v, x[None], EMULATE), axis=4)


@triton.jit(do_not_specialize=["M", "stride_xq", "stride_xd", "stride_om"])
def _q6_k_kernel(xq_ptr, xd_ptr, xs_ptr, w_ptr, w16_ptr, out_ptr, M, N, K, sb_per_split, stride_xq, stride_xd,
                 stride_wu, stride_os, stride_om, BM: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr,
                 ROW_ALIGN: tl.constexpr, WHOLE: tl.constexpr, EMULATE: tl.constexpr, GROUPS: tl.constexpr,
                 PDL: tl.constexpr):
    """Q6_K: 210-byte super-blocks (ql 128 bytes, qh 64, 16 int8 scales, d) kept padded to 212 bytes (53 words;
    layers/quantized.py), read as int32 words (w_ptr) and, for the scales and d, as int16 halves (w16_ptr).
    Half h's weight 128h + 32k + l (k = 0..3, l = 0..31) is ql[64h + l + 32 (k & 1)]'s low (k < 2) or high
    nibble with bits 2k..2k+1 of qh[32h + l] above it, minus 32; scale index 8h + 2k + l // 16. Words are
    indexed [h, u, v] with l = 16u + 4v."""
    xq_ptr, xd_ptr, xs_ptr, out_ptr, M = _row_group(xq_ptr, xd_ptr, xs_ptr, out_ptr, M, stride_xq, stride_xd, stride_om, BM,
                                                    GROUPS)
    split, rows, row_ok, w_rows, mi, acc = _row_tile(N, BLOCK_N, BM)
    sbi = tl.arange(0, SB)
    h = tl.arange(0, 2)[None, None, :, None, None]
    u = tl.arange(0, 2)[None, None, None, :, None]
    v = tl.arange(0, 4)[None, None, None, None, :]
    first = split * sb_per_split
    last = tl.minimum(first + sb_per_split, K // 256)
    row_words = w_rows.to(tl.int64)[:, None] * (stride_wu * ROW_ALIGN)
    for s0 in range(first, last, SB):
        s = s0 + sbi
        s, keep = _split_range(s, last, WHOLE)
        block_words = row_words + s[None, :] * 53  # [N, SB]
        base = w16_ptr + 2 * block_words  # int16 pointers
        d = _half(tl.load(base + 104).to(tl.int32)) * keep[None, :]
        b5 = w_ptr + block_words[:, :, None, None, None]
        word = h * 16 + u * 4 + v  # word of ql bytes 64h + 16u + 4v
        A = tl.load(b5 + word)  # [N, SB, 2, 2, 4]
        B = tl.load(b5 + word + 8)  # ql bytes 64h + 32 + 16u + 4v
        H = tl.load(b5 + 32 + h * 8 + u * 4 + v)  # qh bytes 32h + 16u + 4v
        v0 = _signed6((A & 0x0F0F0F0F) | ((H << 4) & 0x30303030))
        v1 = _signed6((B & 0x0F0F0F0F) | ((H << 2) & 0x30303030))
        v2 = _signed6(((A >> 4) & 0x0F0F0F0F) | (H & 0x30303030))
        v3 = _signed6(((B >> 4) & 0x0F0F0F0F) | ((H >> 2) & 0x30303030))
        # scales 8h + 2k and 8h + 2k + 1: int16 half 96 + 4h + k
        sp = base[:, :, None] + 96 + tl.arange(0, 2)[None, None, :] * 4
        sc0 = _q6_scales(tl.load(sp).to(tl.int32))
        sc1 = _q6_scales(tl.load(sp + 1).to(tl.int32))
        sc2 = _q6_scales(tl.load(sp + 2).to(tl.int32))
        sc3 = _q6_scales(tl.load(sp + 3).to(tl.int32))
        wait_for_inputs(PDL)  # x only after the weight loads are issued
        for m in tl.static_range(BM):
            xm = _x_row(m, M)
            xw = (xq_ptr + xm * stride_xq + s[:, None, None, None] * 64 + tl.arange(0, 2)[None, :, None, None] * 32 +
                  tl.arange(0, 2)[None, None, :, None] * 4 + tl.arange(0, 4)[None, None, None, :])  # [SB, 2, 2, 4]
            isum = (sc0 * _dot16(v0, tl.load(xw), EMULATE) + sc1 * _dot16(v1, tl.load(xw + 8), EMULATE) +
                    sc2 * _dot16(v2, tl.load(xw + 16), EMULATE) + sc3 * _dot16(v3, tl.load(xw + 24), EMULATE))
            xd = tl.load(xd_ptr + xm * stride_xd + s * 8)[None, :]  # [1, SB]
            value = d * xd * tl.sum(tl.sum(isum, axis=3), axis=2).to(tl.float32)
            acc = _add_row(acc, mi, m, tl.sum(to_fixed(value), axis=1))
        start_dependents(PDL)
    wait_for_inputs(PDL)  # (also where a program had no iterations)
    _store_rows(out_ptr, acc, split, stride_os, stride_om, mi, M, rows, row_ok)


@triton.jit
def _spread_bits(nib):
    """Four bits (0..15) -> bit 4 of each byte of a word (bit i to byte i): the fifth bits of Q5_0/Q5_1."""
    return ((nib * 0x00204081) & 0x01010101) << 4


@triton.jit(do_not_specialize=["M", "stride_xq", "stride_xd", "stride_om"])
def _block32_kernel(xq_ptr, xd_ptr, xs_ptr, w_ptr, w16_ptr, lut_ptr, out_ptr, M, N, K, sb_per_split, stride_xq,
                    stride_xd, stride_wu, stride_os, stride_om, QTYPE: tl.constexpr, BM: tl.constexpr,
                    BLOCK_N: tl.constexpr, SB: tl.constexpr, ROW_ALIGN: tl.constexpr, WHOLE: tl.constexpr,
                    EMULATE: tl.constexpr, GROUPS: tl.constexpr,
                    PDL: tl.constexpr):
    """The 32-weight nibble block types as quant/ggml.field_planes keeps them, w as int32 words (w16: the
    same bytes as int16): a row's blocks' 16 nibble bytes (4 words each), then (Q5_0, Q5_1) their 32 fifth bits (a
    word each), then their fp16 d (and m). Q4_0, Q4_1 (d, m), Q5_0, Q5_1 (d, m), IQ4_NL (each nibble an index into
    iq4.IQ4_VALUES). A nibble byte l's low half is weight l, its high one weight l + 16; fifth bit j belongs to
    weight j. Q4_0 / Q5_0 store q + 8 / q + 16; Q4_1 / Q5_1 add m. SB counts groups of 8 blocks (one super-block's
    worth). lut_ptr: the IQ4 table as four int32 words."""
    TABLE: tl.constexpr = QTYPE == 20
    HAS_MIN: tl.constexpr = QTYPE == 3 or QTYPE == 7
    FIVE: tl.constexpr = QTYPE == 6 or QTYPE == 7
    OFFSET: tl.constexpr = 0.0 if HAS_MIN or TABLE else (16.0 if FIVE else 8.0)
    t0, t1, t2, t3 = iq4_table_words(lut_ptr)
    xq_ptr, xd_ptr, xs_ptr, out_ptr, M = _row_group(xq_ptr, xd_ptr, xs_ptr, out_ptr, M, stride_xq, stride_xd, stride_om, BM,
                                                    GROUPS)
    split, rows, row_ok, w_rows, mi, acc = _row_tile(N, BLOCK_N, BM)
    bi, t = tl.arange(0, SB * 8), tl.arange(0, 4)
    blocks = K // 32
    first = split * sb_per_split * 8
    last = tl.minimum(first + sb_per_split * 8, blocks)
    row_words = w_ptr + w_rows.to(tl.int64)[:, None] * (stride_wu * ROW_ALIGN)
    row_scales = w16_ptr + w_rows.to(tl.int64)[:, None] * (stride_wu * ROW_ALIGN * 2) + (8 + 2 * FIVE) * blocks
    for b0 in range(first, last, SB * 8):
        b = b0 + bi
        b, keep = _split_range(b, last, WHOLE)
        d = _half(tl.load(row_scales + (1 + HAS_MIN) * b[None, :]).to(tl.int32)) * keep[None, :]
        words = tl.load(row_words[:, :, None] + 4 * b[None, :, None] + t[None, None, :])  # [N, B, 4]
        if TABLE:
            lo, hi = iq4_nibbles(words, lut_ptr, t0, t1, t2, t3, EMULATE)
        else:
            lo = words & 0x0F0F0F0F
            hi = (words >> 4) & 0x0F0F0F0F
        if FIVE:
            qh = tl.load(row_words + 4 * blocks + b[None, :])[:, :, None]
            lo = lo | _spread_bits((qh >> (4 * t[None, None, :])) & 15)
            hi = hi | _spread_bits((qh >> (16 + 4 * t[None, None, :])) & 15)
        if HAS_MIN:
            dm = _half(tl.load(row_scales + 2 * b[None, :] + 1).to(tl.int32)) * keep[None, :]
        else:
            dm = -OFFSET * d
        wait_for_inputs(PDL)  # x only after the weight loads are issued
        for m in tl.static_range(BM):
            xm = _x_row(m, M)
            if TABLE:  # x in IQ4_ORDER: words 2t, 2t + 1 meet weight word t's two lookups
                xw = xq_ptr + xm * stride_xq + b[:, None] * 8 + 2 * t[None, :]
                x_lo = tl.load(xw)[None]
                x_hi = tl.load(xw + 1)[None]
            else:
                xw = xq_ptr + xm * stride_xq + b[:, None] * 8 + t[None, :]
                x_lo = tl.load(xw)[None]
                x_hi = tl.load(xw + 4)[None]
            xd = tl.load(xd_ptr + xm * stride_xd + b)[None, :]
            dot = tl.sum(_dp4a(lo, x_lo, EMULATE) + _dp4a(hi, x_hi, EMULATE), axis=2).to(tl.float32)
            if TABLE:
                value = d * xd * dot
            else:
                xs = tl.load(xs_ptr + xm * stride_xd + b)[None, :]
                value = d * xd * dot + dm * (xd * xs)
            acc = _add_row(acc, mi, m, tl.sum(to_fixed(value), axis=1))
        start_dependents(PDL)
    wait_for_inputs(PDL)  # (also where a program had no iterations)
    _store_rows(out_ptr, acc, split, stride_os, stride_om, mi, M, rows, row_ok)


@triton.jit
def _eighths(v, N: tl.constexpr, SB: tl.constexpr):
    """[N, SB * 8] -> its eight [N, SB] slices j (element 8s + j), in order."""
    e, o = tl.split(tl.reshape(v, (N, SB, 4, 2)))
    ee, eo = tl.split(tl.reshape(e, (N, SB, 2, 2)))
    oe, oo = tl.split(tl.reshape(o, (N, SB, 2, 2)))
    v0, v4 = tl.split(ee)
    v2, v6 = tl.split(eo)
    v1, v5 = tl.split(oe)
    v3, v7 = tl.split(oo)
    return v0, v1, v2, v3, v4, v5, v6, v7


@triton.jit
def q8_0_chain(part, p, d, J: tl.constexpr):
    """A Q8_0 super-block's sum over its blocks, the order every route takes (kernels/gguf_mma.py too): block 0's
    product p * d, then a fused multiply-add for each next block."""
    if J == 0:
        part = p * d
    else:
        part = tl.fma(p, d, part)
    return part


@triton.jit
def _q8_0_super_blocks(dot, d, N: tl.constexpr, SB: tl.constexpr):
    """Each super-block's sum of its 8 blocks' dot * d (dot, d: [N, SB * 8]) -> [N, SB], by q8_0_chain."""
    p0, p1, p2, p3, p4, p5, p6, p7 = _eighths(dot, N, SB)
    d0, d1, d2, d3, d4, d5, d6, d7 = _eighths(d, N, SB)
    part = q8_0_chain(p0, p0, d0, 0)
    part = q8_0_chain(part, p1, d1, 1)
    part = q8_0_chain(part, p2, d2, 2)
    part = q8_0_chain(part, p3, d3, 3)
    part = q8_0_chain(part, p4, d4, 4)
    part = q8_0_chain(part, p5, d5, 5)
    part = q8_0_chain(part, p6, d6, 6)
    return q8_0_chain(part, p7, d7, 7)


@triton.jit(do_not_specialize=["M", "stride_xq", "stride_xd", "stride_om"])
def _q8_0_kernel(xq_ptr, xd_ptr, xs_ptr, w_ptr, w16_ptr, out_ptr, M, N, K, sb_per_split, stride_xq, stride_xd,
                 stride_wu, stride_os, stride_om, X256: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr,
                 SB: tl.constexpr, ROW_ALIGN: tl.constexpr, WHOLE: tl.constexpr, EMULATE: tl.constexpr,
                 GROUPS: tl.constexpr,
                 PDL: tl.constexpr):
    """Q8_0 in two planes (quant/ggml.field_planes): w as int32 words, a row's K / 4 words of int8 values,
    then its K / 32 fp16 scales (w16: the same bytes as int16). SB counts groups of 8 blocks. X256: x rounded per
    256 (one scale for 8 blocks): a super-block's blocks summed as the int8 mma kernel sums them (q8_0_chain)."""
    xq_ptr, xd_ptr, xs_ptr, out_ptr, M = _row_group(xq_ptr, xd_ptr, xs_ptr, out_ptr, M, stride_xq, stride_xd, stride_om, BM,
                                                    GROUPS)
    split, rows, row_ok, w_rows, mi, acc = _row_tile(N, BLOCK_N, BM)
    bi, t = tl.arange(0, SB * 8), tl.arange(0, 8)
    first = split * sb_per_split * 8
    last = tl.minimum(first + sb_per_split * 8, K // 32)
    row_words = w_ptr + w_rows.to(tl.int64)[:, None] * (stride_wu * ROW_ALIGN)
    row_scales = w16_ptr + w_rows.to(tl.int64)[:, None] * (stride_wu * ROW_ALIGN * 2) + K // 2
    for b0 in range(first, last, SB * 8):
        b = b0 + bi
        b, keep = _split_range(b, last, WHOLE)
        d = _half(tl.load(row_scales + b[None, :]).to(tl.int32)) * keep[None, :]  # [N, B]
        words = tl.load(row_words[:, :, None] + b[None, :, None] * 8 + t[None, None, :])  # [N, B, 8]
        wait_for_inputs(PDL)  # x only after the weight loads are issued
        for m in tl.static_range(BM):
            xm = _x_row(m, M)
            x = tl.load(xq_ptr + xm * stride_xq + b[:, None] * 8 + t[None, :])
            dot = tl.sum(_dp4a(words, x[None], EMULATE), axis=2).to(tl.float32)
            if X256:
                s = tl.minimum(b0 // 8 + tl.arange(0, SB), last // 8 - 1)  # past the split: d is 0 there
                value = _q8_0_super_blocks(dot, d, BLOCK_N, SB) * tl.load(xd_ptr + xm * stride_xd + s * 8)[None, :]
            else:
                value = d * tl.load(xd_ptr + xm * stride_xd + b)[None, :] * dot
            acc = _add_row(acc, mi, m, tl.sum(to_fixed(value), axis=1))
        start_dependents(PDL)
    wait_for_inputs(PDL)  # (also where a program had no iterations)
    _store_rows(out_ptr, acc, split, stride_os, stride_om, mi, M, rows, row_ok)


@triton.jit(do_not_specialize=["M", "stride_xq", "stride_xd", "stride_om"])
def _iq4_xs_kernel(xq_ptr, xd_ptr, xs_ptr, w_ptr, lut_ptr, out_ptr, M, N, K, sb_per_split, stride_xq, stride_xd,
                   stride_wu, stride_os, stride_om, BM: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr,
                   ROW_ALIGN: tl.constexpr, WHOLE: tl.constexpr, EMULATE: tl.constexpr, GROUPS: tl.constexpr,
                   PDL: tl.constexpr):
    """IQ4_XS in two planes (quant/ggml.field_planes), w as int32 words: a row's super-blocks' 128 nibble
    bytes (32 words each, by lane: sub-block j's word t at 8t + j, quant/ggml.by_lane), then their 8-byte
    headers (d and scales_h, scales_l: two words each). Sub-block j (32 weights) has 6-bit scale ls = nibble j of
    scales_l | bits 2j..2j+1 of scales_h << 4, weight d * (ls - 32) * iq4.IQ4_VALUES[q]; its 16 bytes hold weights
    0..15 in their low nibbles, 16..31 in the high."""
    t0, t1, t2, t3 = iq4_table_words(lut_ptr)
    xq_ptr, xd_ptr, xs_ptr, out_ptr, M = _row_group(xq_ptr, xd_ptr, xs_ptr, out_ptr, M, stride_xq, stride_xd, stride_om, BM,
                                                    GROUPS)
    split, rows, row_ok, w_rows, mi, acc = _row_tile(N, BLOCK_N, BM)
    sbi, j, t = tl.arange(0, SB), tl.arange(0, 8), tl.arange(0, 4)
    first = split * sb_per_split
    last = tl.minimum(first + sb_per_split, K // 256)
    row_base = w_ptr + w_rows.to(tl.int64)[:, None] * (stride_wu * ROW_ALIGN)
    for s0 in range(first, last, SB):
        s = s0 + sbi
        s, keep = _split_range(s, last, WHOLE)
        base = row_base + s[None, :] * 32
        header = row_base + K // 256 * 32 + s[None, :] * 2
        head = tl.load(header)  # [N, SB]
        scales_l = tl.load(header + 1)[:, :, None]
        jj = j[None, None, :]
        ls = (((scales_l >> (4 * jj)) & 15) | (((head[:, :, None] >> (16 + 2 * jj)) & 3) << 4)) - 32  # [N, SB, 8]
        d = _half(head) * keep[None, :]
        # loaded [N, SB, 4 (t), 8 (j)] (runs of j), used as [N, SB, 8, 4]
        words = tl.permute(tl.load(base[:, :, None, None] + 8 * t[None, None, :, None] + jj), (0, 1, 3, 2))
        lo, hi = iq4_nibbles(words, lut_ptr, t0, t1, t2, t3, EMULATE)
        wait_for_inputs(PDL)  # x only after the weight loads are issued
        for m in tl.static_range(BM):
            xm = _x_row(m, M)
            xw = xq_ptr + xm * stride_xq + s[:, None, None] * 64 + j[None, :, None] * 8 + 2 * t[None, None, :]
            x_lo = tl.load(xw)[None]  # [1, SB, 8, 4]: x in IQ4_ORDER
            x_hi = tl.load(xw + 1)[None]
            isum = tl.sum(ls * tl.sum(_dp4a(lo, x_lo, EMULATE) + _dp4a(hi, x_hi, EMULATE), axis=3), axis=2)
            xd = tl.load(xd_ptr + xm * stride_xd + s * 8)[None, :]  # [1, SB]
            acc = _add_row(acc, mi, m, tl.sum(to_fixed(d * xd * isum.to(tl.float32)), axis=1))
        start_dependents(PDL)
    wait_for_inputs(PDL)  # (also where a program had no iterations)
    _store_rows(out_ptr, acc, split, stride_os, stride_om, mi, M, rows, row_ok)


def splits_for(n: int, k: int, cfg: dict) -> tuple[int, int]:
    """(K splits, super-blocks per split), from the matrix alone (never the row count: deterministic rows)."""
    sbs = triton.cdiv(k, 256)
    want = max(1, min(sbs, cfg["target_programs"] // triton.cdiv(n, cfg["BLOCK_N"])))
    per_split = triton.cdiv(sbs, want)
    per_split = triton.cdiv(per_split, cfg["SB"]) * cfg["SB"]  # whole iterations per split
    return triton.cdiv(sbs, per_split), per_split


def row_align(w: Tensor) -> int:
    """The most elements, up to 16 bytes' worth, that divide w's row stride: a constant to the kernels, so they
    know how far each row's start is aligned and can load 16 bytes at once (a runtime stride tells them nothing)."""
    most = 16 // w.element_size()
    return next(a for a in (most, most // 2, most // 4, most // 8) if a >= 1 and w.stride(0) % a == 0)


def covers(qtype: str, k: int) -> bool:
    """Whether the integer kernels take this matrix: a type they read, whose stored rows are whole words (the
    types kept in planes by field keep the file's row bytes: an odd count of 18-, 22- or 34-byte blocks is not)."""
    size, _ = FIELD_PLANES.get(qtype, (4, ()))
    return qtype in GEMV_TYPES and k // (256 if qtype == "IQ4_XS" else 32) * size % 4 == 0


def gemv(x: Tensor, qweight: Tensor, qtype: str, k: int) -> Tensor:
    """x [M <= MAX_ROWS, K] @ dequantize(qweight)^T -> [M, N] in x's dtype (x quantized to 8 bits, x_group)."""
    return gemv_parts(x, [qweight], [qtype], k)


def gemv_parts(x: Tensor, qweights: list[Tensor], qtypes: list[str], k: int,
               summed: bool = True) -> Tensor | list[Tensor]:
    """x @ [part 0; part 1; ...]^T -> [M, sum of N] (a fused q/k/v or gate/up whose parts differ in type), or
    (summed=False) each part's partial sums [splits, M, N] (split_k.outputs, split_k.add_splits)."""
    return parts_product(x, qweights, qtypes, k, lambda q: _rounding(q, k), quantize_rows, _gemv_into, summed)


def _rounding(qtype: str, k: int) -> tuple[int, int]:
    """quantize_rows' order and group for this type's kernel."""
    return IQ4_ORDER if qtype in IQ4_TYPES else 0, x_group(qtype, k)


def config(qtype: str, k: int) -> dict:
    """This type's tile fitted to K (`fit_tile`; a tile swept for its own type, Q6_K's and IQ4_XS's, as swept), or the
    interpreter's."""
    if _emulate():
        return INTERPRETED
    cfg = TYPE_CONFIGS.get(qtype, CONFIG)
    fits = FIT_TILE and cfg["SB"] == CONFIG["SB"] and cfg["BLOCK_N"] == CONFIG["BLOCK_N"]
    return fit_tile(cfg, k, qtype in BLOCK32_IDS or qtype == "Q8_0") if fits else cfg


FIT_TILE = True  # off: every K takes the type's tile as swept (benchmarks/kernels/gguf_kernels.py --gemv-configs)
MOST_PADDING = 0.25  # of a row's blocks: an iteration past the last block re-reads it and multiplies zeros


def fit_tile(cfg: dict, k: int, block32: bool) -> dict:
    """cfg's tile reshaped for K: of SB, SB / 2 and SB / 4 super-blocks an iteration, with 1, 2 or 4 times BLOCK_N
    output rows (a tile of the same size), the one whose iterations over a row pad it least (the larger on a
    tie); where that still pads more than MOST_PADDING of the row (K of a few blocks), smaller SB down to 1. H100,
    Q4_K, one row: Gemma 4's K of 5376 (21 super-blocks) 4 x 16 0.095 ms, 8 x 8 0.083, 16 x 4 0.087, 8 x 4 0.141,
    16 x 8 0.096; its 21504 (84) 0.041 / 0.038 / 0.037; the 8B's four matrices 0.055 / 0.053 / 0.057. The tile
    changes no bits: every block's value is summed exactly (kernels/split_k.py), in any grouping."""
    units = k // 32 if block32 else triton.cdiv(k, 256)
    per_unit = 8 if block32 else 1  # the 32-weight types count SB in groups of 8 blocks
    sizes = [cfg["SB"] >> i for i in range(cfg["SB"].bit_length())]  # SB, SB / 2, ..., 1
    padding = {sb: triton.cdiv(units, sb * per_unit) * sb * per_unit - units for sb in sizes}
    sb = min(sizes[:3], key=lambda sb: padding[sb])  # min() keeps the first, larger, of equals
    if padding[sb] > MOST_PADDING * units:
        sb = min(sizes, key=lambda sb: padding[sb])
    block_n = cfg["BLOCK_N"] * min(4, cfg["SB"] // sb)
    return cfg if sb == cfg["SB"] else dict(cfg, SB=sb, BLOCK_N=block_n)


def parts_product(x: Tensor, qweights: list[Tensor], qtypes: list[str], k: int, rounding, round_x,
                  product_into, summed: bool = True) -> Tensor | list[Tensor]:
    """x @ [part 0; part 1; ...]^T -> [M, sum of N]: x rounded once per distinct rounding(qtype) (round_x(x,
    *rounding)), and product_into(out's columns of the part, x, *rounded x, part, qtype, k) for each part, so the
    parts write one output; summed=False: product_into(None, ...) for each, their partial sums returned."""
    rounded = {}
    out = (torch.empty(x.shape[0], sum(w.shape[0] for w in qweights), device=x.device, dtype=x.dtype) if summed
           else None)
    partials, col = [], 0
    for w, qtype in zip(qweights, qtypes):
        key = rounding(qtype)
        if key not in rounded:
            rounded[key] = round_x(x, *key)
        partials.append(product_into(None if out is None else out[:, col:col + w.shape[0]], x, *rounded[key], w,
                                     qtype, k))
        col += w.shape[0]
    return out if summed else partials


def _gemv_into(out: Tensor | None, x: Tensor, xq: Tensor, xd: Tensor, xs: Tensor, qweight: Tensor, qtype: str,
               k: int) -> Tensor:
    """The product into out (columns of a wider output), or None: its partial sums, returned unsummed."""
    m, n = x.shape[0], qweight.shape[0]
    groups = m > MAX_ROWS  # more rows: groups of MAX_ROWS in parallel programs (one row's work unrolled 16 times
    # ran 6.7 times a row's time: H100, SmolLM2's Q4_1 matrices, 2026-12-07)
    bm = MAX_ROWS if groups else next(b for b in ROW_BUCKETS if b >= m)
    emulate = _emulate()
    cfg = config(qtype, k)
    splits, per_split = splits_for(n, k, cfg)
    out, partial = split_k.outputs(x, n, splits, out, summed=out is not None, exact=True)
    if qtype in ("Q4_K", "Q5_K"):
        w = qweight.view(torch.int32)
        kernel, args, extra = _kquant_kernel, (w,), dict(FIVE_BITS=qtype == "Q5_K")
    elif qtype == "Q6_K":  # 212-byte blocks: whole words
        w = qweight.view(torch.int32)
        kernel, args, extra = _q6_k_kernel, (w, qweight.view(torch.int16)), {}
    elif qtype == "Q8_0":  # two planes: the values first, whole words (quant/ggml.field_planes)
        w = qweight.view(torch.int32)
        kernel, args, extra = _q8_0_kernel, (w, qweight.view(torch.int16)), dict(X256=x_group(qtype, k) == 256)
    elif qtype == "IQ4_XS":
        w = qweight.view(torch.int32)
        kernel, args, extra = _iq4_xs_kernel, (w, iq4_table(x.device).view(torch.int32)), {}
    else:  # planes by field: nibble words, fifth-bit words, fp16 scales (quant/ggml.field_planes)
        w = qweight.view(torch.int32)
        table = iq4_table(x.device).view(torch.int32)
        kernel, args, extra = _block32_kernel, (w, qweight.view(torch.int16), table), dict(QTYPE=BLOCK32_IDS[qtype])
    align = row_align(w)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), splits, triton.cdiv(m, bm))
    kernel[grid](xq, xd, xs, *args, partial, M=m, N=n, K=k, sb_per_split=per_split, stride_xq=xq.stride(0),
                 stride_xd=xd.stride(0), stride_wu=w.stride(0) // align, stride_os=partial.stride(0),
                 stride_om=partial.stride(1), BM=bm, BLOCK_N=cfg["BLOCK_N"], SB=cfg["SB"], ROW_ALIGN=align,
                 WHOLE=k % 256 == 0 and k // 256 % cfg["SB"] == 0, EMULATE=emulate, GROUPS=groups,
                 num_warps=cfg["num_warps"], maxnreg=cfg.get("maxnreg"), **extra, **pdl.launch(x))
    split_k.finish(partial, out)
    return partial
