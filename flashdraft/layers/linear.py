"""Projections: `linear` (with a CPU path for a few rows), `Linear`, and fused matrices kept as HF's parts on disk."""
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


def fuse_linears_on_load(module: nn.Module, fused: str, parts: list[str], sizes: list[int] | None = None) -> None:
    """Keep HF's separate projections in state dicts (load and save) while computing with one fused
    matrix `fused` (one GEMM instead of len(parts) at decode time). `sizes`: the parts' output sizes
    (default: equal)."""
    sizes = sizes or [getattr(module, fused).out_features // len(parts)] * len(parts)

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
    module.fused_parts = getattr(module, "fused_parts", {})  # for the loader's swap to quantized modules
    module.fused_parts[fused] = parts
    module._register_load_state_dict_pre_hook(load_hook)
    module._register_state_dict_hook(save_hook)
