"""The Gated DeltaNet recurrence of a decode or verify step (layers/gated_deltanet.recurrent_delta_rule) as one
Triton kernel: each program keeps a [key dim, BLOCK_V] tile of one head's float32 state in registers over the
step's tokens, reads it once from the cache's ring row and writes it straight into the ring rows the step keeps
(after every token of a verify block, for rollback, or after the last). Each token's arithmetic is the same
whatever the number of tokens, so a token decoded alone and inside a verify block get the same bits.

Unfused, each token's update reads and writes the whole state through memory, a few launches a token and layer
(a 16-token verify of a 48-layer Qwen3.6-27B: ~2300 launches and ~5 GB of state traffic)."""
import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_V = 32  # value columns a program holds (key dim x 32 floats: 16 KB of registers at key dim 128)


@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, ring_ptr, src_ptr, dst_ptr, T, n_dst,
                      H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_V: tl.constexpr, FRESH: tl.constexpr, EVERY: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    ks = tl.arange(0, BLOCK_K)
    vs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = ks < DK
    v_ok = vs < DV
    tile = ks[:, None] * DV + vs[None, :]
    tile_ok = k_ok[:, None] & v_ok[None, :]
    head = h * (DK * DV)
    if FRESH:
        state = tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32)
    else:
        src = tl.load(src_ptr + b).to(tl.int64)
        state = tl.load(ring_ptr + src * (H * DK * DV) + head + tile, mask=tile_ok, other=0.0)
    for t in range(T):
        row = bh.to(tl.int64) * T + t  # q, k, v, out [B, H, T, D] and g, beta [B, H, T], contiguous
        q = tl.load(q_ptr + row * DK + ks, mask=k_ok, other=0.0)
        k = tl.load(k_ptr + row * DK + ks, mask=k_ok, other=0.0)
        v = tl.load(v_ptr + row * DV + vs, mask=v_ok, other=0.0)
        decay = tl.exp(tl.load(g_ptr + row))
        beta = tl.load(beta_ptr + row)
        state = state * decay
        u = (v - tl.sum(k[:, None] * state, axis=0)) * beta
        state = state + k[:, None] * u[None, :]
        tl.store(out_ptr + row * DV + vs, tl.sum(q[:, None] * state, axis=0), mask=v_ok)
        if EVERY:
            dst = tl.load(dst_ptr + b * n_dst + t).to(tl.int64)
            tl.store(ring_ptr + dst * (H * DK * DV) + head + tile, state, mask=tile_ok)
    if not EVERY:
        dst = tl.load(dst_ptr + b * n_dst).to(tl.int64)
        tl.store(ring_ptr + dst * (H * DK * DV) + head + tile, state, mask=tile_ok)


@torch.library.custom_op("flashdraft::recurrent_delta_rule", mutates_args=("ring",))
def recurrent_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, ring: Tensor, src: Tensor,
                         dst: Tensor, fresh: bool) -> Tensor:
    """q, k [B, H, T, Dk], v [B, H, T, Dv], g, beta [B, H, T] (float32) from the states ring[src[b]] (ring
    [rows, H, Dk, Dv] float32, contiguous; fresh: from zeros) -> o [B, H, T, Dv]; the state after token t goes to
    ring[dst[b, t]] where dst [B, T] names a row for each token, else (dst [B, 1]) after the last to ring[dst[b, 0]].
    A destination row may be the source row (a ring of one row per slot)."""
    B, H, T, DK = q.shape
    DV = v.shape[-1]
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    out = torch.empty(B, H, T, DV, device=q.device, dtype=torch.float32)
    if T == 0:
        return out
    every = dst.shape[1] == T and T > 1
    grid = (B * H, triton.cdiv(DV, BLOCK_V))
    _recurrent_kernel[grid](q, k, v, g, beta, out, ring, src, dst.contiguous(), T, dst.shape[1], H=H, DK=DK, DV=DV,
                            BLOCK_K=triton.next_power_of_2(DK), BLOCK_V=min(BLOCK_V, triton.next_power_of_2(DV)),
                            FRESH=fresh, EVERY=every)
    return out


@recurrent_delta_rule.register_fake
def _(q, k, v, g, beta, ring, src, dst, fresh) -> Tensor:
    return q.new_empty(*q.shape[:-1], v.shape[-1], dtype=torch.float32)
