"""EngineConfig: how to build an engine, passed whole (no torch import, so command lines can fill it cheaply)."""
from dataclasses import dataclass


@dataclass
class EngineConfig:
    """How to build an engine; passed whole (the command lines fill it through flashdraft.args)."""
    model: str = ""
    draft: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    ctx_size: int = 4096  # per slot
    n_slots: int = 1
    draft_window: int | None = None
    block_size: int | None = None
    compile: bool = False
    adaptive: bool = False  # adaptive verify width (--spec-dm-adaptive)
    progress: bool = False
    # GGUF matrices: "auto" keeps them in their block format on CUDA (the GPU kernels) and dequantises them to
    # `dtype` elsewhere; "quantized" / "dequantized" force one way (--dequantize: dequantized)
    weights: str = "auto"

    @property
    def quantized(self) -> bool:
        if self.weights not in ("auto", "quantized", "dequantized"):
            raise ValueError(f"weights {self.weights!r}: choose auto, quantized or dequantized")
        return self.weights == "quantized" or (self.weights == "auto" and self.device.startswith("cuda"))
