"""Q4_K products for verify widths (5-64 rows of x) on the tensor cores, unpacked as the integer kernels do: each
super-block's 32 nibble words are loaded whole, and one shift and one LOP3 turn a word's nibbles at bits s and
16 + s into two bf16 values 128 + q (a magic-number conversion: no int-to-float instruction); the 128 comes off and
the sub-block's scale and minimum apply in packed bf16 (HFMA2). The words' nibbles are not in K order, so x is
permuted once per call into the words' order (`x_order`) and each super-block is four K=64 products, one per
nibble slot s = 0, 4, 8, 12. The per-sub-block scales pass through an opaque move (`_pin`): without it Triton
recomputes the scale arithmetic for every weight in the operand's layout.

Not the default yet (`ENABLED`): read statically with benchmarks/sass_report.py (sm_90) at 0.42 warp-instructions
per weight byte (BLOCK_N 32; 0.34 at 64) against the float kernel's 0.54 (0.50), but not yet timed on a GPU
(docs/PERF.md).
"""
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from flashdraft.kernels import gguf_gemv

ENABLED = False


@triton.jit
def _slot(words, S: tl.constexpr, EMULATE: tl.constexpr):
    """words [N, 32] -> [N, 32, 2] bf16: 128 + the nibble at bits S (last index 0) and at 16 + S (index 1). One
    shift and one LOP3 per word make both bf16 bit patterns at once (a magic-number conversion: 0x4300 | q is
    128 + q); the join and the 16-bit split only name the word's two halves."""
    if EMULATE:  # the interpreter has no bf16 arithmetic: float32 values
        h = tl.arange(0, 2)[None, None, :]
        return (((words[:, :, None] >> (S + 16 * h)) & 15) + 128).to(tl.float32)
    else:
        v = ((words >> S) & 0x000F000F) | 0x43004300
        return tl.join(v & 0xFFFF, (v >> 16) & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _pin(x, EMULATE: tl.constexpr):
    """x unchanged, through a move the compiler may not duplicate: consumers in another layout receive it by a
    layout conversion instead of recomputing its producers per element."""
    if EMULATE:
        return x
    else:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.bfloat16, is_pure=False, pack=2)


@triton.jit
def _slot_product(acc, words, S: tl.constexpr, scale, low, x_base, m_ok, BLOCK_N: tl.constexpr,
                  EMULATE: tl.constexpr):
    q = _slot(words, S, EMULATE) - 128.0  # [N, 32, 2]: word t, half h
    w = tl.reshape(tl.reshape(q, (BLOCK_N, 4, 8, 2)) * scale - low, (BLOCK_N, 64))  # [N, g, t % 8, h]
    x = tl.load(x_base + (S // 4) * 64 + tl.arange(0, 64)[None, :], mask=m_ok[:, None], other=0.0)
    return acc + tl.dot(x, tl.trans(w.to(x.dtype)))


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_om"])
def _q4k_words_kernel(x_ptr, w_ptr, out_ptr, M, N, K, chunks_per_split, stride_xm, stride_wu, stride_os, stride_om,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROW_ALIGN: tl.constexpr, EMULATE: tl.constexpr):
    """x_ptr: x in `x_order`; w as int32 words (36 per super-block: d and dmin, 3 scale words, 32 nibble words).
    Word t of a super-block holds sub-block 2 (t // 8) in its low nibbles and 2 (t // 8) + 1 in its high ones."""
    pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    first = split * chunks_per_split
    last = tl.minimum(first + chunks_per_split, K // 256)
    row_base = w_ptr + rows.to(tl.int64) * (stride_wu * ROW_ALIGN)
    t = tl.arange(0, 32)[None, :]
    g = tl.arange(0, 4)[None, :]
    DT: tl.constexpr = tl.float32 if EMULATE else tl.bfloat16
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for c in range(first, last):
        base = row_base + c * 36
        head = tl.load(base, mask=row_ok, other=0)
        a = tl.load(base + 1, mask=row_ok, other=0)[:, None]
        b = tl.load(base + 2, mask=row_ok, other=0)[:, None]
        s = tl.load(base + 3, mask=row_ok, other=0)[:, None]
        d, dmin = gguf_gemv._half(head)[:, None], gguf_gemv._half(head >> 16)[:, None]
        sc_lo, mn_lo = gguf_gemv._k_scale_bytes(a, b, s, 2 * g)  # [N, 4]: sub-blocks 2g (low nibbles)
        sc_hi, mn_hi = gguf_gemv._k_scale_bytes(a, b, s, 2 * g + 1)
        scale_lo = _pin((d * sc_lo).to(DT), EMULATE)[:, :, None, None]
        low_lo = _pin((dmin * mn_lo).to(DT), EMULATE)[:, :, None, None]
        scale_hi = _pin((d * sc_hi).to(DT), EMULATE)[:, :, None, None]
        low_hi = _pin((dmin * mn_hi).to(DT), EMULATE)[:, :, None, None]
        words = tl.load(base[:, None] + 4 + t, mask=row_ok[:, None], other=0)
        x_base = x_ptr + m[:, None] * stride_xm + c * 256
        acc = _slot_product(acc, words, 0, scale_lo, low_lo, x_base, m_ok, BLOCK_N, EMULATE)
        acc = _slot_product(acc, words, 4, scale_hi, low_hi, x_base, m_ok, BLOCK_N, EMULATE)
        acc = _slot_product(acc, words, 8, scale_lo, low_lo, x_base, m_ok, BLOCK_N, EMULATE)
        acc = _slot_product(acc, words, 12, scale_hi, low_hi, x_base, m_ok, BLOCK_N, EMULATE)
    tl.store(out_ptr + split * stride_os + m[:, None] * stride_om + rows[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & row_ok[None, :])


@functools.cache
def x_order(k: int, device: torch.device) -> Tensor:
    """For each position of x in the words' order, its position in K: per super-block, slot s = 4i's 64 values
    (word t, half h) hold byte i // 2 + 2h of word t, nibble i % 2: sub-block 2 (t // 8) + i % 2, weight
    4 (t % 8) + i // 2 + 2h of it."""
    i, t, h = torch.meshgrid(torch.arange(4), torch.arange(32), torch.arange(2), indexing="ij")
    within = 32 * (2 * (t // 8) + i % 2) + 4 * (t % 8) + i // 2 + 2 * h
    return (torch.arange(k // 256)[:, None] * 256 + within.reshape(1, -1)).reshape(-1).to(device)


def q4k_products(x: Tensor, qweight: Tensor, k: int, partial: Tensor, per_split: int, block_m: int, block_n: int,
                 num_warps: int) -> None:
    """partial [splits, M, N] (float32, or x's dtype for one split) = x @ dequantize(qweight)^T per split of K."""
    m, n = x.shape[0], qweight.shape[0]
    xw = x[:, x_order(k, x.device)]
    w = qweight.view(torch.int32)
    align = gguf_gemv.row_align(w)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), partial.shape[0])
    _q4k_words_kernel[grid](xw, w, partial, m, n, k, per_split, xw.stride(0), w.stride(0) // align, partial.stride(0),
                            partial.stride(1), BLOCK_M=block_m, BLOCK_N=block_n, ROW_ALIGN=align,
                            EMULATE=gguf_gemv._emulate(), num_warps=num_warps)
