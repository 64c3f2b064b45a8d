"""The Gated DeltaNet recurrence of a decode or verify step (layers/gated_deltanet.recurrent_delta_rule) as one
Triton kernel over a layers.kv_cache.RecurrentCache: each program keeps a [key dim, BLOCK_V] tile of one head's
float32 state in registers, reads the slot's kept state (after `base` tokens), replays the kept inputs of the
tokens from `base` to the step's start (the accepted part of the last step), runs the step's tokens, and writes
back, in place, the state at the step's start (the step's inputs are then kept beside it, so the next step can
start after any of them) or at its end. Each token's arithmetic is the same whether it runs, is replayed, or
runs alone or in a block, so every route gives the same bits.

Unfused, each token's update reads and writes the whole state through memory, a few launches a token and layer
(a 16-token verify of a 48-layer Qwen3.6-27B: ~2300 launches and ~5 GB of state traffic); keeping a state per
token of the block instead of its inputs would write 16 states (2.4 GB) a step."""
import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_V = 32  # value columns a program holds (key dim x 32 floats: 16 KB of registers at key dim 128)


@triton.jit
def _update(state, k, v, decay, beta):
    state = state * decay
    u = (v - tl.sum(k[:, None] * state, axis=0)) * beta
    return state + k[:, None] * u[None, :]


@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, state_ptr, slots_ptr, base_ptr, start_ptr,
                      k_in_ptr, v_in_ptr, g_in_ptr, beta_in_ptr, T, STEPS: tl.constexpr, H: tl.constexpr, DK: tl.constexpr,
                      DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, FRESH: tl.constexpr,
                      KEEP_START: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // H
    h = bh % H
    ks = tl.arange(0, BLOCK_K)
    vs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok = ks < DK
    v_ok = vs < DV
    tile = ks[:, None] * DV + vs[None, :]
    tile_ok = k_ok[:, None] & v_ok[None, :]
    slot = tl.load(slots_ptr + b).to(tl.int64)
    at = state_ptr + (slot * H + h) * (DK * DV) + tile
    if FRESH:
        state = tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32)
    else:
        state = tl.load(at, mask=tile_ok, other=0.0)
        base = tl.load(base_ptr + slot)
        n = tl.minimum(tl.maximum(tl.load(start_ptr + b) - base, 0), STEPS)  # as many as are kept, at most
        for i in range(n):  # the kept inputs from base to the step's start
            row = ((slot * STEPS + (base + i) % STEPS) * H + h).to(tl.int64)
            k = tl.load(k_in_ptr + row * DK + ks, mask=k_ok, other=0.0)
            v = tl.load(v_in_ptr + row * DV + vs, mask=v_ok, other=0.0)
            state = _update(state, k, v, tl.exp(tl.load(g_in_ptr + row)), tl.load(beta_in_ptr + row))
    if KEEP_START:
        tl.store(at, state, mask=tile_ok)
    for t in range(T):
        row = bh.to(tl.int64) * T + t  # q, k, v, out [B, H, T, D] and g, beta [B, H, T], contiguous
        q = tl.load(q_ptr + row * DK + ks, mask=k_ok, other=0.0)
        k = tl.load(k_ptr + row * DK + ks, mask=k_ok, other=0.0)
        v = tl.load(v_ptr + row * DV + vs, mask=v_ok, other=0.0)
        state = _update(state, k, v, tl.exp(tl.load(g_ptr + row)), tl.load(beta_ptr + row))
        tl.store(out_ptr + row * DV + vs, tl.sum(q[:, None] * state, axis=0), mask=v_ok)
    if not KEEP_START:
        tl.store(at, state, mask=tile_ok)


@torch.library.custom_op("flashdraft::recurrent_delta_rule", mutates_args=("state",))
def recurrent_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, slots: Tensor,
                         base: Tensor, start: Tensor, k_in: Tensor, v_in: Tensor, g_in: Tensor, beta_in: Tensor,
                         fresh: bool, keep_start: bool) -> Tensor:
    """q, k [B, H, T, Dk], v [B, H, T, Dv], g, beta [B, H, T] (float32), row b continuing slot slots[b] from
    start[b] tokens -> o [B, H, T, Dv]. state [slots, H, Dk, Dv] (float32) holds each slot's state after base[slot]
    tokens, and k_in [slots, R, H, Dk], v_in [slots, R, H, Dv], g_in, beta_in [slots, R, H] the inputs of its tokens
    from there (row p % R: position p), replayed up to start[b] first (at most R of them; fresh: start from zeros
    instead). Written
    back into state[slots[b]]: the state at start[b] (keep_start; the caller keeps the step's inputs) or after
    the step."""
    B, H, T, DK = q.shape
    DV = v.shape[-1]
    if not (state.is_contiguous() and all(x.is_contiguous() for x in (k_in, v_in, g_in, beta_in))):
        raise ValueError("recurrent_delta_rule writes the state and reads the kept inputs in place: contiguous only")
    q, k, v, g, beta, slots, base, start = (x.contiguous() for x in (q, k, v, g, beta, slots, base, start))
    out = torch.empty(B, H, T, DV, device=q.device, dtype=torch.float32)
    grid = (B * H, triton.cdiv(DV, BLOCK_V))
    _recurrent_kernel[grid](q, k, v, g, beta, out, state, slots, base, start, k_in, v_in, g_in, beta_in, T,
                            STEPS=k_in.shape[1], H=H, DK=DK, DV=DV, BLOCK_K=triton.next_power_of_2(DK),
                            BLOCK_V=min(BLOCK_V, triton.next_power_of_2(DV)), FRESH=fresh, KEEP_START=keep_start)
    return out


@recurrent_delta_rule.register_fake
def _(q, k, v, g, beta, state, slots, base, start, k_in, v_in, g_in, beta_in, fresh, keep_start) -> Tensor:
    return q.new_empty(*q.shape[:-1], v.shape[-1], dtype=torch.float32)


def replay(state: Tensor, base: Tensor, start: Tensor, inputs: list[Tensor]) -> Tensor:
    """A copy of the states [B, H, Dk, Dv] after base [B] tokens carried to start [B] by the kept inputs
    [B, R, H, ...] (recurrent_delta_rule with no tokens of its own)."""
    B, H, DK, DV = state.shape
    state, none = state.clone(), state.new_empty(B, H, 0)
    recurrent_delta_rule(none[..., None].expand(-1, -1, -1, DK), none[..., None].expand(-1, -1, -1, DK),
                         none[..., None].expand(-1, -1, -1, DV), none, none, state,
                         torch.arange(B, device=state.device), base, start, *inputs, False, True)
    return state

