"""Split-K ("flash-decoding") attention for a few query tokens over a long KV cache, in Triton.

Decode, verify and draft steps have 1-16 query tokens, so an attention kernel that gives each (batch, head) one
program leaves most of the GPU idle while it walks the cache. Here the keys are cut into splits, and a program
per (KV head, split) and a few 16-row tiles of the group's query rows computes a partial softmax-weighted sum for
all of them at once (GQA without repeating K/V), and a second kernel merges the splits by their log-sum-exp. The
mask is an explicit bool [T, L] (True = attend), so causal, sliding-window and the draft's non-causal ring layouts
all go through the same kernel; the score scale and an optional tanh softcap are arguments. Registered as a torch
custom op, so torch.compile and CUDA graphs treat it as one opaque call.

split_attention_batch runs a batch of such steps (one per cache slot, each at its own positions) in one launch over
the whole cache: a grid axis over the batch rows, each row reading its own slot up to its own last position, with the
arithmetic of a launch for that row alone; given the positions, no mask is needed (causal by position, an optional
sliding window).

K and V may be read as the cache stores them (quant/kv_types.py): float rows of any float dtype, llama.cpp's
32-value blocks (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl) or the rotated turbo types' codebook indices (their
rotated-domain values: the caller rotates q and un-rotates the output). Each tile of keys is expanded in
registers, so the cache is read at its stored size. Rotated keys (a rotated type, or a block type stored rotated)
meet q rotated inside the kernel (the fast Hadamard transform in registers), and a rotated V's output is rotated
back in the merge.
"""
import functools
from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from flashdraft.kernels import pdl
from flashdraft.kernels.iq4 import iq4_value
from flashdraft.kernels.pdl import start_dependents, wait_for_inputs
from flashdraft.kernels.rotation import rotated_group
from flashdraft.quant.kv_types import lloyd_max_codebook, rotation_group, rotation_signs

# benchmarks/kernels/attention_kernel.py on an H200 (8B shape, 1280 / 16640 keys, docs/perf-history.md, 2026-12-04
# H200): 128 keys per tile and two pipeline stages took decode 24.9 -> 14.4 us and 112.7 -> 56.9 us; three stages of
# 64-key tiles had left one program per SM (131 KB of shared memory, 255 registers). Query rows (a GQA group's heads x
# tokens) come in tiles of ROW_TILE, each computed by the same code whatever tiles share its program, so a plain step's
# rows and a verify step's get the same bits. 16-row tiles ran a 16k decode in 34.6 us against 64-row tiles' 56.9 (the
# same sweep), where a group of 4 heads used 4 of the 64 rows.
BLOCK_N = 128
# over a stored (block or rotated) type, 64-key tiles and three stages: at 33k keys q4_1 48.5 us against 60.7 at 128
# keys and two stages, q5_0 69.3 against 80.7 (H200, benchmarks/kernels/attention_kernel.py --types,
# docs/perf-history.md, 2026-12-04)
STORED_BLOCK_N, STORED_STAGES = 64, 3
# no register cap: 168 a thread (three programs per SM) won some shapes and lost others by up to 2.7x (H100,
# docs/perf-history.md, 2026-12-05 H100)
ROW_TILE = 16
# Row tiles a program takes at once (heads of 128 values; fewer for larger heads), so the tiles share each tile of keys
# and values (and, over a stored type, its expansion). An H100, 8B heads, 16 query tokens over 16640 keys
# (benchmarks/kernels/attention_kernel.py): bf16 87.8 us at one tile a program, 77.5 at two, 77.4 at four; q4_1 93.7 ->
# 79.0 and q5_0 105.6 -> 99.3 at two (docs/perf-history.md, 2026-12-06 H100). At 2048 keys four tiles were slower (24.0
# us against 20.7), where a launch has only 16 splits: FEWER_TILES_BELOW keeps a launch's programs at least that many.
FLOAT_TILES, STORED_TILES = 4, 2
FEWER_TILES_BELOW = 264
# Wider heads (Gemma's 256 and 512) keep a tile's bytes: keys per tile and row tiles a program scale by 128 / D, so
# the K and V tiles and the accumulators take what a 128-wide head's do (at least 16 keys, one tile: tl.dot's minimum)
WIDE_FROM = 128
TARGET_PROGRAMS = 264  # about two programs per SM of an H100/H200
# Given the query tokens' positions, a launch splits the keys as a launch over the context's bucket would: the next
# power of two, at least MIN_BUCKET, that covers the last position (engine/steps.bucket_for; the kernel does not import
# the engine). A launch over the whole cache then computes what one over the bucket computes, bit for bit, so one
# CUDA graph a step serves every context length.
MIN_BUCKET = 256
_MIN_BUCKET = tl.constexpr(MIN_BUCKET)
MERGE_COLUMNS = 128  # a merge program's share of a head: one rotation group (quant/kv_types.ROTATION_GROUP)
NUM_WARPS, NUM_STAGES = 4, 2
# stored row types: 0 float; GGML ids of the block types; 100 + bits for the rotated types
ROW_TYPES = {"q8_0": 8, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "iq4_nl": 20, "turbo3": 103, "turbo4": 104}


def level_polynomial(bits: int) -> tuple[float, ...]:
    """c such that the rotated types' code k has level u * (c0 + c1 u^2 + c2 u^4 + ...), u = (k - h) / h, h = (2^bits -
    1) / 2: the odd polynomial through the (symmetric) Lloyd-Max levels, 2^(bits-1) coefficients; evaluated in
    float32 it gives every level within an ulp (tests/test_split_attention.py), a few FMAs instead of a gather."""
    levels = np.array(lloyd_max_codebook(bits))
    half = len(levels) // 2
    u = (np.arange(half, 2 * half) - (2 * half - 1) / 2) / ((2 * half - 1) / 2)
    return tuple(np.linalg.solve(np.stack([u ** (2 * i + 1) for i in range(half)], 1), levels[half:]).tolist())


T3_0, T3_1, T3_2, T3_3 = (tl.constexpr(c) for c in level_polynomial(3))
T4_0, T4_1, T4_2, T4_3, T4_4, T4_5, T4_6, T4_7 = (tl.constexpr(c) for c in level_polynomial(4))


@triton.jit
def turbo_level(code, BITS: tl.constexpr):
    """Rotated-type codes (integers) -> their codebook levels, float32 (level_polynomial)."""
    if BITS == 4:
        u = (code.to(tl.float32) - 7.5) * (1.0 / 7.5)
        s = u * u
        v = ((((((T4_7 * s + T4_6) * s + T4_5) * s + T4_4) * s + T4_3) * s + T4_2) * s + T4_1) * s + T4_0
    else:
        u = (code.to(tl.float32) - 3.5) * (1.0 / 3.5)
        s = u * u
        v = ((T3_3 * s + T3_2) * s + T3_1) * s + T3_0
    return v * u


def planes(row_type: int) -> int:
    """How many planes a stored type's row is read in: 2 for nibbles (low, high), 4 for turbo3's 2-bit fields."""
    return 1 if row_type in (0, 8) else 4 if row_type == 103 else 2


@triton.jit
def _plane_cols(j, p: tl.constexpr, TYPE: tl.constexpr, D: tl.constexpr):
    """The head-dimension columns of plane p's entries j (quant/kv_types.py's planar rows)."""
    if TYPE == 0 or TYPE == 8:
        cols = j
    elif TYPE > 100:
        G: tl.constexpr = 128 if D > 128 else D
        W: tl.constexpr = G // 2 if TYPE == 104 else G // 4
        cols = (j // W) * G + p * W + j % W
    else:
        cols = (j // 16) * 32 + p * 16 + j % 16
    return cols


@triton.jit
def _spread(x, per: tl.constexpr):
    """[N, B] per-block values -> [N, B * per]: each repeated for its block's `per` entries."""
    return tl.reshape(tl.broadcast_to(x[:, :, None], (x.shape[0], x.shape[1], per)), (x.shape[0], x.shape[1] * per))


@triton.jit
def _plane(base, n, n_ok, p: tl.constexpr, TYPE: tl.constexpr, D: tl.constexpr, ROW: tl.constexpr,
           PLANES: tl.constexpr):
    """Plane p of stored rows n [BLOCK_N] of one KV head (base: its row 0; ROW: elements per stored row) ->
    [BLOCK_N, D / PLANES] float32, columns _plane_cols. Scales are loaded once per block and spread."""
    j = tl.arange(0, D // PLANES)[None, :]
    row = base + n[:, None] * ROW
    ok = n_ok[:, None]
    if TYPE == 0:
        x = tl.load(row + j, mask=ok, other=0.0).to(tl.float32)
    elif TYPE == 8:
        q = tl.load(row + j, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        d = tl.load((row + D).to(tl.pointer_type(tl.float16)) + tl.arange(0, D // 32)[None, :], mask=ok, other=0.0)
        x = q * _spread(d.to(tl.float32), 32)
    elif TYPE > 100:
        BITS: tl.constexpr = TYPE - 100
        G: tl.constexpr = 128 if D > 128 else D
        W: tl.constexpr = G // 2 if BITS == 4 else G // 4
        if BITS == 4:
            code = (tl.load(row + j, mask=ok, other=0) >> (4 * p)) & 15
        else:
            g = j // W
            jr = j % W
            at = row + g * (3 * G // 8)
            low = (tl.load(at + jr, mask=ok, other=0) >> (2 * p)) & 3
            high = (tl.load(at + G // 4 + jr % (G // 8), mask=ok, other=0) >> (2 * p + jr // (G // 8)).to(tl.uint8)) & 1
            code = low | (high << 2)
        scale = tl.load((row + D * BITS // 8).to(tl.pointer_type(tl.float16)) + tl.arange(0, D // G)[None, :],
                        mask=ok, other=0.0)
        x = turbo_level(code, BITS) * _spread(scale.to(tl.float32), W)
    else:  # 32-value blocks: quants (D / 2 nibble bytes), scales, [mins], [fifth bits]
        NB: tl.constexpr = D // 32
        HAS_MIN: tl.constexpr = TYPE == 3 or TYPE == 7
        FIVE: tl.constexpr = TYPE == 6 or TYPE == 7
        b = tl.arange(0, NB)[None, :]
        byte = tl.load(row + j, mask=ok, other=0).to(tl.int32)
        d = tl.load((row + D // 2).to(tl.pointer_type(tl.float16)) + b, mask=ok, other=0.0).to(tl.float32)
        if TYPE == 20:
            x = iq4_value((byte >> (4 * p)) & 15) * _spread(d, 16)
        else:
            # d * code + o (o: the min, or -8 d / -16 d) as one FMA f * (2^bits d) + (o - 2^bits d), rounded once as d *
            # code + o (2^bits d and o - 2^bits d are exact in float32), where f = 1 + code / 2^bits is the code put at
            # the top of 1.0's mantissa: integer operations where a conversion (I2F.U16) would issue at a quarter of the
            # float rate (benchmarks/kernels/sass_report.py --kernels attention: 148 -> 20 such instructions a tile for
            # q4_1 and q5_0, the loop 1290 -> 1356 and 2032 -> 1638 instructions; docs/perf-history.md)
            BITS: tl.constexpr = 5 if FIVE else 4
            f = ((byte << (19 - BITS + 4 - 4 * p)) & (15 << (23 - BITS))) | 0x3F800000  # the nibble, placed
            if FIVE:  # block b's 32 fifth bits as one word; bit i for the block's value i = 16 p + r
                qh = tl.load((row + D // 2 + 2 * NB * (1 + HAS_MIN)).to(tl.pointer_type(tl.int32)) + b, mask=ok,
                             other=0)
                r = tl.arange(0, 16)[None, None, :]
                bits = ((qh[:, :, None] >> (16 * p + r)) & 1) << 22
                f = f | tl.reshape(bits, (qh.shape[0], NB * 16))
            if HAS_MIN:
                o = tl.load((row + D // 2 + 2 * NB).to(tl.pointer_type(tl.float16)) + b, mask=ok,
                            other=0.0).to(tl.float32)
            else:
                o = d * (-16.0 if FIVE else -8.0)
            x = f.to(tl.float32, bitcast=True) * _spread((1 << BITS) * d, 16) + _spread(o - (1 << BITS) * d, 16)
    return x


@triton.jit
def _planes(base, n, n_ok, TYPE: tl.constexpr, D: tl.constexpr, ROW: tl.constexpr, PLANES: tl.constexpr, dtype):
    """Every plane of stored rows n (_plane) in `dtype`, as four (planes past PLANES repeat plane 0, unused)."""
    p0 = _plane(base, n, n_ok, 0, TYPE, D, ROW, PLANES).to(dtype)
    p1, p2, p3 = p0, p0, p0
    if PLANES > 1:
        p1 = _plane(base, n, n_ok, 1, TYPE, D, ROW, PLANES).to(dtype)
    if PLANES > 2:
        p2 = _plane(base, n, n_ok, 2, TYPE, D, ROW, PLANES).to(dtype)
        p3 = _plane(base, n, n_ok, 3, TYPE, D, ROW, PLANES).to(dtype)
    return p0, p1, p2, p3


@triton.jit
def _plane_of(x, p: tl.constexpr, TYPE: tl.constexpr, D: tl.constexpr, PLANES: tl.constexpr):
    """Rows x [M, D] in registers -> their plane p's columns [M, D / PLANES], in _plane_cols' order."""
    M: tl.constexpr = x.shape[0]
    if PLANES == 1:
        plane = x
    else:
        G: tl.constexpr = (128 if D > 128 else D) if TYPE > 100 else 32  # columns per group of planes
        W: tl.constexpr = G // PLANES
        y = tl.permute(tl.reshape(x, [M, D // G, PLANES, W]), [0, 1, 3, 2])  # [M, groups, W, plane]
        if PLANES == 4:  # plane 2a + b: split off b, then a
            y0, y1 = tl.split(tl.reshape(y, [M, D // G, W, 2, 2]))
            if p % 2 == 0:
                a0, a1 = tl.split(y0)
            else:
                a0, a1 = tl.split(y1)
        else:
            a0, a1 = tl.split(y)
        FIRST: tl.constexpr = p < 2 if PLANES == 4 else p == 0
        if FIRST:
            plane = tl.reshape(a0, [M, D // PLANES])
        else:
            plane = tl.reshape(a1, [M, D // PLANES])
    return plane


@triton.jit
def _query_planes(q_ptr, signs_ptr, tile, kv, stride_qt, stride_qh, T, G, D: tl.constexpr, BLOCK_M: tl.constexpr,
                  K_TYPE: tl.constexpr, K_PLANES: tl.constexpr, K_ROTATED: tl.constexpr):
    """Row tile `tile` of a KV head's query rows (row r: query token r % T of head kv * G + r // T), cut into the
    keys' planes (K_ROTATED: rotated first); planes past K_PLANES repeat one of them."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    q = tl.load(q_ptr + (rows % T)[:, None] * stride_qt + (kv * G + rows // T)[:, None] * stride_qh
                + tl.arange(0, D)[None, :], mask=(rows < G * T)[:, None], other=0.0)
    if K_ROTATED:  # into the keys' rotated domain (kernels/rotation.py), by groups of RG values
        RG: tl.constexpr = 128 if D > 128 else D
        q = tl.reshape(rotated_group(tl.reshape(q.to(tl.float32), [BLOCK_M * (D // RG), RG]), signs_ptr, RG, False),
                       [BLOCK_M, D]).to(q.dtype)
    return (_plane_of(q, 0, K_TYPE, D, K_PLANES), _plane_of(q, 1 % K_PLANES, K_TYPE, D, K_PLANES),
            _plane_of(q, 2 % K_PLANES, K_TYPE, D, K_PLANES), _plane_of(q, 3 % K_PLANES, K_TYPE, D, K_PLANES))


def split_partition(keys: int, block_n: int, max_splits: int) -> tuple[int, int]:
    """(blocks of keys a split takes, splits) for a launch over `keys` keys: as many splits as blocks up to
    max_splits, then as many blocks a split as it takes to cover the keys in max_splits splits or fewer."""
    blocks = triton.cdiv(keys, block_n)
    per_split = triton.cdiv(blocks, min(blocks, max_splits))
    return per_split, triton.cdiv(blocks, per_split)


@triton.jit
def _bucket_partition(pos_ptr, T, L, max_splits, BLOCK_N: tl.constexpr):
    """split_partition of the keys up to the bucket of the last query position (positions at pos_ptr, the last the
    largest; MIN_BUCKET), at most L: (the keys up to the last position, blocks a split, splits)."""
    live = tl.load(pos_ptr + T - 1).to(tl.int32) + 1
    n = tl.maximum(live, _MIN_BUCKET) - 1  # the next power of two >= live, by its bits
    n = n | (n >> 1)
    n = n | (n >> 2)
    n = n | (n >> 4)
    n = n | (n >> 8)
    n = n | (n >> 16)
    blocks = (tl.minimum(n + 1, L) + BLOCK_N - 1) // BLOCK_N
    splits = tl.minimum(blocks, max_splits)
    per_split = (blocks + splits - 1) // splits
    return live, per_split, (blocks + per_split - 1) // per_split


@triton.jit
def _empty_state(BLOCK_M: tl.constexpr, WV: tl.constexpr):
    """A row tile's running state: the V planes' accumulators, the row maxima (finite: a split with every key
    masked stays NaN-free), the row sums."""
    acc = tl.zeros([BLOCK_M, WV], tl.float32)
    return acc, acc, acc, acc, tl.full([BLOCK_M], -1e30, tl.float32), tl.zeros([BLOCK_M], tl.float32)


@triton.jit
def _allowed(mask_ptr, pos_ptr, rows, cols, col_ok, stride_mt, window, T, G, MASK: tl.constexpr,
             WINDOW: tl.constexpr):
    """[rows, cols] True where query row `rows` attends key `cols`: the mask's entry (MASK), else by position (key j
    is position j; query token t at pos_ptr[t]): the keys at or before it, less than `window` before it (WINDOW)."""
    if MASK:
        allowed = tl.load(mask_ptr + (rows % T)[:, None] * stride_mt + cols[None, :],
                          mask=(rows < G * T)[:, None] & col_ok[None, :], other=0) != 0
    else:
        at = tl.load(pos_ptr + rows % T, mask=rows < G * T, other=-1).to(tl.int32)[:, None]
        allowed = (cols[None, :] <= at) & col_ok[None, :]
        if WINDOW:
            allowed = allowed & (at - cols[None, :] < window)
    return allowed


@triton.jit
def _softmax_tile(qs, state, ks, mask_ptr, pos_ptr, tile, cols, col_ok, stride_mt, window, scale, softcap, T, G,
                  BLOCK_M: tl.constexpr, SOFTCAP: tl.constexpr, K_PLANES: tl.constexpr, MASK: tl.constexpr,
                  WINDOW: tl.constexpr):
    """One row tile's scores against a tile of keys (planes ks, in registers), online softmax: (p, the factor the
    accumulators are rescaled by, the state with the new row maxima and sums). Every tile of a program runs this
    code and _accumulate_tile's, so a row's arithmetic does not depend on the tiles beside it."""
    acc0, acc1, acc2, acc3, m_i, l_i = state
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    s = tl.dot(qs[0], tl.trans(ks[0]))
    if K_PLANES > 1:
        s += tl.dot(qs[1], tl.trans(ks[1]))
    if K_PLANES > 2:
        s += tl.dot(qs[2], tl.trans(ks[2])) + tl.dot(qs[3], tl.trans(ks[3]))
    s = s * scale
    if SOFTCAP:  # softcap * tanh(s / softcap), tanh through exp (no libdevice call: the interpreter runs it too)
        s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)
    allowed = _allowed(mask_ptr, pos_ptr, rows, cols, col_ok, stride_mt, window, T, G, MASK, WINDOW)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return p.to(qs[0].dtype), alpha, (acc0, acc1, acc2, acc3, m_new, l_i)


@triton.jit
def _accumulate_tile(state, p, alpha, vs, V_PLANES: tl.constexpr):
    """The accumulators rescaled and p times the tile of values (planes vs, in registers) added."""
    acc0, acc1, acc2, acc3, m_i, l_i = state
    acc0 = acc0 * alpha[:, None] + tl.dot(p, vs[0])
    if V_PLANES > 1:
        acc1 = acc1 * alpha[:, None] + tl.dot(p, vs[1])
    if V_PLANES > 2:
        acc2 = acc2 * alpha[:, None] + tl.dot(p, vs[2])
        acc3 = acc3 * alpha[:, None] + tl.dot(p, vs[3])
    return acc0, acc1, acc2, acc3, m_i, l_i


@triton.jit
def _store_tile(state, acc_ptr, m_ptr, l_ptr, base, n_rows, tile, T, G, D: tl.constexpr, BLOCK_M: tl.constexpr,
                V_TYPE: tl.constexpr, V_PLANES: tl.constexpr):
    """A row tile's partial sums, row maxima and row sums, for the merge."""
    acc0, acc1, acc2, acc3, m_i, l_i = state
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < G * T
    out = acc_ptr + (base * n_rows + rows[:, None]) * D
    jv = tl.arange(0, D // V_PLANES)
    tl.store(out + _plane_cols(jv, 0, V_TYPE, D)[None, :], acc0, mask=row_ok[:, None])
    if V_PLANES > 1:
        tl.store(out + _plane_cols(jv, 1, V_TYPE, D)[None, :], acc1, mask=row_ok[:, None])
    if V_PLANES > 2:
        tl.store(out + _plane_cols(jv, 2, V_TYPE, D)[None, :], acc2, mask=row_ok[:, None])
        tl.store(out + _plane_cols(jv, 3, V_TYPE, D)[None, :], acc3, mask=row_ok[:, None])
    tl.store(m_ptr + base * n_rows + rows, m_i, mask=row_ok)
    tl.store(l_ptr + base * n_rows + rows, l_i, mask=row_ok)


# Query count, group size, key count and the mask's row stride are runtime values, never specialised on, and every
# row tile runs _softmax_tile's and _accumulate_tile's code: a plain step (T=1, one tile a program) and a verify
# step (T=16, TILES tiles a program) compute a row the same way, bit for bit (tests/test_split_attention.py's row
# invariance on the GPU). Batch rows only move pointers (program_id(1) = row * n_kv + KV head): a row computes
# the same bits whatever rows share its launch.
@triton.jit(do_not_specialize=["stride_qb", "stride_mb", "stride_mt", "stride_pb", "L", "blocks_per_split",
                               "max_splits", "grid_splits", "window", "T", "G", "n_rows"])
def _partial_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, m_ptr, l_ptr, signs_ptr, pos_ptr, slots_ptr,
                    stride_qb, stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_mb, stride_mt,
                    stride_pb, L, blocks_per_split, max_splits, grid_splits, n_kv, scale, softcap, window, T, G,
                    n_rows, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
                    K_TYPE: tl.constexpr, V_TYPE: tl.constexpr, K_ROW: tl.constexpr, V_ROW: tl.constexpr,
                    K_PLANES: tl.constexpr, V_PLANES: tl.constexpr, K_ROTATED: tl.constexpr, TILES: tl.constexpr,
                    POSITIONS: tl.constexpr, SLOTS: tl.constexpr, MASK: tl.constexpr, WINDOW: tl.constexpr,
                    PDL: tl.constexpr):
    """TILES (1, 2 or 4) row tiles of BLOCK_M query rows of one (batch row, KV head, split): each tile of keys and
    values is read once for all of them. Keys and values are read in planes (one for float rows and q8_0; low and
    high nibbles; turbo3's four 2-bit fields): q is loaded once (K_ROTATED: rotated here) and cut into the planes'
    column orders, the scores are the sum of the planes' products, and each plane of V has its own accumulator,
    stored to its columns at the end. Batch row b reads cache slot slots_ptr[b] (SLOTS; else slot b). POSITIONS:
    pos_ptr holds each batch row's query positions (the last the largest), key j is position j and no query attends
    a later key, so the tiles of keys past the row's last are skipped (a tile masked for every query leaves the state
    exactly as it was: the same bits either way), and its keys are split as over its last position's bucket
    (_bucket_partition, not blocks_per_split): the programs of splits past its last exit at once, writing nothing
    (the merge takes the same splits). MASK: the mask says which keys a query attends; else its position does
    (_allowed)."""
    # programs of one (KV head, split) are neighbours in the launch order: they read the same keys together, so
    # where a launch keeps one tile a program (short contexts) the extra tiles find them in L2
    wait_for_inputs(PDL)
    kv = tl.program_id(1) % n_kv
    b = (tl.program_id(1) // n_kv).to(tl.int64)
    split = tl.program_id(2)
    q_ptr += b * stride_qb
    mask_ptr += b * stride_mb
    pos_ptr += b * stride_pb
    if POSITIONS:
        live, blocks_per_split, n_splits = _bucket_partition(pos_ptr, T, L, max_splits, BLOCK_N)
        if split >= n_splits:
            return
    first = tl.program_id(0) * TILES
    WV: tl.constexpr = D // V_PLANES
    qa = _query_planes(q_ptr, signs_ptr, first, kv, stride_qt, stride_qh, T, G, D, BLOCK_M, K_TYPE, K_PLANES,
                       K_ROTATED)
    sa = _empty_state(BLOCK_M, WV)
    if TILES > 1:
        qb = _query_planes(q_ptr, signs_ptr, first + 1, kv, stride_qt, stride_qh, T, G, D, BLOCK_M, K_TYPE,
                           K_PLANES, K_ROTATED)
        sb = _empty_state(BLOCK_M, WV)
    if TILES > 2:
        qc = _query_planes(q_ptr, signs_ptr, first + 2, kv, stride_qt, stride_qh, T, G, D, BLOCK_M, K_TYPE,
                           K_PLANES, K_ROTATED)
        qd = _query_planes(q_ptr, signs_ptr, first + 3, kv, stride_qt, stride_qh, T, G, D, BLOCK_M, K_TYPE,
                           K_PLANES, K_ROTATED)
        sc = _empty_state(BLOCK_M, WV)
        sd = _empty_state(BLOCK_M, WV)
    slot = b
    if SLOTS:
        slot = tl.load(slots_ptr + b).to(tl.int64)
    k_base, v_base = k_ptr + slot * stride_ks + kv * stride_kh, v_ptr + slot * stride_vs + kv * stride_vh
    start = split * blocks_per_split * BLOCK_N
    dtype = qa[0].dtype
    n_blocks = blocks_per_split
    if POSITIONS:
        n_blocks = tl.minimum(n_blocks, (tl.maximum(live - start, 0) + BLOCK_N - 1) // BLOCK_N)
    for i in range(0, n_blocks):
        cols = start + i * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < L
        ks = _planes(k_base, cols, col_ok, K_TYPE, D, K_ROW, K_PLANES, dtype)
        # every tile's scores first, then the values: K's and V's tiles are not held at once
        pa, aa, sa = _softmax_tile(qa, sa, ks, mask_ptr, pos_ptr, first, cols, col_ok, stride_mt, window, scale,
                                   softcap, T, G, BLOCK_M, SOFTCAP, K_PLANES, MASK, WINDOW)
        if TILES > 1:
            pb, ab, sb = _softmax_tile(qb, sb, ks, mask_ptr, pos_ptr, first + 1, cols, col_ok, stride_mt, window,
                                       scale, softcap, T, G, BLOCK_M, SOFTCAP, K_PLANES, MASK, WINDOW)
        if TILES > 2:
            pc, ac, sc = _softmax_tile(qc, sc, ks, mask_ptr, pos_ptr, first + 2, cols, col_ok, stride_mt, window,
                                       scale, softcap, T, G, BLOCK_M, SOFTCAP, K_PLANES, MASK, WINDOW)
            pd, ad, sd = _softmax_tile(qd, sd, ks, mask_ptr, pos_ptr, first + 3, cols, col_ok, stride_mt, window,
                                       scale, softcap, T, G, BLOCK_M, SOFTCAP, K_PLANES, MASK, WINDOW)
        vs = _planes(v_base, cols, col_ok, V_TYPE, D, V_ROW, V_PLANES, dtype)
        sa = _accumulate_tile(sa, pa, aa, vs, V_PLANES)
        if TILES > 1:
            sb = _accumulate_tile(sb, pb, ab, vs, V_PLANES)
        if TILES > 2:
            sc = _accumulate_tile(sc, pc, ac, vs, V_PLANES)
            sd = _accumulate_tile(sd, pd, ad, vs, V_PLANES)
    # the next kernel (the merge) is placed once every program got here, not at the start: a merge program placed
    # early waits on its SM through the whole loop, holding registers a program here could use
    start_dependents(PDL)
    base = (b * grid_splits + split) * n_kv + kv
    _store_tile(sa, acc_ptr, m_ptr, l_ptr, base, n_rows, first, T, G, D, BLOCK_M, V_TYPE, V_PLANES)
    if TILES > 1:
        _store_tile(sb, acc_ptr, m_ptr, l_ptr, base, n_rows, first + 1, T, G, D, BLOCK_M, V_TYPE, V_PLANES)
    if TILES > 2:
        _store_tile(sc, acc_ptr, m_ptr, l_ptr, base, n_rows, first + 2, T, G, D, BLOCK_M, V_TYPE, V_PLANES)
        _store_tile(sd, acc_ptr, m_ptr, l_ptr, base, n_rows, first + 3, T, G, D, BLOCK_M, V_TYPE, V_PLANES)


@triton.jit(do_not_specialize=["stride_ob", "stride_ot", "stride_pb", "n_splits", "L", "max_splits", "grid_splits",
                               "T", "G", "n_rows"])
def _merge_kernel(acc_ptr, m_ptr, l_ptr, signs_ptr, out_ptr, pos_ptr, stride_ob, stride_ot, stride_oh, stride_pb,
                  n_splits, L, max_splits, grid_splits, n_kv, T, G, n_rows, D: tl.constexpr, DC: tl.constexpr,
                  SPLITS: tl.constexpr, ROTATION: tl.constexpr, BLOCK_N: tl.constexpr, POSITIONS: tl.constexpr,
                  PDL: tl.constexpr):
    """Columns [DC * program_id(2), + DC) of one query row (program_id(1)) of one (batch row, KV head)'s group
    (program_id(0) = batch row * n_kv + KV head): the splits' partial sums merged by their log-sum-exp, every split
    loaded at once (SPLITS: a power of two, at least n_splits). ROTATION > 0: V was stored rotated in groups of that
    many values (layers/kv_quant.rotate; DC is a multiple of it), so each group of the output is rotated back (x R;
    R's signs at signs_ptr). POSITIONS: the splits are the batch row's last position's bucket's (_bucket_partition,
    as _partial_kernel took them), not n_splits."""
    wait_for_inputs(PDL)
    start_dependents(PDL)
    kv = tl.program_id(0) % n_kv
    b = (tl.program_id(0) // n_kv).to(tl.int64)
    row = tl.program_id(1)
    if POSITIONS:
        live, per_split, n_splits = _bucket_partition(pos_ptr + b * stride_pb, T, L, max_splits, BLOCK_N)
    s = tl.arange(0, SPLITS)
    s_ok = s < n_splits
    at = ((b * grid_splits + s) * n_kv + kv) * n_rows + row
    m = tl.load(m_ptr + at, mask=s_ok, other=-1e30)
    weight = tl.where(s_ok, tl.exp(m - tl.max(m, 0)), 0.0)
    denom = tl.sum(tl.load(l_ptr + at, mask=s_ok, other=0.0) * weight, 0)
    d = tl.program_id(2) * DC + tl.arange(0, DC)
    acc = tl.load(acc_ptr + at[:, None] * D + d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / denom
    if ROTATION > 0:
        out = tl.reshape(rotated_group(tl.reshape(out, [DC // ROTATION, ROTATION]), signs_ptr, ROTATION, True), [DC])
    head = kv * G + row // T
    tl.store(out_ptr + b * stride_ob + (row % T) * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


@functools.cache
def triton_matmul_ready(device_index: int) -> bool:
    """bf16 matrix products in Triton need an Ampere or newer GPU; older ones take the matmul attention."""
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


@torch.library.custom_op("flashdraft::split_attention", mutates_args=())
def split_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float, softcap: float,
                    k_type: int = 0, v_type: int = 0, v_rotated: bool = False, k_rotated: bool = False,
                    positions: Optional[Tensor] = None) -> Tensor:
    """q [T, H, D]; keys/values [KV, L, D] floats (any strides but the last), or [KV, L, row bytes] stored as
    ROW_TYPES k_type / v_type say; mask [T, L] bool; softcap 0: none. Rotated rows (layers/kv_quant.rotate, by groups
    of rotation_group(D)): k_rotated, q is taken into the keys' domain; v_rotated, the output is rotated back. positions
    [T] (integers, the last the largest): the query tokens' positions, where key j is position j and the mask hides
    every key after a query's position; no key past the last is then read, so a captured step attends over its
    context, not its whole bucket, and the keys are split as for the keys up to the last position's bucket
    (MIN_BUCKET): handed the whole cache, a launch computes what it computes handed the bucket's rows, bit for bit.
    Returns [T, H*D] in q's dtype."""
    if q.is_cuda and not triton_matmul_ready(torch.cuda.current_device() if q.device.index is None else q.device.index):
        if k_type or v_type:
            raise ValueError("quantized KV rows need the Triton kernel (an Ampere or newer GPU)")
        from flashdraft.layers.attention import grouped_attention
        return grouped_attention(q, keys, values, mask, scale, softcap or None)
    return _launch(q[None], keys[None], values[None], None, mask[None], None if positions is None else positions[None],
                   scale, softcap, k_type, v_type, v_rotated, k_rotated, 0)[0]


@split_attention.register_fake
def _(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float, softcap: float, k_type: int = 0,
      v_type: int = 0, v_rotated: bool = False, k_rotated: bool = False, positions: Optional[Tensor] = None) -> Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


@torch.library.custom_op("flashdraft::split_attention_batch", mutates_args=())
def split_attention_batch(q: Tensor, keys: Tensor, values: Tensor, slots: Tensor, mask: Optional[Tensor],
                          positions: Optional[Tensor], scale: float, softcap: float, k_type: int = 0, v_type: int = 0,
                          v_rotated: bool = False, k_rotated: bool = False, window: int = 0) -> Tensor:
    """split_attention for a batch of rows over a whole cache's slots, in one launch: q [B, T, H, D]; keys/values
    [S, KV, L, D] or [S, KV, L, row bytes] (KVCache.k / .v, rows cut to L); slots [B] (integers): the slot batch row
    b reads. mask [B, T, L] bool, or None: then the positions say which keys a query attends (key j is position j:
    those at or before the query's, and less than `window` before it where window > 0; `window` is ignored beside a
    mask). positions [B, T] as split_attention's, per batch row: row b reads no key past positions[b, -1] and splits
    its keys by that position's bucket, so rows of any lengths share one launch (and one CUDA graph), and a row comes
    out with the bits split_attention gives it alone. Returns [B, T, H*D] in q's dtype."""
    if mask is None and positions is None:
        raise ValueError("split_attention_batch needs a mask or the queries' positions")
    if q.is_cuda and not triton_matmul_ready(torch.cuda.current_device() if q.device.index is None else q.device.index):
        if k_type or v_type:
            raise ValueError("quantized KV rows need the Triton kernel (an Ampere or newer GPU)")
        return _matmul_batch(q, keys[slots], values[slots], mask, positions, scale, softcap, window)
    return _launch(q, keys, values, slots, mask, positions, scale, softcap, k_type, v_type, v_rotated, k_rotated,
                   window)


@split_attention_batch.register_fake
def _(q: Tensor, keys: Tensor, values: Tensor, slots: Tensor, mask: Optional[Tensor], positions: Optional[Tensor],
      scale: float, softcap: float, k_type: int = 0, v_type: int = 0, v_rotated: bool = False, k_rotated: bool = False,
      window: int = 0) -> Tensor:
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2] * q.shape[3])


def _matmul_batch(q: Tensor, keys: Tensor, values: Tensor, mask: Optional[Tensor], positions: Optional[Tensor],
                  scale: float, softcap: float, window: int) -> Tensor:
    """Batch rows one at a time through the matmul attention (GPUs before Ampere): keys/values [B, KV, L, D]."""
    from flashdraft.layers.attention import grouped_attention, position_mask
    if mask is None:
        mask = position_mask(positions, torch.arange(keys.shape[2], device=q.device), True, window or None)
    return torch.stack([grouped_attention(q[b], keys[b], values[b], mask[b], scale, softcap or None)
                        for b in range(q.shape[0])])


def _launch(q: Tensor, keys: Tensor, values: Tensor, slots: Optional[Tensor], mask: Optional[Tensor],
            positions: Optional[Tensor], scale: float, softcap: float, k_type: int, v_type: int, v_rotated: bool,
            k_rotated: bool, window: int) -> Tensor:
    """The two kernels over q [B, T, H, D] and keys/values [S, KV, L, row] (batch row b reads slot slots[b], or
    slot b without slots); mask [B, T, L] or None (positions [B, T] then decide). Returns [B, T, H*D]."""
    B, T, H, D = q.shape
    KV, L = keys.shape[1], keys.shape[2]
    G = H // KV
    if q.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("split_attention needs the head dimension contiguous")
    if D & (D - 1) or D < 16:
        raise ValueError(f"split_attention needs a power-of-two head size >= 16, got {D}")
    # One tile height for decode (T=1) and verify (T=16) rows, and one-tile splits until L passes BLOCK_N * max_splits
    # keys (4224 for 8 KV heads; beyond, the split length changes only where the context bucket doubles; given the
    # positions, L is the last position's bucket): a token's attention then comes out bit for bit the same whether a
    # plain step or a verify step computes it. The partition does not depend on B: a batch row's neither.
    row_tiles = triton.cdiv(G * T, ROW_TILE)
    n_rows = row_tiles * ROW_TILE
    block_n, stages = (STORED_BLOCK_N, STORED_STAGES) if k_type or v_type else (BLOCK_N, NUM_STAGES)
    wide = max(1, D // WIDE_FROM)
    block_n = max(16, block_n // wide)
    max_splits = triton.cdiv(TARGET_PROGRAMS, KV)
    blocks_per_split, splits = split_partition(L, block_n, max_splits)
    if positions is not None:  # the kernel splits the keys up to the last position's bucket: room for the most
        splits = min(triton.cdiv(L, block_n), max_splits)  # splits any bucket up to L takes
        positions = positions.contiguous()
    tiles = max(1, min(triton.next_power_of_2(row_tiles),
                       STORED_TILES // wide if k_type or v_type else FLOAT_TILES * 128 // D))
    while tiles > 1 and triton.cdiv(row_tiles, tiles) * B * KV * splits < FEWER_TILES_BELOW:
        tiles //= 2  # short contexts have few splits: keep the programs many
    acc = torch.empty(B, splits, KV, n_rows, D, device=q.device, dtype=torch.float32)
    m = torch.empty(B, splits, KV, n_rows, device=q.device, dtype=torch.float32)
    lse = torch.empty_like(m)
    if keys.stride(2) != keys.shape[3]:  # the kernel steps rows by their size (a compile-time constant)
        keys = keys.contiguous()
    if values.stride(2) != values.shape[3]:
        values = values.contiguous()
    if mask is not None:
        mask = mask.contiguous().view(torch.uint8)
    if slots is not None:
        slots = slots.contiguous()
    out = torch.empty(B, T, H, D, device=q.device, dtype=q.dtype)
    group = rotation_group(D) if v_rotated else 0
    v_signs = rotation_signs(group, q.device) if group else acc
    grid = (triton.cdiv(row_tiles, tiles), B * KV, splits)
    _partial_kernel[grid](q, keys, values, acc if mask is None else mask, acc, m, lse,
                          rotation_signs(rotation_group(D), q.device) if k_rotated else acc,
                          acc if positions is None else positions, acc if slots is None else slots,
                          q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1), values.stride(0),
                          values.stride(1), 0 if mask is None else mask.stride(0),
                          0 if mask is None else mask.stride(1), 0 if positions is None else positions.stride(0),
                          L, blocks_per_split, max_splits, splits, KV, scale, softcap or 1.0, window, T, G, n_rows,
                          D=D, BLOCK_M=ROW_TILE, BLOCK_N=block_n, SOFTCAP=softcap > 0, K_TYPE=k_type,
                          V_TYPE=v_type, K_ROW=keys.shape[3], V_ROW=values.shape[3],
                          K_PLANES=planes(k_type), V_PLANES=planes(v_type), K_ROTATED=k_rotated,
                          TILES=tiles, POSITIONS=positions is not None, SLOTS=slots is not None,
                          MASK=mask is not None, WINDOW=mask is None and window > 0, num_warps=NUM_WARPS,
                          num_stages=stages, **pdl.launch(q))
    # one program per query row and 128 columns, every split at once: 8 programs of 16 rows that took the splits in
    # turn ran a decode step's merges in 179 us against 86 (H200, 8B, 1k keys; docs/perf-history.md, 2026-12-05 H200)
    dc = min(D, MERGE_COLUMNS)
    merge_splits = max(2, triton.next_power_of_2(max_splits))  # one compiled variant for every length
    _merge_kernel[(B * KV, G * T, D // dc)](acc, m, lse, v_signs, out, acc if positions is None else positions,
                                            out.stride(0), out.stride(1), out.stride(2),
                                            0 if positions is None else positions.stride(0), splits, L, max_splits,
                                            splits, KV, T, G, n_rows, D=D, DC=dc, SPLITS=merge_splits,
                                            ROTATION=group, BLOCK_N=block_n, POSITIONS=positions is not None,
                                            num_warps=8 if merge_splits * dc > 8192 else 4, **pdl.launch(q))
    return out.view(B, T, H * D)
