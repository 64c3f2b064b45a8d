"""RMSNorm in the variants the families use: weight w (llama, Qwen, Gemma 4), 1 + w (Gemma 3, Qwen3.5), or none;
and the gated form of a Gated DeltaNet's output."""
import torch
from torch import Tensor, nn
from torch.nn import functional as F


class RMSNorm(nn.Module):
    """x / rms(x), computed in float32, times the weight.

    offset: 0 for a plain weight; 1 for Gemma 3's (1 + w) (HF checkpoints store w; GGUF files store 1 + w
    and load with offset 0). weight=False: no parameter (Gemma 4's v_norm). fp32_weight: multiply by the
    weight before casting back (HF's Gemma order) instead of after (HF's llama order); both orders matter
    bit for bit in bf16."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0, weight: bool = True,
                 fp32_weight: bool = False):
        super().__init__()
        self.eps, self.offset, self.fp32_weight = eps, offset, fp32_weight or offset != 0.0
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0.0 else torch.zeros(dim)) if weight else None

    def forward(self, x: Tensor) -> Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        if self.weight is None:
            return normed.to(x.dtype)
        if self.fp32_weight:
            return (normed * (self.weight.float() + self.offset)).to(x.dtype)
        return self.weight * normed.to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """rms_norm(x) * w * silu(gate) over the last axis (a Gated DeltaNet's output per head), in HF's order: the
    normed x back in its dtype times w (RMSNorm's), then times silu(gate) in float32."""

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        return (super().forward(x) * F.silu(gate.float())).to(x.dtype)
