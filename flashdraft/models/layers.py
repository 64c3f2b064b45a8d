"""Building blocks shared by the target models and the DFlash draft: RMSNorm, RoPE, SwiGLU."""
import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


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
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        fuse_linears_on_load(self, "gate_up_proj", ["gate_proj", "up_proj"])

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> tuple[Tensor, float]:
    """Inverse frequencies and the attention scaling factor, as HF's rope initialisers compute them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in ("default", None):
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


def rope_table(head_dim: int, theta: float, scaling: dict | None, max_len: int) -> Tensor:
    """[max_len, 2, head_dim] float32 table of (cos, sin) per position."""
    inv_freq, attention_scaling = rope_inv_freq(head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return torch.stack([emb.cos(), emb.sin()], dim=1) * attention_scaling


def apply_rope(x: Tensor, cos_sin: Tensor) -> Tensor:
    """x: [..., T, heads, head_dim]; cos_sin: [T, 2, head_dim] (rotate-half / NEOX layout, as HF)."""
    cos = cos_sin[:, 0, None, :].to(x.dtype)
    sin = cos_sin[:, 1, None, :].to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
