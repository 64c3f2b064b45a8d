"""The DFlash draft's configuration: z-lab's HF `config.json` (with its `dflash_config`), read and written."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from flashdraft.layers.rope import ROPE_TYPES

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
DRAFT_ARCHITECTURE = "DFlashDraftModel"
DRAFT2_ARCHITECTURE = "DFlash2DraftModel"  # DFlash2: local convolutions and a candidate selector


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default feature layers: the middle one for a one-layer draft, else evenly spaced over [1, N-3]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    return [round(first + (i * (last - first)) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int | None
    layer_types: list[str]
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear" | "llama3" | "yarn", ...}
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    sliding_window: int | None = None
    is_causal: bool | None = None  # None: sliding layers causal, full layers bidirectional
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # DFlash2 (None: DFlash v1): taps of the dynamic causal convolutions around each layer's attention and MLP,
    # the channels sharing one dynamic coefficient, and the candidate selector's rank and candidates per row
    conv_kernel_size: int | None = None
    conv_group_size: int = 16
    selector_rank: int | None = None
    selector_top_k: int = 16

    @property
    def dflash2(self) -> bool:
        return self.conv_kernel_size is not None

    @property
    def context_width(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size

    def layer_attention(self, layer_id: int) -> tuple[bool, int | None]:
        """(is_causal, sliding_window) of one layer, with the reference's rule for the `is_causal` override."""
        sliding = self.layer_types[layer_id] == SLIDING_ATTENTION
        causal = sliding if self.is_causal is None else self.is_causal
        return causal, self.sliding_window if sliding else None

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> DraftConfig:
        """Read z-lab's HF `config.json` dict; a key in `dflash_config` wins over the same key at top level."""
        dflash = config.get("dflash_config") or {}

        def value(name: str, default: Any = None) -> Any:
            return dflash[name] if name in dflash else config.get(name, default)

        def required(name: str) -> Any:
            found = value(name)
            if found is None:
                raise ValueError(f"draft config lacks `{name}`")
            return found

        hidden_act = value("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"draft config: hidden_act {hidden_act!r} is not supported (only silu)")
        hidden_size = int(required("hidden_size"))
        num_hidden_layers = int(required("num_hidden_layers"))
        num_attention_heads = int(required("num_attention_heads"))

        target_layer_ids = value("target_layer_ids")
        num_target_layers = value("num_target_layers")
        if target_layer_ids is None:
            if num_target_layers is None:
                raise ValueError("draft config has neither `target_layer_ids` nor `num_target_layers`")
            target_layer_ids = build_target_layer_ids(int(num_target_layers), num_hidden_layers)
        target_layer_ids = [int(i) for i in target_layer_ids]
        if num_target_layers is None:
            num_target_layers = max(target_layer_ids) + 1

        # Qwen3Config drops the window when `use_sliding_window` is false; an absent flag keeps it.
        sliding_window = value("sliding_window")
        if value("use_sliding_window") is False:
            sliding_window = None
        layer_types = value("layer_types")
        if layer_types is None:
            first_sliding = int(value("max_window_layers", num_hidden_layers))
            layer_types = [
                SLIDING_ATTENTION if sliding_window is not None and i >= first_sliding else FULL_ATTENTION
                for i in range(num_hidden_layers)
            ]
        layer_types = list(layer_types)
        if len(layer_types) != num_hidden_layers:
            raise ValueError(f"draft config: {len(layer_types)} layer_types for {num_hidden_layers} layers")
        unknown = sorted(set(layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if unknown:
            raise ValueError(f"draft config: unsupported layer_types {unknown}")

        is_causal = None
        for source in (dflash, config):
            for name in ("is_causal", "causal"):
                if is_causal is None and source.get(name) is not None:
                    is_causal = bool(source[name])
        conv = value("conv_kernel_size")
        if DRAFT2_ARCHITECTURE in (config.get("architectures") or []) and conv is None:
            conv = 2  # speculators' default
        selector_rank = value("selector_rank", 256 if conv is not None else None)
        if conv is not None and is_causal is None and value("sliding_window_non_causal", True):
            is_causal = False  # DFlash2's sliding layers are bidirectional inside the block too

        rope_theta, rope_scaling = _read_rope(value)
        softcap = value("final_logit_softcapping")
        mask_token_id = value("mask_token_id")
        return cls(
            hidden_size=hidden_size,
            intermediate_size=int(required("intermediate_size")),
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=int(value("num_key_value_heads") or num_attention_heads),
            head_dim=int(value("head_dim") or hidden_size // num_attention_heads),
            vocab_size=int(required("vocab_size")),
            num_target_layers=int(num_target_layers),
            target_layer_ids=target_layer_ids,
            mask_token_id=None if mask_token_id is None else int(mask_token_id),
            layer_types=layer_types,
            block_size=int(value("block_size") or 16),
            rms_norm_eps=float(value("rms_norm_eps") or 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(value("max_position_embeddings") or 32768),
            attention_bias=bool(value("attention_bias", False)),
            sliding_window=None if sliding_window is None else int(sliding_window),
            is_causal=is_causal,
            input_embedding_scale=float(value("input_embedding_scale") or 1.0),
            output_multiplier=float(value("output_multiplier") or 1.0),
            final_logit_softcapping=float(softcap) if softcap is not None and float(softcap) > 0 else None,
            conv_kernel_size=None if conv is None else int(conv),
            conv_group_size=int(value("conv_group_size") or 16),
            selector_rank=None if selector_rank is None else int(selector_rank),
            selector_top_k=int(value("selector_top_k") or 16),
        )

    def to_hf(self) -> dict[str, Any]:
        """z-lab's `config.json` format; loads with `Qwen3Config(**d)` into `DFlashDraftModel`."""
        dflash: dict[str, Any] = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        if self.input_embedding_scale != 1.0:
            dflash["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            dflash["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            dflash["final_logit_softcapping"] = self.final_logit_softcapping
        if self.dflash2:
            dflash.update(conv_kernel_size=self.conv_kernel_size, conv_group_size=self.conv_group_size,
                          selector_rank=self.selector_rank, selector_top_k=self.selector_top_k)
        config: dict[str, Any] = {
            "architectures": [DRAFT2_ARCHITECTURE if self.dflash2 else DRAFT_ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else dict(self.rope_scaling),
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "layer_types": list(self.layer_types),
            # Qwen3Config ignores `sliding_window` unless this flag is set.
            "use_sliding_window": self.sliding_window is not None and SLIDING_ATTENTION in self.layer_types,
            "sliding_window": self.sliding_window,
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            "dflash_config": dflash,
        }
        if self.is_causal is not None:
            config["is_causal"] = self.is_causal  # the reference reads it from the top level only
        return config


def _read_rope(value: Callable[..., Any]) -> tuple[float, dict[str, Any] | None]:
    """RoPE base and scaling from either the transformers-4 keys or transformers-5 `rope_parameters`."""
    parameters = value("rope_parameters")
    if parameters is not None and not {"rope_type", "type", "rope_theta"} & set(parameters):
        raise ValueError("draft config: per-layer-type rope_parameters are not supported")
    scaling = dict(parameters if parameters is not None else value("rope_scaling") or {})
    theta = scaling.pop("rope_theta", None)
    theta = value("rope_theta") if theta is None else theta
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("draft config: partial_rotary_factor is not supported")
    theta = float(theta if theta is not None else 10000.0)
    if rope_type == "default":
        return theta, None
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"draft config: rope type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
    return theta, {"rope_type": rope_type, **scaling}
