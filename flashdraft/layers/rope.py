"""Rotary position embeddings: HF's frequency rules (default, linear, llama3, yarn, proportional), partial
rotation, (cos, sin) tables per position, and NeoX (rotate-half) application."""
import math
from typing import Protocol

import torch
from torch import Tensor


class RopeConfig(Protocol):
    head_dim: int
    rope_theta: float
    rope_scaling: dict | None  # {"rope_type" (or "type"): "linear" | "llama3" | "yarn" | "proportional", ...}
    max_position_embeddings: int


ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


def rotary_dim(cfg: RopeConfig) -> int:
    """How many leading dims of a head rotate: all, or `partial_rotary_factor` of them (the rest pass through).
    Proportional RoPE rotates over the whole head with zero frequencies instead (see rope_inv_freq)."""
    scaling = cfg.rope_scaling or {}
    factor = float(scaling.get("partial_rotary_factor", 1.0))
    if scaling.get("rope_type", scaling.get("type")) == "proportional" or factor == 1.0:
        return cfg.head_dim
    return int(cfg.head_dim * factor)


def rope_inv_freq(cfg: RopeConfig, device: torch.device | str | None = None) -> tuple[Tensor, float]:
    """float32 inverse frequencies [rotary_dim // 2] and the cos/sin scale, as HF's rope initialisers compute them."""
    dim, base, scaling = rotary_dim(cfg), cfg.rope_theta, cfg.rope_scaling or {}
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)
    inv_freq = 1.0 / pos_freqs
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    original_max = scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings
    if kind in ("default", None):
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "proportional":
        # Gemma 4's full layers: the first partial_rotary_factor * dim / 2 frequencies of the whole head (the
        # exponent's denominator stays the head size), the rest zero, so those dims pass through unrotated.
        angles = int(float(scaling.get("partial_rotary_factor", 1.0)) * dim // 2)
        inv_freq = torch.where(torch.arange(dim // 2, device=device) < angles, inv_freq, 0.0)
        return inv_freq / float(scaling.get("factor", 1.0)), 1.0
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
        return _yarn_inv_freq(dim, base, cfg.max_position_embeddings, scaling, original_max, pos_freqs)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: {', '.join(ROPE_TYPES)})")


def _yarn_inv_freq(dim: int, base: float, max_positions: int, scaling: dict, original_max: int,
                   pos_freqs: Tensor) -> tuple[Tensor, float]:
    """HF's `_compute_yarn_parameters`: interpolated low frequencies, extrapolated high ones, a linear ramp
    between, and a cos/sin scale (attention factor) from `factor` and the optional mscale pair."""
    factor = scaling.get("factor")
    factor = max_positions / original_max if factor is None else float(factor)

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
    """positions [...] -> float32 (cos, sin) [..., 2, rotary_dim]."""
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return torch.stack([emb.cos(), emb.sin()], dim=-2) * attention_scaling


def rope_table(cfg: RopeConfig, max_len: int) -> Tensor:
    """[max_len, 2, rotary_dim] float32 table of (cos, sin) per position."""
    inv_freq, attention_scaling = rope_inv_freq(cfg)
    return rope_cos_sin(inv_freq, torch.arange(max_len), attention_scaling)


def apply_rope(x: Tensor, cos_sin: Tensor) -> Tensor:
    """Rotate-half (NEOX) RoPE, as HF. x [..., head_dim]; cos_sin [..., 2, rotary_dim] whose leading dims broadcast
    against x's: [T, 2, D] for heads-first x [..., heads, T, D], [T, 1, 2, D] for token-first x [..., T, heads, D].
    A rotary_dim below head_dim rotates the leading dims and passes the rest through (partial RoPE)."""
    cos, sin = cos_sin.to(x.dtype).unbind(-2)
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rot], cos_sin), x[..., rot:]], dim=-1)
    half = rot // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
