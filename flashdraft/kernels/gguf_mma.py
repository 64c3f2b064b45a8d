"""Q4_K, Q5_K, Q6_K, IQ4_XS and Q8_0 products for verify widths and batches of slots (MIN_ROWS-16 rows of x) on the
int8 tensor cores, llama.cpp's mmq shape, in Gluon (Triton's dialect with explicit layouts): each thread loads the
words its `mma.m16n8k32.s8` fragment needs, so the weights reach the tensor cores without shared memory or layout
conversions.

Q4_K: four consecutive bytes of a nibble group are four consecutive weights of sub-block 2g (low nibbles, one AND)
and of 2g + 1 (high nibbles, a shift and an AND); Q5_K adds bit J of each qh byte as 16. Q6_K: a word of ql bytes
and one of qh bytes give four consecutive 6-bit values (signed by a bit trick); its scales change every 16 weights,
so each 32 weights are two mmas with the other half's weights zeroed. IQ4_XS: the low or high nibbles of a word
looked up in the level table by byte permutes. Q8_0: its int8 plane as it is. x is quantized to 8 bits as the integer
kernels take it (per 256 values: gguf_gemv.x_group), by rows
(`gguf_gemv.quantize_rows_paired`) or with each block's 16 rows side by side (`quantize_rows_tiled`: a warp's
B-fragment or scale load is one or two L1 wavefronts, where rows K apart took eight; the kernels were bound by L1
wavefronts, not DRAM). Each product is exact in int32; with one x scale per super-block the sub-blocks' products
times their integer scales are summed in int32 (and Q4_K/Q5_K's minimum term as an mma of the rows' 6-bit mins
with x), so a super-block converts to float once: d * xd(token) * sum(sc * (w . x)) minus dmin * xd(token) *
sum(m * sum(x)) (Q8_0: each block's product times its d, summed in float, times xd), each value the float32 the
integer kernels compute for it (gguf_gemv.k_value, q8_0_chain), added to int64 fixed-point sums
(kernels/split_k.py). So a token's result has the same bits here, with any number of rows, as in the integer
kernels: a verified row equals the row decoded alone.

Gluon has no interpreter: the CPU tests cannot run these kernels (the GPU test does, against the `gguf` package;
the CPU tests read their unpacking assembly as PTX and the tiled layout through the interpreter).
H100 (docs/perf-history.md, 2026-12-05 H100), 16 rows of the 8B's four matrices with x's rounding, against these
kernels at k_width 4 with x by rows: Q4_K x0.68, Q5_K x0.70, IQ4_XS x0.87, Q6_K x0.92; Q8_0 0.172 ms against the float
tensor-core kernel's 0.280. Decode rows stay with gguf_gemv (a Q6_K file's decode through these kernels measured 210
tok/s against 219 through the integer kernels).
"""
import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from flashdraft.kernels import gguf_gemv, pdl, split_k
from flashdraft.kernels.iq4 import IQ4_EIGHT

ENABLED = True
BLOCK_N, NUM_WARPS = 128, 4  # 64 and 32 rows, 8 warps: slower at 16 rows (H200, 2026-12-04)
# Programs K is split for, per type: 264 (two an SM of an H100/H200): Q4_K_M verify16 6.24 ms against 6.60 at 1056 and
# 7.16 at 2112 (docs/perf-history.md, 2026-12-05 H200); Q8_0 (140 registers: three programs an SM) at 396: verify16
# 1.5-2.4% faster than at 264 in two H100 leases, Q4_K_M 2% slower (docs/perf-history.md, 2026-12-06 H100). IQ4_XS by
# lane: 0.089 ms at 264 against 0.095 at 396 (16 rows of the 8B's four matrices, H100, 2026-12-06).
TARGET_PROGRAMS = {"Q4_K": 264, "Q5_K": 264, "Q6_K": 264, "IQ4_XS": 264, "Q8_0": 396}
# With x padded to 8 rows (FEW_TOKENS) fewer registers: 396 against 264, 3-8 rows of the Gemma 4 31B's four matrices,
# Q4_K 0.142-0.145 ms against 0.146-0.149, Q5_K 0.165-0.173 against 0.169-0.177, Q6_K 0.302-0.311 against
# 0.311-0.317 (benchmarks/results/2026-12-07-h100-kernels-mma8.json, H100); other types as at 16 rows
FEW_TARGET_PROGRAMS = {"Q4_K": 396, "Q5_K": 396, "Q6_K": 396}
# Ran slower on an H100 at 8 and 16 rows (docs/perf-history.md, 2026-12-05 H100): super-blocks staged
# through shared memory by cp.async 2-4 deep (x0.73-0.93), registers capped for three or four programs per SM
# (x0.52-0.98), the next super-block's words loaded before this one's products, and float conversion by 2^23;
# also plain Triton's software-pipelined int8 wgmma (Q8_0 x0.64-0.71, IQ4_XS x0.54; H100, 2026-12-06).


TOKENS = 16  # the mma's N: rows of x, padded
# Up to this many rows the kernels pad x to 8 rows (one n8 mma a 16-row tile, not two): half the products, the
# accumulators' registers and the float conversions; each token's sums are the same exact integers (0: always 16).
FEW_TOKENS = 8
FIXED_ONE = gl.constexpr(split_k.FIXED_ONE)  # kernels/split_k.py's fixed-point scale


@gluon.jit
def _k_scales(a, b, c):
    """Q4_K's 6-bit scales and mins (ggml's get_scale_min_k4) from the 12 scale bytes as words a, b, c, as the bytes of
    four words: (scales of sub-blocks 0-3, of 4-7, mins of 0-3, of 4-7), byte J % 4 for sub-block J."""
    return (a & 0x3F3F3F3F, (c & 0x0F0F0F0F) | ((a >> 2) & 0x30303030),
            b & 0x3F3F3F3F, ((c >> 4) & 0x0F0F0F0F) | ((b >> 2) & 0x30303030))


@gluon.jit
def _byte(word, i: gl.constexpr):
    return (word >> (8 * i)) & 0xFF


@gluon.jit
def _half(bits):
    return (bits & 0xFFFF).to(gl.uint16).to(gl.float16, bitcast=True).to(gl.float32)


@gluon.jit
def _x_values(b_ptr, block, TILED: gl.constexpr):
    """x's block `block` (of 32 values): its 8-bit values as the B fragment, x laid out by rows
    (quantize_rows_paired) or tiled (quantize_rows_tiled)."""
    return gl.load(b_ptr + (512 if TILED else 32) * block)


@gluon.jit
def _x_scale(xds_ptr, x_toks, stride_xds, block, TILED: gl.constexpr):
    """Each token's scale of x's block `block`, float32 (the low half of its (scale, scaled sum) pair)."""
    if TILED:
        pair = gl.load(xds_ptr + 16 * block + x_toks)
    else:
        pair = gl.load(xds_ptr + x_toks * stride_xds + block)
    return pair.to(gl.int32).to(gl.float32, bitcast=True)


@gluon.jit
def _to_fixed(v):
    """kernels/split_k.to_fixed in Gluon: float32 -> int64 fixed point, truncated."""
    return (v * FIXED_ONE).to(gl.int64)


@gluon.jit
def _fma(a, b, c):
    """a * b + c rounded once (fma.rn.f32, as tl.fma is in the integer kernels)."""
    return gl.inline_asm_elementwise("fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", [a, b, c], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def _fixed(isum, d, xd):
    """A super-block's exact int32 sum isum times d (per row) * xd (per token), float32, as int64 fixed point (the
    integer kernels' value: (d * xd) * isum)."""
    return _to_fixed(isum.to(gl.float32) * (d[:, None] * xd[None, :]))


@gluon.jit
def _sub_block(isum, msum, w, zero, scales, b_ptr, block0, J: gl.constexpr, a_l: gl.constexpr,
               TILED: gl.constexpr):
    """A Q4_K/Q5_K super-block's sums with sub-block J added, in int32 (x rounded per 256: one scale for all 8):
    isum + sc(row) * (w . x), and msum + m(row) * sum(x) as an mma of the rows' 6-bit mins, repeated over k, with x.
    scales: `_k_scales`' words."""
    xb = _x_values(b_ptr, block0 + J, TILED)
    sc, mn = _byte(scales[J // 4], J % 4), _byte(scales[2 + J // 4], J % 4)
    mins = gl.convert_layout(mn.to(gl.int8), gl.SliceLayout(1, a_l), assert_trivial=True)[:, None]
    return (isum + mma_v2(w, xb, zero) * sc[:, None],
            mma_v2(gl.broadcast(mins, w)[0], xb, msum))


@gluon.jit
def _tile(w_ptr, xq_ptr, M, N, K, sb_per_split, stride_xq, stride_wn, BLOCK_N: gl.constexpr,
          NUM_WARPS: gl.constexpr, K_WIDTH: gl.constexpr, TILED: gl.constexpr, PDL: gl.constexpr,
          TOKENS: gl.constexpr):
    """A program's super-blocks [first, last) (grid axis 1 splits K) and its operands in the mma fragments'
    layouts: a_row [BLOCK_N, 1] (its weight rows' starts, in the A layout: plus a_col, or a function of it that
    keeps runs of K_WIDTH, for word loads), a_col [1, 32] (k); b_ptr [32, TOKENS] (x's block 0 + k, in the B
    layout: `_x_values` reads block j); s_ptr (the rows' starts as int32 words, for their scales), x_toks (the
    tokens' rows of x, for their scales: `_x_scale`), rows, row_ok and toks, tok_ok along the product's two axes; an
    int64 fixed-point accumulator (kernels/split_k.py) and an int32 zero for each mma.
    Loads take no masks: rows past N read row N - 1, tokens past M read row M - 1 of x by rows, or the tiled
    layout's unwritten rows; a product's row and column depend on that row of w and that token of x only, and
    `_store` leaves those out (a masked load costs a register zeroed before it, and a predicate)."""
    if PDL:  # kernels/pdl.py: wait for x, then let the next kernel be placed (launch overlap only)
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=K_WIDTH)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=K_WIDTH)
    first_row = gl.program_id(0) * BLOCK_N
    a_rows = gl.minimum(first_row + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_l)), N - 1)
    a_col = gl.arange(0, 32, layout=gl.SliceLayout(0, a_l))[None, :]
    a_row = w_ptr + a_rows.to(gl.int64)[:, None] * stride_wn
    b_k = gl.arange(0, 32, layout=gl.SliceLayout(1, b_l))
    b_t = gl.arange(0, TOKENS, layout=gl.SliceLayout(0, b_l))
    rows = first_row + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    toks = gl.arange(0, TOKENS, layout=gl.SliceLayout(0, mma))
    if TILED:
        b_ptr = xq_ptr + b_t[None, :] * 32 + b_k[:, None]
        x_toks = toks
    else:
        b_ptr = xq_ptr + gl.minimum(b_t, M - 1)[None, :] * stride_xq + b_k[:, None]
        x_toks = gl.minimum(toks, M - 1)
    first = gl.program_id(1) * sb_per_split
    s_ptr = (w_ptr + gl.minimum(rows, N - 1).to(gl.int64) * stride_wn).to(gl.pointer_type(gl.int32))
    return (first, gl.minimum(first + sb_per_split, K // 256), a_row, a_col, b_ptr, s_ptr, x_toks, rows, rows < N,
            toks, toks < M, gl.zeros([BLOCK_N, TOKENS], gl.int64, layout=mma),
            gl.zeros([BLOCK_N, TOKENS], gl.int32, layout=mma))


@gluon.jit
def _store(out_ptr, acc, rows, row_ok, toks, tok_ok, stride_os, stride_om):
    """The program's partial sums into out [splits, M, N] at its split (grid axis 1): int64, or (one split) the
    product in out's float dtype (kernels/split_k.from_fixed)."""
    if out_ptr.dtype.element_ty != gl.int64:
        acc = acc.to(gl.float32) * (1.0 / FIXED_ONE)
    gl.store(out_ptr + gl.program_id(1) * stride_os + toks[None, :] * stride_om + rows[:, None],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & tok_ok[None, :])


Q5_ASM = gl.constexpr("""{
.reg .b32 n, h, s;
and.b32 s, $3, 0xFF;
shr.b32 h, $2, s;
and.b32 h, h, 0x01010101;
shl.b32 h, h, 4;
and.b32 s, s, 1;
shl.b32 s, s, 2;
shr.b32 n, $1, s;
and.b32 n, n, 0x0F0F0F0F;
or.b32 $0, n, h;
}""")  # Q5_K's four values of sub-block J ($3's low byte): nibbles of $1 (low for even J) + bit J of $2's bytes as 16


@gluon.jit
def _q5_values(q, qh, J: gl.constexpr):
    """Q5_K sub-block J's values from its nibble words q and the fifth-bit words qh (A-layout int8 tiles)."""
    return gl.inline_asm_elementwise(Q5_ASM, "=r,r,r,r", [q, qh, gl.full(q.shape, J, gl.int8, q.type.layout)],
                                     dtype=gl.int8, is_pure=True, pack=4)


@gluon.constexpr_function
def _lane_pieces_layout(block_n, num_warps):
    """[block_n, 128] nibble bytes as quant/ggml.lane_grouped keeps them (column 32p + 8g + i: group g's byte
    8p + i; IQ4_XS's by_lane: column 32p + 4j + i, sub-block j's byte 4p + i): each thread holds the 32 bytes of
    its lane piece p of a row, the rows those of its A fragments (rows r and r + 8 of its warp's 16, lane 4r + p),
    so that `_groups` needs no data movement."""
    assert block_n % (16 * num_warps) == 0, (block_n, num_warps)
    regs = [[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [8, 0]]
    regs += [[16 * num_warps << i, 0] for i in range((block_n // (16 * num_warps)).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16 << i, 0] for i in range(num_warps.bit_length() - 1)],
                                      block_bases=[], shape=[block_n, 128])


@gluon.jit
def _lane_piece_ptrs(w_ptr, N, stride_wn, BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr):
    """The program's rows' bytes 0..127 from w_ptr [BLOCK_N, 128], in _lane_pieces_layout (rows past N read row
    N - 1, left unstored)."""
    wide: gl.constexpr = _lane_pieces_layout(BLOCK_N, NUM_WARPS)
    rows = gl.minimum(gl.program_id(0) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, wide)), N - 1)
    return w_ptr + rows.to(gl.int64)[:, None] * stride_wn + gl.arange(0, 128, layout=gl.SliceLayout(0, wide))[None, :]


@gluon.jit
def _groups(q, a_l: gl.constexpr, BLOCK_N: gl.constexpr):
    """q [BLOCK_N, 128] in _lane_pieces_layout -> the four groups' [BLOCK_N, 32] tiles in the A layout (k_width 8),
    by register renaming only."""
    q = gl.permute(gl.reshape(q, [BLOCK_N, 4, 4, 8]), [0, 2, 1, 3])  # (row, g, p, i)
    # (row, k, g // 2, g % 2)
    q = gl.reshape(gl.permute(gl.reshape(q, [BLOCK_N, 4, 32]), [0, 2, 1]), [BLOCK_N, 32, 2, 2])
    even, odd = gl.split(q)
    q0, q2 = gl.split(even)
    q1, q3 = gl.split(odd)
    return (gl.convert_layout(q0, a_l, assert_trivial=True), gl.convert_layout(q1, a_l, assert_trivial=True),
            gl.convert_layout(q2, a_l, assert_trivial=True), gl.convert_layout(q3, a_l, assert_trivial=True))


@gluon.jit
def _kquant_kernel(xq_ptr, xds_ptr, w_ptr, out_ptr, M, N, K, sb_per_split, stride_xq, stride_xds, stride_wn, stride_os,
                   stride_om, BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr, FIVE_BITS: gl.constexpr,
                   TILED: gl.constexpr, PDL: gl.constexpr, TOKENS: gl.constexpr):
    """xq_ptr: x's 8-bit values as bytes [M, K]; xds [M, K / 32] int64: each block's float32 scale (low half) and
    scaled sum (high half); w: Q4_K rows as bytes (144 per super-block: d, dmin, 12 scale bytes, 128 nibble bytes)
    or Q5_K's (176: the same with 32 bytes of fifth bits before the nibbles, bit J of byte l for sub-block J's
    weight l), the nibbles lane_grouped (quant/ggml.py): a row's 128 load at once, two 16-byte loads per
    thread; out [splits, M, N] int64 fixed-point partial sums over this program's super-blocks."""
    WORDS: gl.constexpr = 44 if FIVE_BITS else 36
    NIBBLES: gl.constexpr = 48 if FIVE_BITS else 16
    first, last, a_row, a_col, b_ptr, s_ptr, x_toks, rows, row_ok, toks, tok_ok, acc, zero = _tile(
        w_ptr, xq_ptr, M, N, K, sb_per_split, stride_xq, stride_wn, BLOCK_N, NUM_WARPS, 8, TILED, PDL, TOKENS)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    q_ptr = _lane_piece_ptrs(w_ptr + NIBBLES, N, stride_wn, BLOCK_N, NUM_WARPS)
    a_ptr = a_row + a_col
    for c in range(first, last):
        head = gl.load(s_ptr + WORDS * c)
        a = gl.load(s_ptr + WORDS * c + 1)
        b = gl.load(s_ptr + WORDS * c + 2)
        s = gl.load(s_ptr + WORDS * c + 3)
        d, dmin = _half(head), _half(head >> 16)
        scales = _k_scales(a, b, s)
        if FIVE_BITS:
            qh = gl.load(a_ptr + 4 * WORDS * c + 16)
        groups = _groups(gl.load(q_ptr + 4 * WORDS * c), a_l, BLOCK_N)
        isum, msum = zero, zero
        for g in gl.static_range(4):
            q = groups[g]
            if FIVE_BITS:
                lo, hi = _q5_values(q, qh, 2 * g), _q5_values(q, qh, 2 * g + 1)
            else:
                lo = gl.inline_asm_elementwise("and.b32 $0, $1, 0x0F0F0F0F;", "=r,r", [q], dtype=gl.int8,
                                               is_pure=True, pack=4)
                hi = gl.inline_asm_elementwise("{ .reg .b32 t; shr.b32 t, $1, 4; and.b32 $0, t, 0x0F0F0F0F; }",
                                               "=r,r", [q], dtype=gl.int8, is_pure=True, pack=4)
            isum, msum = _sub_block(isum, msum, lo, zero, scales, b_ptr, 8 * c, 2 * g, a_l, TILED)
            isum, msum = _sub_block(isum, msum, hi, zero, scales, b_ptr, 8 * c, 2 * g + 1, a_l, TILED)
        xd = _x_scale(xds_ptr, x_toks, stride_xds, 8 * c, TILED)[None, :]
        # gguf_gemv.k_value, with its one explicit fused multiply-add
        acc += _to_fixed(_fma(isum.to(gl.float32), d[:, None] * xd, -(msum.to(gl.float32) * (dmin[:, None] * xd))))
    _store(out_ptr, acc, rows, row_ok, toks, tok_ok, stride_os, stride_om)


def _q6_asm(nibble_shift: int, high_shift: int) -> str:
    """Four Q6_K values from a word of ql bytes ($1) and one of qh bytes ($2): the nibble at nibble_shift and the two
    bits at high_shift, as signed bytes q - 32 ((v & 31) | 0xE0 where bit 5 is clear)."""
    return f"""{{
.reg .b32 n, h, v, s;
shr.b32 n, $1, {nibble_shift};
and.b32 n, n, 0x0F0F0F0F;
shr.b32 h, $2, {high_shift};
and.b32 h, h, 0x03030303;
shl.b32 h, h, 4;
or.b32 v, n, h;
not.b32 s, v;
and.b32 s, s, 0x20202020;
mul.lo.u32 s, s, 7;
and.b32 v, v, 0x1F1F1F1F;
or.b32 $0, v, s;
}}"""


# value group q (0..3) of a 128-weight half: ql bytes 0-31 or 32-63 (q % 2), low or high nibble (q // 2), qh bits 2q
Q6_ASM0, Q6_ASM1, Q6_ASM2, Q6_ASM3 = (gl.constexpr(_q6_asm(4 * (q // 2), 2 * q)) for q in range(4))


@gluon.jit
def _q6_values(ql0, ql1, qh, Q: gl.constexpr):
    if Q == 0:
        v = gl.inline_asm_elementwise(Q6_ASM0, "=r,r,r", [ql0, qh], dtype=gl.int8, is_pure=True, pack=4)
    elif Q == 1:
        v = gl.inline_asm_elementwise(Q6_ASM1, "=r,r,r", [ql1, qh], dtype=gl.int8, is_pure=True, pack=4)
    elif Q == 2:
        v = gl.inline_asm_elementwise(Q6_ASM2, "=r,r,r", [ql0, qh], dtype=gl.int8, is_pure=True, pack=4)
    else:
        v = gl.inline_asm_elementwise(Q6_ASM3, "=r,r,r", [ql1, qh], dtype=gl.int8, is_pure=True, pack=4)
    return v


@gluon.jit
def _q6k_kernel(xq_ptr, xds_ptr, w_ptr, out_ptr, M, N, K, sb_per_split, stride_xq, stride_xds, stride_wn, stride_os,
                stride_om, BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr, K_WIDTH: gl.constexpr, TILED: gl.constexpr,
                PDL: gl.constexpr, TOKENS: gl.constexpr):
    """Q6_K (kept padded to 212 bytes: ql 128, qh 64, 16 int8 scales, d): each 32 weights are one int8 mma per
    16-weight scale, the other half's weights zeroed, the two exact int32 products scaled in float32."""
    first, last, a_row, a_col, b_ptr, s_ptr, x_toks, rows, row_ok, toks, tok_ok, acc, zero = _tile(
        w_ptr, xq_ptr, M, N, K, sb_per_split, stride_xq, stride_wn, BLOCK_N, NUM_WARPS, K_WIDTH, TILED, PDL, TOKENS)
    a_ptr = a_row + a_col
    first_half = a_col < 16
    for c in range(first, last):
        d = _half(gl.load(s_ptr + 53 * c + 52))
        isum = zero
        for h in gl.static_range(2):  # 128-weight halves
            ql0 = gl.load(a_ptr + 212 * c + 64 * h)
            ql1 = gl.load(a_ptr + 212 * c + 64 * h + 32)
            qh = gl.load(a_ptr + 212 * c + 128 + 32 * h)
            sw0 = gl.load(s_ptr + 53 * c + 48 + 2 * h)  # scales 8h .. 8h + 3
            sw1 = gl.load(s_ptr + 53 * c + 49 + 2 * h)  # scales 8h + 4 .. 8h + 7
            for q in gl.static_range(4):
                v = _q6_values(ql0, ql1, qh, q)
                xb = _x_values(b_ptr, 8 * c + 4 * h + q, TILED)
                sw = sw0 if q < 2 else sw1
                sc_a = (sw << (24 - 16 * (q % 2))) >> 24  # scale 2q, signed
                sc_b = (sw << (16 - 16 * (q % 2))) >> 24  # scale 2q + 1
                isum += (mma_v2(gl.where(first_half, v, 0), xb, zero) * sc_a[:, None]
                         + mma_v2(gl.where(first_half, 0, v), xb, zero) * sc_b[:, None])
        acc += _fixed(isum, d, _x_scale(xds_ptr, x_toks, stride_xds, 8 * c, TILED))
    _store(out_ptr, acc, rows, row_ok, toks, tok_ok, stride_os, stride_om)


@gluon.jit
def _iq4_xs_kernel(xq_ptr, xds_ptr, w_ptr, out_ptr, M, N, K, sb_per_split, stride_xq, stride_xds, stride_wn, stride_os,
                   stride_om, BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr, TILED: gl.constexpr, PDL: gl.constexpr,
                   TOKENS: gl.constexpr):
    """IQ4_XS as quant/ggml.field_planes keeps it: a row's super-blocks' 128 nibble bytes by lane
    (quant/ggml.by_lane: sub-block j's word t at 32t + 4j, so a thread's eight words are one 32-byte run; byte
    l of a sub-block: weight l in the low nibble, l + 16 in the high), then their 8-byte headers (d, the scales'
    high bits (16), their low nibbles (4 bytes)). With k_width 8 a thread's k 8t..8t+7 of a row are the eight
    nibbles of the sub-block's word t, looked up at once (iq4.IQ4_EIGHT: 12 instructions for eight weights), in the
    order x is quantized in for them (gguf_gemv.IQ4_ORDER). Each 32 weights are one mma; a super-block's eight,
    times their scales (6-bit - 32), summed in int32."""
    first, last, a_row, a_col, b_ptr, s_ptr, x_toks, rows, row_ok, toks, tok_ok, acc, zero = _tile(
        w_ptr, xq_ptr, M, N, K, sb_per_split, stride_xq, stride_wn, BLOCK_N, NUM_WARPS, 8, TILED, PDL, TOKENS)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
    q_ptr = _lane_piece_ptrs(w_ptr, N, stride_wn, BLOCK_N, NUM_WARPS).to(gl.pointer_type(gl.int8))
    for c in range(first, last):
        head = gl.load(s_ptr + K // 256 * 32 + 2 * c)
        low = gl.load(s_ptr + K // 256 * 32 + 2 * c + 1)
        high = (head >> 16) & 0xFFFF  # 2 bits a sub-block: its 4-bit groups spread to bytes
        high = (high | (high << 8)) & 0x00FF00FF
        high = (high | (high << 4)) & 0x0F0F0F0F
        scales = ((low & 0x0F0F0F0F) | ((high & 0x03030303) << 4),  # byte b: sub-block 2b's 6-bit scale
                  ((low >> 4) & 0x0F0F0F0F) | ((high & 0x0C0C0C0C) << 2))  # sub-block 2b + 1's
        # (t, j // 4, j % 4, byte) -> each word followed by four zero bytes (k_width 8), then the two halves of j as
        # lane_grouped's [BLOCK_N, 128] (column 32t + 8 (j % 4) + i) for _groups
        q = gl.reshape(gl.load(q_ptr + 128 * c), [BLOCK_N, 4, 2, 4, 4])
        first_half, second_half = gl.split(gl.permute(gl.join(q, gl.zeros_like(q)), [0, 1, 3, 5, 4, 2]))
        words = (_groups(gl.reshape(first_half, [BLOCK_N, 128]), a_l, BLOCK_N),
                 _groups(gl.reshape(second_half, [BLOCK_N, 128]), a_l, BLOCK_N))
        isum = zero
        for j in gl.static_range(8):
            w = gl.inline_asm_elementwise(IQ4_EIGHT, "=r,=r,r,r", [words[j // 4][j % 4]], dtype=gl.int8, is_pure=True,
                                          pack=8)
            scale = ((scales[j % 2] >> (8 * (j // 2))) & 63) - 32
            isum += mma_v2(w, _x_values(b_ptr, 8 * c + j, TILED), zero) * scale[:, None]
        acc += _fixed(isum, _half(head), _x_scale(xds_ptr, x_toks, stride_xds, 8 * c, TILED))
    _store(out_ptr, acc, rows, row_ok, toks, tok_ok, stride_os, stride_om)


@gluon.jit
def _q8_0_kernel(xq_ptr, xds_ptr, w_ptr, out_ptr, M, N, K, sb_per_split, stride_xq, stride_xds, stride_wn, stride_os,
                 stride_om, BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr, K_WIDTH: gl.constexpr, TILED: gl.constexpr,
                 PDL: gl.constexpr, TOKENS: gl.constexpr):
    """Q8_0 as quant/ggml.field_planes keeps it (a row's K int8 values, then its K / 32 fp16 scales), K a
    multiple of 256, x rounded per 256: each block's exact int32 product times d(row), the eight blocks' sum (in
    gguf_gemv.q8_0_chain's order) times xd(token)."""
    first, last, a_row, a_col, b_ptr, s_ptr, x_toks, rows, row_ok, toks, tok_ok, acc, zero = _tile(
        w_ptr, xq_ptr, M, N, K, sb_per_split, stride_xq, stride_wn, BLOCK_N, NUM_WARPS, K_WIDTH, TILED, PDL, TOKENS)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    a_ptr = (a_row + a_col).to(gl.pointer_type(gl.int8))
    d_ptr = (w_ptr + gl.minimum(rows, N - 1).to(gl.int64) * stride_wn + K).to(gl.pointer_type(gl.int64))
    for c in range(first, last):
        d_words = gl.load(d_ptr + 2 * c), gl.load(d_ptr + 2 * c + 1)  # the 8 blocks' fp16 scales, four a word
        part = gl.zeros([BLOCK_N, TOKENS], gl.float32, layout=mma)
        for j in gl.static_range(8):  # gguf_gemv.q8_0_chain's order
            w = gl.load(a_ptr + 256 * c + 32 * j)
            prod = mma_v2(w, _x_values(b_ptr, 8 * c + j, TILED), zero).to(gl.float32)
            d = _half((d_words[j // 4] >> (16 * (j % 4))).to(gl.int32))[:, None]
            if j == 0:
                part = prod * d
            else:
                part = _fma(prod, d, part)
        acc += _to_fixed(part * _x_scale(xds_ptr, x_toks, stride_xds, 8 * c, TILED)[None, :])
    _store(out_ptr, acc, rows, row_ok, toks, tok_ok, stride_os, stride_om)


# K_WIDTH: consecutive k per thread in the A and B fragments (Triton permutes k alike in both, so the same bits);
# 8 gives 64-bit weight loads and fewer registers (Q4_K 134 against 186), but turns Q6_K's half-block selects into
# byte selects. TILED: x laid out by quantize_rows_tiled. Chosen per type on an H100 (docs/perf-history.md,
# 2026-12-05 H100).
KERNELS = {"Q4_K": (_kquant_kernel, dict(FIVE_BITS=False, TILED=True)),  # k_width 8: _lane_pieces_layout's
           "Q5_K": (_kquant_kernel, dict(FIVE_BITS=True, TILED=True)),
           "Q6_K": (_q6k_kernel, dict(K_WIDTH=4, TILED=True)),
           "IQ4_XS": (_iq4_xs_kernel, dict(TILED=True)),  # k_width 8: IQ4_EIGHT's
           "Q8_0": (_q8_0_kernel, dict(K_WIDTH=8, TILED=False))}
assert TARGET_PROGRAMS.keys() == KERNELS.keys()
X_ORDERS = {"IQ4_XS": gguf_gemv.IQ4_ORDER}  # x's values in a block as the kernel's A fragments hold the weights
TIMED = {"Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q8_0"}  # types timed on a GPU and taken by covers(); see docs/PERF.md
# Fewest rows these kernels take; fewer go to the integer kernels, whose cost grows with every row while these pad x
# to 8 or 16 rows (FEW_TOKENS, TOKENS): a batch of 3-4 decoding slots costs them about what an 8-row block does.
MIN_ROWS = 3


def covers(qtype: str, m: int, x: Tensor) -> bool:
    """Whether these kernels take the product: enabled, a type they read, MIN_ROWS-16 rows, K a multiple of 256 (Q8_0's
    rows need not be), an Ampere or newer GPU."""
    return (ENABLED and qtype in TIMED and MIN_ROWS <= m <= 16 and x.shape[1] % 256 == 0 and x.is_cuda
            and not gguf_gemv._emulate() and torch.cuda.get_device_capability(x.device) >= (8, 0))


def matmul(x: Tensor, qweight: Tensor, qtype: str, k: int) -> Tensor:
    """x [M <= 16, K] @ dequantize(qweight)^T -> [M, N] in x's dtype (qweight as quant/ggml.stored_blocks
    keeps it)."""
    return matmul_parts(x, [qweight], [qtype], k)


def matmul_parts(x: Tensor, qweights: list[Tensor], qtypes: list[str], k: int,
                 summed: bool = True) -> Tensor | list[Tensor]:
    """x @ [part 0; part 1; ...]^T -> [M, sum of N] (a fused q/k/v or gate/up whose parts differ in type): x rounded
    once per layout the parts' kernels take; summed=False: each part's partial sums [splits, M, N]
    (split_k.outputs)."""
    return gguf_gemv.parts_product(x, qweights, qtypes, k, lambda q: _rounding(q, k), _rounded, _matmul_into, summed)


def _rounding(qtype: str, k: int) -> tuple[bool, int, int]:
    """x's layout for this type's kernel: (tiled, rounding group, value order)."""
    return KERNELS[qtype][1]["TILED"], gguf_gemv.x_group(qtype, k), X_ORDERS.get(qtype, 0)


def splits_for(n: int, k: int, qtype: str, m: int = TOKENS) -> tuple[int, int]:
    """(splits of K, super-blocks per split) for an [n, k] matrix of qtype and m rows of x, from their shapes."""
    sbs = k // 256
    target = FEW_TARGET_PROGRAMS.get(qtype, TARGET_PROGRAMS[qtype]) if m <= FEW_TOKENS else TARGET_PROGRAMS[qtype]
    per_split = triton.cdiv(sbs, max(1, min(sbs, target // triton.cdiv(n, BLOCK_N))))
    return triton.cdiv(sbs, per_split), per_split


def _rounded(x: Tensor, tiled: bool, group: int, order: int) -> tuple[Tensor, Tensor, int, int]:
    """x rounded to 8 bits per `group` values for the kernels: (values, scale pairs, their row strides)."""
    if tiled:
        xq, xds = gguf_gemv.quantize_rows_tiled(x, group, order)
        return xq, xds, 0, 0  # the kernels' tiled offsets
    assert order == 0, order
    xq, xds = gguf_gemv.quantize_rows_paired(x, group)
    return xq.view(torch.int8), xds, xq.view(torch.int8).stride(0), xds.stride(0)


def _matmul_into(out: Tensor | None, x: Tensor, xq: Tensor, xds: Tensor, stride_xq: int, stride_xds: int,
                 qweight: Tensor, qtype: str, k: int) -> Tensor:
    """The product into out (columns of a wider output), or None: its partial sums, returned unsummed."""
    m, n = x.shape[0], qweight.shape[0]
    kernel, constants = KERNELS[qtype]
    splits, per_split = splits_for(n, k, qtype, m)
    out, partial = split_k.outputs(x, n, splits, out, summed=out is not None, exact=True)
    grid = (triton.cdiv(n, BLOCK_N), splits)
    tokens = 8 if m <= FEW_TOKENS else TOKENS
    kernel[grid](xq, xds, qweight, partial, M=m, N=n, K=k, sb_per_split=per_split, stride_xq=stride_xq,
                 stride_xds=stride_xds, stride_wn=qweight.stride(0), stride_os=partial.stride(0),
                 stride_om=partial.stride(1), BLOCK_N=BLOCK_N, NUM_WARPS=NUM_WARPS, num_warps=NUM_WARPS,
                 TOKENS=tokens, **constants, **pdl.launch(x))
    split_k.finish(partial, out)
    return partial
