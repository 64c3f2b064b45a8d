"""Gated DeltaNet, the linear-attention layer of Qwen3.5 (HF `Qwen3_5GatedDeltaNet`), in plain PyTorch: the CPU
path and the reference that faster kernels are checked against.

Per token t and value head h, in float32:
    S <- exp(g_t) S;    u_t = beta_t (v_t - S^T k_t);    S <- S + k_t u_t^T;    o_t = S^T q_t
where q, k, v come out of a causal depthwise convolution (then SiLU) over the projected input, q and k are
L2-normed and q is scaled by key_dim^-0.5, beta = sigmoid(b) and g = -exp(A_log) softplus(a + dt_bias). The
output is RMSNorm(o) * silu(z) per head, projected back. There are fewer key heads than value heads: each key
head serves value_heads / key_heads of them, grouped as HF orders them (value head h reads key head h // ratio)
or tiled as llama.cpp's GGUF files order them (h % key_heads).

The recurrence in two forms: `recurrent_delta_rule`, a token at a time (decode steps), and `chunked_delta_rule`,
chunks of tokens in a few matrix products (prefill). The state a slot keeps between forwards (S per head and the
convolution's last inputs) lives in layers.kv_cache.RecurrentCache: the state at a verify block's start and the
block's inputs, replayed up to wherever the next step starts. On the GPU a step's few tokens (the replay with them)
run in one kernel (kernels/delta_rule.py) that reads and writes the cache's state in place."""
import importlib.util
import os
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from flashdraft.layers.kv_cache import RecurrentSlots
from flashdraft.layers.linear import Linear, fuse_linears_on_load
from flashdraft.layers.norm import GatedRMSNorm

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter runs kernels on CPU tensors (tests)
TRITON = importlib.util.find_spec("triton") is not None
if TRITON:
    import flashdraft.kernels.delta_rule  # (registers torch.ops.flashdraft.recurrent_delta_rule)
CHUNK = 64  # tokens per chunk of the chunked form
RECURRENT_TOKENS = 16  # forwards of up to this many tokens take the recurrent form


@dataclass(frozen=True)
class DeltaNetShape:
    hidden_size: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    eps: float = 1e-6
    tiled: bool = False  # value heads in llama.cpp's tiled order (h reads key head h % key_heads)

    @property
    def channels(self) -> int:
        """The convolution's channels: q, k and v."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


def kernel_runs(x: Tensor) -> bool:
    """Whether a step's recurrence over a cache runs in kernels/delta_rule.py: on the GPU, and on the CPU under
    Triton's interpreter (tests); elsewhere in recurrent_delta_rule below."""
    return TRITON and (x.is_cuda or INTERPRETED)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_update(state: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """One token's update of states [B, H, Dk, Dv] by k [B, H, Dk], v [B, H, Dv], g, beta [B, H]."""
    state = state * g[:, :, None, None].exp()
    u = (v - torch.einsum("bhk,bhkv->bhv", k, state)) * beta[:, :, None]
    return state + k[..., None] * u[..., None, :]


def replay(state: Tensor, base: Tensor, start: Tensor, inputs: list[Tensor]) -> Tensor:
    """States [B, H, Dk, Dv] after base [B] tokens carried to start [B] by the kept inputs [B, R, H, ...] of the
    tokens between (row p % R: position p; at most R of them), as a step's tokens would carry them: through
    kernels/delta_rule.py where steps run there (the same bits), else in PyTorch."""
    if kernel_runs(state):
        return flashdraft.kernels.delta_rule.replay(state, base, start, inputs)
    k_in, v_in, g_in, beta_in = inputs
    steps, rows = k_in.shape[1], torch.arange(len(state), device=state.device)
    counts = (start - base).clamp(0, steps)
    for i in range(int(counts.max()) if len(counts) else 0):  # (the CPU's path: the host reads the count)
        at = (base + i) % steps
        updated = delta_update(state, k_in[rows, at], v_in[rows, at], g_in[rows, at], beta_in[rows, at])
        state = torch.where((i < counts)[:, None, None, None], updated, state)
    return state


def recurrent_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                         state: Tensor) -> tuple[Tensor, Tensor]:
    """q, k [B, H, T, Dk], v [B, H, T, Dv], g, beta [B, H, T], state [B, H, Dk, Dv] (float32) ->
    (o [B, H, T, Dv], the state after the T tokens)."""
    out = []
    for t in range(q.shape[2]):
        state = delta_update(state, k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t])
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, :, t], state))
    return torch.stack(out, 2), state


def chunked_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                       chunk: int = CHUNK) -> tuple[Tensor, Tensor]:
    """The same as recurrent_delta_rule, a chunk of tokens at a time. Within a chunk, with G_i the summed log decay
    from the chunk's start through token i and S the state before the chunk, the updates satisfy
        u_i + sum_{j<i} beta_i e^(G_i - G_j) (k_i . k_j) u_j = beta_i (v_i - e^(G_i) S^T k_i)
    (a unit lower-triangular system), the outputs are o_i = e^(G_i) S^T q_i + sum_{j<=i} e^(G_i - G_j) (q_i . k_j) u_j,
    and the state after it e^(G_last) S + sum_j e^(G_last - G_j) k_j u_j^T."""
    B, H, T, _ = k.shape
    pad = -T % chunk
    if pad:  # padded tokens: no decay (g = 0), no update (beta = 0)
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, H, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(B, H, n, chunk) for x in (g, beta))
    logs = g.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (logs[..., :, None] - logs[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # token j to i
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its diagonal is taken as ones

    def solve(rhs: Tensor) -> Tensor:
        return torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)

    u_values, u_state = solve(v * beta[..., None]), solve(k_beta * logs.exp()[..., None])  # u = u_values - u_state S
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * logs.exp()[..., None]
    k_to_end = k * (logs[..., -1:] - logs).exp()[..., None]
    chunk_decay = logs[..., -1].exp()[..., None, None]
    out = torch.empty_like(u_values)
    for i in range(n):
        u = u_values[:, :, i] - u_state[:, :, i] @ state
        out[:, :, i] = q_decayed[:, :, i] @ state + scores[:, :, i] @ u
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    return out.reshape(B, H, n * chunk, -1)[:, :, :T], state


class GatedDeltaNet(nn.Module):
    """Module names as HF's: `in_proj_qkv` and `in_proj_z` load into one matrix, `in_proj_b` and `in_proj_a`
    into another."""

    def __init__(self, shape: DeltaNetShape):
        super().__init__()
        self.shape = s = shape
        value_size = s.value_heads * s.value_dim
        self.in_proj_qkvz = Linear(s.hidden_size, s.channels + value_size, bias=False)
        fuse_linears_on_load(self, "in_proj_qkvz", ["in_proj_qkv", "in_proj_z"], [s.channels, value_size])
        self.in_proj_ba = Linear(s.hidden_size, 2 * s.value_heads, bias=False)
        fuse_linears_on_load(self, "in_proj_ba", ["in_proj_b", "in_proj_a"])
        self.conv1d = nn.Conv1d(s.channels, s.channels, s.conv_kernel, groups=s.channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(s.value_heads))
        self.A_log = nn.Parameter(torch.zeros(s.value_heads))
        self.norm = GatedRMSNorm(s.value_dim, s.eps)
        self.out_proj = Linear(value_size, s.hidden_size, bias=False)

    def forward(self, x: Tensor, cache: RecurrentSlots | None, positions: Tensor, fresh: bool) -> Tensor:
        """x [B, T, hidden] at positions [B, T]. fresh: the tokens start at position 0 (the state starts from
        zeros); else they continue the state the cache holds after the tokens before them. The cache (if any)
        keeps the state at their start and their inputs where it keeps that many (a verify block: the next step
        may start after any of its tokens), else the state after the last (RecurrentCache.keep)."""
        s = self.shape
        B, T, _ = x.shape
        C, K, HV, Dk, Dv = s.channels, s.conv_kernel, s.value_heads, s.key_dim, s.value_dim
        qkvz = self.in_proj_qkvz(x)
        b, a = self.in_proj_ba(x).chunk(2, dim=-1)
        keep_inputs = cache is not None and T <= cache.steps  # a verify block: the next step may start within it
        kernel = cache is not None and (keep_inputs or T <= RECURRENT_TOKENS) and kernel_runs(x)
        start = positions[:, 0]
        conv = x.new_zeros(B, C, K - 1) if cache is None or fresh else cache.read_conv(start)
        inputs = torch.cat([conv.to(x.dtype), qkvz[..., :C].transpose(1, 2)], dim=-1)  # [B, C, K - 1 + T]
        mixed = F.silu(F.conv1d(inputs, self.conv1d.weight, groups=C)).transpose(1, 2)  # [B, T, C]
        key_size = s.key_heads * Dk
        q = self._per_value_head(l2norm(mixed[..., :key_size].float().unflatten(-1, (s.key_heads, Dk))))
        k = self._per_value_head(l2norm(mixed[..., key_size:2 * key_size].float().unflatten(-1, (s.key_heads, Dk))))
        v = mixed[..., 2 * key_size:].float().unflatten(-1, (HV, Dv))
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        q, k, v = (t.transpose(1, 2) for t in (q * Dk ** -0.5, k, v))  # [B, H, T, D]
        g, beta = g.transpose(1, 2), beta.transpose(1, 2)
        if kernel:  # the state read, replayed to `start` and written back in place
            out = torch.ops.flashdraft.recurrent_delta_rule(q, k, v, g, beta, cache.state, cache.slots(x.device),
                                                            cache.base, start, *cache.inputs, fresh, keep_inputs)
            cache.keep(start, None, k, v, g, beta)
        else:
            state = x.new_zeros(B, HV, Dk, Dv, dtype=torch.float32) if cache is None or fresh else \
                cache.replayed(start)
            if keep_inputs or T <= RECURRENT_TOKENS:
                out, end = recurrent_delta_rule(q, k, v, g, beta, state)
            else:
                out, end = chunked_delta_rule(q, k, v, g, beta, state)
            if cache is not None:
                cache.keep(start, state if keep_inputs else end, k, v, g, beta)
        if cache is not None:  # the convolution's last K - 1 inputs after each length the next step may start at
            if keep_inputs:
                cache.write_conv(positions + 1, inputs.unfold(-1, K - 1, 1)[:, :, 1:].transpose(1, 2))
            else:
                cache.write_conv(positions[:, -1:] + 1, inputs[:, None, :, T:])
        out = self.norm(out.transpose(1, 2).to(x.dtype), qkvz[..., C:].unflatten(-1, (HV, Dv)))
        return self.out_proj(out.flatten(-2))

    def _per_value_head(self, x: Tensor) -> Tensor:
        """[B, T, key heads, D] -> [B, T, value heads, D]: each value head's key head."""
        s = self.shape
        ratio = s.value_heads // s.key_heads
        if ratio == 1:
            return x
        return x.repeat(1, 1, ratio, 1) if s.tiled else x.repeat_interleave(ratio, dim=2)
