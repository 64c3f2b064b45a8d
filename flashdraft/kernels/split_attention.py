"""Split-K ("flash-decoding") attention for a few query tokens over a long KV cache, in Triton.

Decode, verify and draft steps have 1-16 query tokens, so an attention kernel that gives each (batch, head) one
program leaves most of the GPU idle while it walks the cache. Here the keys are cut into splits, one program per
(KV head, split) computes a partial softmax-weighted sum for all the query heads of its group at once (GQA
without repeating K/V), and a second kernel merges the splits by their log-sum-exp. The mask is an explicit
bool [T, L] (True = attend), so causal, sliding-window and the draft's non-causal ring layouts all go through
the same kernel; the score scale and an optional tanh softcap are arguments. Registered as a torch custom op,
so torch.compile and CUDA graphs treat it as one opaque call.
"""
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_N = 64
MIN_BLOCK_M = 64
TARGET_PROGRAMS = 264  # about two programs per SM of an H100/H200


# Query count, group size, key count and the mask's row stride are runtime values, never specialised on: a plain
# step (T=1) and a verify step (T=16) run the same machine code, so a row's arithmetic cannot differ between them.
@triton.jit(do_not_specialize=["stride_mt", "L", "blocks_per_split", "T", "G"])
def _partial_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, acc_ptr, m_ptr, l_ptr,
                    stride_qt, stride_qh, stride_kh, stride_kl, stride_vh, stride_vl, stride_mt,
                    L, blocks_per_split, n_kv, scale, softcap, T, G,
                    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr):
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
        k = tl.load(k_ptr + kv * stride_kh + cols[:, None] * stride_kl + d[None, :], mask=col_ok[:, None], other=0.0)
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
        v = tl.load(v_ptr + kv * stride_vh + cols[:, None] * stride_vl + d[None, :], mask=col_ok[:, None], other=0.0)
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


@torch.library.custom_op("flashdraft::split_attention", mutates_args=())
def split_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float, softcap: float) -> Tensor:
    """q [T, H, D]; keys/values [KV, L, D] (any strides but the last); mask [T, L] bool; softcap 0: none.
    Returns [T, H*D]."""
    if q.is_cuda and not triton_matmul_ready(torch.cuda.current_device() if q.device.index is None else q.device.index):
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
    _partial_kernel[(KV, splits)](q, keys, values, mask, acc, m, lse,
                                  q.stride(0), q.stride(1), keys.stride(0), keys.stride(1),
                                  values.stride(0), values.stride(1), mask.stride(0),
                                  L, blocks_per_split, KV, scale, softcap or 1.0, T, G,
                                  D=D, BLOCK_M=block_m, BLOCK_N=BLOCK_N, SOFTCAP=softcap > 0)
    out = torch.empty(T, H, D, device=q.device, dtype=q.dtype)
    _merge_kernel[(KV, G * T)](acc, m, lse, out, out.stride(0), out.stride(1), splits, KV, T, G,
                               D=D, BLOCK_M=block_m, SPLITS=max(2, triton.next_power_of_2(max_splits)))
    return out.view(T, H * D)


@split_attention.register_fake
def _(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float, softcap: float) -> Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
