"""The gated MLP of every family: down(act(gate(x)) * up(x)), with gate and up fused into one matrix."""
from torch import Tensor, nn
from torch.nn import functional as F

from flashdraft.layers.linear import Linear, fuse_linears_on_load

ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, act: str = "silu"):
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r} (supported: {', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[act]
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        fuse_linears_on_load(self, "gate_up_proj", ["gate_proj", "up_proj"])

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
