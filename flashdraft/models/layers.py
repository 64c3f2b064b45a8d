"""Building blocks shared by the target models and the DFlash draft: RMSNorm, RoPE, SwiGLU."""
import math
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.nn import functional as F


CPU_FEW_ROWS = 64


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear with a CPU path for a few rows (decode, verify and draft steps): MKL's GEMM repacks the whole
    weight on every call with few rows, and (W x^T)^T, which packs only x, runs up to ~3x faster there (more
    with the row count padded to a multiple of 4: odd counts take a slower kernel)."""
    if x.device.type != "cpu" or x.numel() > CPU_FEW_ROWS * x.shape[-1]:
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if n > 1 and n % 4:
        rows = F.pad(rows, (0, 0, 0, 4 - n % 4))
    out = torch.mm(weight, rows.t())[:, :n].t().contiguous()  # in-place users (all-reduce) need contiguous
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], -1)


class Linear(nn.Linear):
    """nn.Linear through `linear` (its few-row CPU path); `part` multiplies by a range of its output rows only
    (one projection of a fused matrix)."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)

    def part(self, x: Tensor, start: int, stop: int) -> Tensor:
        return linear(x, self.weight[start:stop], None if self.bias is None else self.bias[start:stop])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def position_mask(query_pos: Tensor, key_pos: Tensor, is_causal: bool = True,
                  sliding_window: int | None = None) -> Tensor:
    """[..., Q, K] bool (True = attend) from absolute positions (leading dims broadcast): a causal layer sees keys
    at or before the query; a sliding window keeps keys less than `sliding_window` away (on both sides when the
    layer is not causal)."""
    offset = query_pos[..., :, None] - key_pos[..., None, :]
    mask = offset >= 0 if is_causal else torch.ones_like(offset, dtype=torch.bool)
    if sliding_window is not None:
        mask = mask & (offset < sliding_window)
        if not is_causal:
            mask = mask & (offset > -sliding_window)
    return mask


def compile_layer_forward(forward):
    """torch.compile a layer class's forward, called as `compiled(layer, *args)`: parameters become graph inputs,
    so one compiled graph per input shape serves every layer of the class (no recompile per layer). Static
    shapes: callers use it only for the fixed widths that CUDA graphs capture."""
    import torch._dynamo
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(forward, dynamic=False)


def fuse_linears_on_load(module: nn.Module, fused: str, parts: list[str]) -> None:
    """Keep HF's separate projections in state dicts (load and save) while computing with one fused
    matrix `fused` (one GEMM instead of len(parts) at decode time)."""
    sizes = [getattr(module, fused).out_features // len(parts)] * len(parts)

    def load_hook(state_dict, prefix, *args):
        for kind in ("weight", "bias"):
            names = [f"{prefix}{p}.{kind}" for p in parts]
            if all(n in state_dict for n in names):
                state_dict[f"{prefix}{fused}.{kind}"] = torch.cat([state_dict.pop(n) for n in names])

    def save_hook(mod, state_dict, prefix, local_metadata):
        for kind in ("weight", "bias"):
            key = f"{prefix}{fused}.{kind}"
            if key in state_dict:
                for p, chunk in zip(parts, state_dict.pop(key).split(mod.split_sizes[fused])):
                    state_dict[f"{prefix}{p}.{kind}"] = chunk

    module.split_sizes = getattr(module, "split_sizes", {})
    module.split_sizes.setdefault(fused, sizes)
    module._register_load_state_dict_pre_hook(load_hook)
    module._register_state_dict_hook(save_hook)


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        fuse_linears_on_load(self, "gate_up_proj", ["gate_proj", "up_proj"])

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class RopeConfig(Protocol):
    head_dim: int
    rope_theta: float
    rope_scaling: dict | None  # {"rope_type" (or "type"): "linear" | "llama3" | "yarn", ...}; None: plain RoPE
    max_position_embeddings: int


ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(cfg: RopeConfig, device: torch.device | str | None = None) -> tuple[Tensor, float]:
    """float32 inverse frequencies [head_dim // 2] and the cos/sin scale, as HF's rope initialisers compute them."""
    dim, base, scaling = cfg.head_dim, cfg.rope_theta, cfg.rope_scaling or {}
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)
    inv_freq = 1.0 / pos_freqs
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    original_max = scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings
    if kind in ("default", None):
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original_max / low, inv_freq / factor, inv_freq)
        smooth = (original_max / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= original_max / high) & (wavelen <= original_max / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(cfg, scaling, original_max, pos_freqs)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})")


def _yarn_inv_freq(cfg: RopeConfig, scaling: dict, original_max: int, pos_freqs: Tensor) -> tuple[Tensor, float]:
    """HF's `_compute_yarn_parameters`: interpolated low frequencies, extrapolated high ones, a linear ramp
    between, and a cos/sin scale (attention factor) from `factor` and the optional mscale pair."""
    dim, base = cfg.head_dim, cfg.rope_theta
    factor = scaling.get("factor")
    factor = cfg.max_position_embeddings / original_max if factor is None else float(factor)

    def mscale(scale: float, multiplier: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * multiplier * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = (torch.arange(dim // 2, dtype=torch.float32, device=pos_freqs.device) - low) / (high - low)
    extrapolation_weight = 1 - ramp.clamp(0, 1)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, attention_scaling: float) -> Tensor:
    """positions [...] -> float32 (cos, sin) [..., 2, head_dim]."""
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return torch.stack([emb.cos(), emb.sin()], dim=-2) * attention_scaling


def rope_table(cfg: RopeConfig, max_len: int) -> Tensor:
    """[max_len, 2, head_dim] float32 table of (cos, sin) per position."""
    inv_freq, attention_scaling = rope_inv_freq(cfg)
    return rope_cos_sin(inv_freq, torch.arange(max_len), attention_scaling)


def apply_rope(x: Tensor, cos_sin: Tensor) -> Tensor:
    """Rotate-half (NEOX) RoPE, as HF. x [..., head_dim]; cos_sin [..., 2, head_dim] whose leading dims broadcast
    against x's: [T, 2, D] for heads-first x [..., heads, T, D], [T, 1, 2, D] for token-first x [..., T, heads, D]."""
    cos, sin = cos_sin.to(x.dtype).unbind(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
