"""Split-K ("flash-decoding") attention for a few query tokens over a long KV cache, in Triton.

Decode, verify and draft steps have 1-16 query tokens, so an attention kernel that gives each (batch, head) one
program leaves most of the GPU idle while it walks the cache. Here the keys are cut into splits, one program per
(KV head, split) computes a partial softmax-weighted sum for all the query heads of its group at once (GQA
without repeating K/V), and a second kernel merges the splits by their log-sum-exp. The mask is an explicit
bool [T, L] (True = attend), so causal, sliding-window and the draft's non-causal ring layouts all go through
the same kernel; the score scale and an optional tanh softcap are arguments. Registered as a torch custom op,
so torch.compile and CUDA graphs treat it as one opaque call.

K and V may be read as the cache stores them (layers/kv_quant.py): float rows of any float dtype, llama.cpp's
32-value blocks (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl) or the rotated turbo types' codebook indices (their
rotated-domain values: the caller rotates q and un-rotates the output). Each tile of keys is expanded in
registers, so the cache is read at its stored size.
"""
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_N = 64
MIN_BLOCK_M = 64
TARGET_PROGRAMS = 264  # about two programs per SM of an H100/H200
# stored row types: 0 float; GGML ids of the block types; 100 + bits for the rotated types
ROW_TYPES = {"q8_0": 8, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "iq4_nl": 20, "turbo3": 103, "turbo4": 104}


@triton.jit
def _half_at(p, ok):
    """Little-endian fp16 at byte pointers p -> float32."""
    lo = tl.load(p, mask=ok, other=0).to(tl.uint16)
    hi = tl.load(p + 1, mask=ok, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _rows(base, cols, col_ok, stride_l, lut, TYPE: tl.constexpr, D: tl.constexpr):
    """Rows `cols` [BLOCK_N] of one KV head's stored cache (base: its first row) -> [BLOCK_N, D] float32."""
    d = tl.arange(0, D)
    ok = col_ok[:, None]
    if TYPE == 0:
        x = tl.load(base + cols[:, None] * stride_l + d[None, :], mask=ok, other=0.0).to(tl.float32)
    elif TYPE > 100:  # rotated: per group of G values, an fp16 scale then BITS-bit codebook indices
        BITS: tl.constexpr = TYPE - 100
        G: tl.constexpr = 128 if D > 128 else D
        GROUP_BYTES: tl.constexpr = 2 + G * BITS // 8
        start = base + cols[:, None] * stride_l + (d // G)[None, :] * GROUP_BYTES
        bit = (d % G) * BITS
        at = start + 2 + (bit // 8)[None, :]
        shift = (bit % 8)[None, :]
        word = tl.load(at, mask=ok, other=0).to(tl.int32)
        word = word | (tl.load(at + 1, mask=ok & (shift > 8 - BITS), other=0).to(tl.int32) << 8)
        code = (word >> shift) & ((1 << BITS) - 1)
        x = tl.load(lut + code) * _half_at(start, ok)
    else:
        BYTES: tl.constexpr = 34 if TYPE == 8 else (20 if TYPE == 3 else (22 if TYPE == 6 else (24 if TYPE == 7 else 18)))
        start = base + cols[:, None] * stride_l + (d // 32)[None, :] * BYTES
        i = (d % 32)[None, :]
        scale = _half_at(start, ok)
        if TYPE == 8:
            x = tl.load(start + 2 + i, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32) * scale
        else:
            HAS_MIN: tl.constexpr = TYPE == 3 or TYPE == 7
            FIVE: tl.constexpr = TYPE == 6 or TYPE == 7
            QS: tl.constexpr = 2 + 2 * HAS_MIN + 4 * FIVE
            nib = ((tl.load(start + QS + i % 16, mask=ok, other=0) >> (4 * (i // 16)).to(tl.uint8)) & 15).to(tl.int32)
            if TYPE == 20:
                x = tl.load(lut + nib) * scale
            else:
                if FIVE:
                    qh = tl.load(start + 2 + 2 * HAS_MIN + i // 8, mask=ok, other=0).to(tl.int32)
                    nib = nib | (((qh >> (i % 8)) & 1) << 4)
                if HAS_MIN:
                    x = nib.to(tl.float32) * scale + _half_at(start + 2, ok)
                else:
                    x = (nib - (16 if FIVE else 8)).to(tl.float32) * scale
    return x


# Query count, group size, key count and the mask's row stride are runtime values, never specialised on: a plain
# step (T=1) and a verify step (T=16) run the same machine code, so a row's arithmetic cannot differ between them.
@triton.jit(do_not_specialize=["stride_mt", "L", "blocks_per_split", "T", "G"])
def _partial_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, m_ptr, l_ptr, k_lut, v_lut,
                    stride_qt, stride_qh, stride_kh, stride_kl, stride_vh, stride_vl, stride_mt,
                    L, blocks_per_split, n_kv, scale, softcap, T, G,
                    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
                    K_TYPE: tl.constexpr, V_TYPE: tl.constexpr):
    kv = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)  # row r holds query token r % T of head kv * G + r // T
    t = rows % T
    head = kv * G + rows // T
    row_ok = rows < G * T
    d = tl.arange(0, D)
    q = tl.load(q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)  # finite: a split with every key masked stays NaN-free
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    start = split * blocks_per_split * BLOCK_N
    for i in range(0, blocks_per_split):
        cols = start + i * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < L
        k = _rows(k_ptr + kv * stride_kh, cols, col_ok, stride_kl, k_lut, K_TYPE, D).to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * scale
        if SOFTCAP:  # softcap * tanh(s / softcap), tanh through exp (no libdevice call: the interpreter runs it too)
            s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)
        allowed = tl.load(mask_ptr + t[:, None] * stride_mt + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                          other=0)
        s = tl.where(allowed != 0, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _rows(v_ptr + kv * stride_vh, cols, col_ok, stride_vl, v_lut, V_TYPE, D).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    base = split * n_kv + kv
    tl.store(acc_ptr + (base * BLOCK_M + rows[:, None]) * D + d[None, :], acc, mask=row_ok[:, None])
    tl.store(m_ptr + base * BLOCK_M + rows, m_i, mask=row_ok)
    tl.store(l_ptr + base * BLOCK_M + rows, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["stride_ot", "n_splits", "T", "G"])
def _merge_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, stride_ot, stride_oh, n_splits, n_kv, T, G,
                  D: tl.constexpr, BLOCK_M: tl.constexpr, SPLITS: tl.constexpr):
    kv = tl.program_id(0)
    row = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    s_ok = s < n_splits
    at = (s * n_kv + kv) * BLOCK_M + row
    m = tl.load(m_ptr + at, mask=s_ok, other=-1e30)
    weight = tl.exp(m - tl.max(m, 0))
    weight = tl.where(s_ok, weight, 0.0)
    denom = tl.sum(tl.load(l_ptr + at, mask=s_ok, other=0.0) * weight, 0)
    d = tl.arange(0, D)
    acc = tl.load(acc_ptr + at[:, None] * D + d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / denom
    head = kv * G + row // T
    tl.store(out_ptr + (row % T) * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


@functools.cache
def triton_matmul_ready(device_index: int) -> bool:
    """bf16 matrix products in Triton need an Ampere or newer GPU; older ones take the matmul attention."""
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


_LUTS: dict[tuple[int, str], Tensor] = {}


def _lut(row_type: int, device: torch.device) -> Tensor:
    """The value table a stored type indexes (iq4_nl's levels, a rotated type's codebook); a dummy otherwise."""
    key = (row_type, str(device))
    if key not in _LUTS:
        from flashdraft.layers.kv_quant import IQ4_NL_VALUES, lloyd_max_codebook
        values = IQ4_NL_VALUES if row_type == 20 else lloyd_max_codebook(row_type - 100) if row_type > 100 else (0,)
        _LUTS[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return _LUTS[key]


@torch.library.custom_op("flashdraft::split_attention", mutates_args=())
def split_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float, softcap: float,
                    k_type: int = 0, v_type: int = 0) -> Tensor:
    """q [T, H, D]; keys/values [KV, L, D] floats (any strides but the last), or [KV, L, row bytes] stored as
    ROW_TYPES k_type / v_type say; mask [T, L] bool; softcap 0: none. Returns [T, H*D] in q's dtype."""
    if q.is_cuda and not triton_matmul_ready(torch.cuda.current_device() if q.device.index is None else q.device.index):
        if k_type or v_type:
            raise ValueError("quantized KV rows need the Triton kernel (an Ampere or newer GPU)")
        from flashdraft.layers.attention import grouped_attention
        return grouped_attention(q, keys, values, mask, scale, softcap or None)
    T, H, D = q.shape
    KV, L = keys.shape[0], keys.shape[1]
    G = H // KV
    if q.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("split_attention needs the head dimension contiguous")
    if D & (D - 1) or D < 16:
        raise ValueError(f"split_attention needs a power-of-two head size >= 16, got {D}")
    mask = mask.contiguous().view(torch.uint8)
    # One tile height for decode (T=1) and verify (T=16) rows, and 64-key splits until L passes 64 * max_splits
    # keys (2112 for 8 KV heads; beyond, the split length changes only where the context bucket doubles): a token's
    # attention then comes out bit for bit the same whether a plain step or a verify step computes it.
    block_m = max(MIN_BLOCK_M, triton.next_power_of_2(G * T))
    blocks = triton.cdiv(L, BLOCK_N)
    max_splits = triton.cdiv(TARGET_PROGRAMS, KV)
    splits = min(blocks, max_splits)
    blocks_per_split = triton.cdiv(blocks, splits)
    splits = triton.cdiv(blocks, blocks_per_split)
    acc = torch.empty(splits, KV, block_m, D, device=q.device, dtype=torch.float32)
    m = torch.empty(splits, KV, block_m, device=q.device, dtype=torch.float32)
    lse = torch.empty_like(m)
    _partial_kernel[(KV, splits)](q, keys, values, mask, acc, m, lse, _lut(k_type, q.device), _lut(v_type, q.device),
                                  q.stride(0), q.stride(1), keys.stride(0), keys.stride(1),
                                  values.stride(0), values.stride(1), mask.stride(0),
                                  L, blocks_per_split, KV, scale, softcap or 1.0, T, G,
                                  D=D, BLOCK_M=block_m, BLOCK_N=BLOCK_N, SOFTCAP=softcap > 0,
                                  K_TYPE=k_type, V_TYPE=v_type)
    out = torch.empty(T, H, D, device=q.device, dtype=q.dtype)
    _merge_kernel[(KV, G * T)](acc, m, lse, out, out.stride(0), out.stride(1), splits, KV, T, G,
                               D=D, BLOCK_M=block_m, SPLITS=max(2, triton.next_power_of_2(max_splits)))
    return out.view(T, H * D)


@split_attention.register_fake
def _(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float, softcap: float, k_type: int = 0,
      v_type: int = 0) -> Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
