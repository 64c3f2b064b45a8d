"""DFlash draft: target features fused into one context vector per token, injected as extra K/V into every
layer of a small Qwen3-style stack that denoises a block [anchor, MASK, ...] in one non-causal pass.

State dict names are z-lab's (`fc.weight`, `layers.{i}.self_attn.q_proj.weight`, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from flashdraft.models.attention import uses_split_kernel
from flashdraft.models.layers import (ROPE_TYPES, Linear, RMSNorm, SwiGLU, apply_rope, compile_layer_forward,
                                      fuse_linears_on_load, position_mask, rope_cos_sin, rope_inv_freq)

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
DRAFT_ARCHITECTURE = "DFlashDraftModel"


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default feature layers: the middle one for a one-layer draft, else evenly spaced over [1, N-3]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    return [round(first + (i * (last - first)) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


# ---------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------


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
        config: dict[str, Any] = {
            "architectures": [DRAFT_ARCHITECTURE],
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


# ---------------------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------------------


class Rotary(nn.Module):
    """The shared RoPE frequencies as a float32 buffer that follows the model across devices."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        inv_freq, self.attention_scaling = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> Rotary:
        # Casting the model to bf16 must not round the frequencies: recompute them in float32 on the new device.
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.cfg, self.inv_freq.device)[0]
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """positions [...] -> (cos, sin) [..., 2, head_dim] in dtype, for `apply_rope`."""
        return rope_cos_sin(self.inv_freq, positions, self.attention_scaling).to(dtype)


def draft_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """q [..., Hq, Q, D], k/v [..., Hkv, K, D], mask bool [..., Q, K] -> [..., Q, Hq * D].

    GQA by folding each KV head's query group into the query length, so K/V are never repeated and any SDPA
    kernel that takes a mask can run it.
    """
    num_heads, q_len, head_dim = q.shape[-3:]
    num_kv_heads, k_len = k.shape[-3], k.shape[-2]
    groups = num_heads // num_kv_heads
    unbatched = q.dim() == 3
    if unbatched:  # the fused CUDA kernels only take 4-D inputs; 3-D falls back to the math path
        q, k, v = q[None], k[None], v[None]
        mask = None if mask is None else mask[None]
    q = q.unflatten(-3, (num_kv_heads, groups)).flatten(-3, -2)
    if mask is not None:
        mask = mask.unsqueeze(-3).expand(*mask.shape[:-2], groups, q_len, k_len).flatten(-3, -2).unsqueeze(-3)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=head_dim**-0.5)
    out = out.unflatten(-2, (groups, q_len)).flatten(-4, -3)  # [..., Hq, Q, D]
    out = out.transpose(-3, -2).flatten(-2)
    return out[0] if unbatched else out


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_id: int):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * kv_size, bias=bias)
        self.split_sizes = {"qkv_proj": [self.q_size, kv_size, kv_size]}
        fuse_linears_on_load(self, "qkv_proj", ["q_proj", "k_proj", "v_proj"])
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.is_causal, self.sliding_window = cfg.layer_attention(layer_id)

    def project_kv(
        self, x: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., T, H] -> K = RoPE(k_norm(Wk x)), V = Wv x, both [..., Hkv, T, D]. Used for context and block."""
        return self.keys_values(self.qkv_proj.part(x, self.q_size, self.qkv_proj.out_features), cos_sin)

    def project_qkv(
        self, x: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., T, H] -> Q [..., Hq, T, D] and the block's own K, V [..., Hkv, T, D], from one matrix product."""
        qkv = self.qkv_proj(x)
        q = self.q_norm(qkv[..., :self.q_size].unflatten(-1, (self.num_heads, self.head_dim))).transpose(-3, -2)
        return apply_rope(q, cos_sin), *self.keys_values(qkv[..., self.q_size:], cos_sin)

    def keys_values(self, kv: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected k and v [..., T, 2*Hkv*D] -> RoPE(k_norm(k)), v, both [..., Hkv, T, D]."""
        k, v = kv.unflatten(-1, (2 * self.num_kv_heads, self.head_dim)).transpose(-3, -2).chunk(2, dim=-3)
        return apply_rope(self.k_norm(k), cos_sin), v

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """x [..., B, H] (normed block states). keys/values [..., Hkv, B + R, D]: context K/V in the last R rows;
        the block's own K/V are written into the first B rows here, so the caller owns that scratch space."""
        block_len = x.shape[-2]
        q, block_k, block_v = self.project_qkv(x, cos_sin)
        keys[..., :block_len, :].copy_(block_k)
        values[..., :block_len, :].copy_(block_v)
        if q.dim() == 3 and mask is not None and uses_split_kernel(q.transpose(0, 1)):  # else SDPA, as z-lab's
            return self.o_proj(torch.ops.flashdraft.split_attention(q.transpose(0, 1), keys, values, mask))
        return self.o_proj(draft_attention(q, keys, values, mask))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, keys, values, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


# ---------------------------------------------------------------------------------------------------------
# Draft model
# ---------------------------------------------------------------------------------------------------------


class DFlashDraft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = Linear(cfg.context_width, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)
        self.layer_attention = [cfg.layer_attention(i) for i in range(cfg.num_hidden_layers)]
        self.attention_kinds = list(dict.fromkeys(self.layer_attention))  # one mask per distinct kind
        self.window = 0
        self.scratch = 0
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.row_positions: torch.Tensor | None = None
        self.compiled_layer = None
        self.compiled_blocks: set[int] = set()

    def compile_layers(self, block_sizes: tuple[int, ...] | None = None) -> None:
        """Draft steps of `block_sizes` tokens (default: the configured block, the shape CUDA graphs capture) run
        their layers through torch.compile (fused norms, RoPE, SwiGLU); other lengths stay eager rather than
        compile once per length."""
        self.compiled_layer = compile_layer_forward(DraftLayer.forward)
        self.compiled_blocks = set(block_sizes or (self.cfg.block_size,))

    def setup_cache(
        self,
        window: int,
        n_slots: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        max_block_size: int | None = None,
    ) -> None:
        """Context K/V ring of `window` rows per slot and layer, after `max_block_size` scratch rows where each
        forward writes the block's transient K/V: attention reads one contiguous view, the block's rows and then
        as much of the ring as holds context (a prefix of it until the ring wraps)."""
        device = self.fc.weight.device if device is None else device
        dtype = self.fc.weight.dtype if dtype is None else dtype
        max_block_size = self.cfg.block_size if max_block_size is None else max_block_size
        cfg = self.cfg
        shape = (n_slots, cfg.num_hidden_layers, cfg.num_key_value_heads, window + max_block_size, cfg.head_dim)
        # Zeros, not empty: masked rows still meet V in the softmax-weighted sum, and 0 * NaN would be NaN.
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.row_positions = torch.full((n_slots, window), -1, device=device, dtype=torch.long)
        self.window = window
        self.scratch = max_block_size

    def reset(self, slot: int = 0) -> None:
        self.row_positions[slot] = -1

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., L*H] -> context vectors [..., H]."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def append_context(self, features: torch.Tensor, positions: torch.Tensor, slot: int = 0) -> None:
        """Write the context K/V of committed positions (increasing) into the slot's ring at rows p % window.
        `slot` is a Python int (a fixed index, so the writes stay static for CUDA graphs)."""
        if features.shape[0] > self.window:  # earlier rows would be overwritten anyway
            features, positions = features[-self.window :], positions[-self.window :]
        context = self.fuse(features)
        cos_sin = self.rotary(positions, context.dtype)
        rows = positions % self.window
        cache_rows = self.scratch + rows
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_kv(context, cos_sin)
            self.k_cache[slot, i, :, cache_rows] = k.to(self.k_cache.dtype)
            self.v_cache[slot, i, :, cache_rows] = v.to(self.v_cache.dtype)
        self.row_positions[slot, rows] = positions

    def forward(self, noise_embedding: torch.Tensor, positions: torch.Tensor, slot: int = 0,
                live: torch.Tensor | None = None, context_rows: int | None = None) -> torch.Tensor:
        """noise_embedding [B, H] (block embeddings, already scaled), positions [B] (anchor first) -> hidden
        [B, H] after the final norm. Sees the ring rows holding positions before the anchor. `live` (a one-element
        tensor, so one CUDA graph serves every value) hides the block rows from `live` on: the first `live` rows
        come out as from a block of that length (where the output budget ends a block early). `context_rows`
        (a static bound, e.g. the target's attention bucket: more than the anchor's position) reads only that
        prefix of the ring while it has not wrapped."""
        block_len = noise_embedding.shape[0]
        if block_len > self.scratch:
            raise ValueError(f"block of {block_len} exceeds the cache's scratch rows; raise setup_cache max_block_size")
        ring = self.window if context_rows is None else min(context_rows, self.window)
        x = noise_embedding.to(self.fc.weight.dtype)
        cos_sin = self.rotary(positions, x.dtype)
        row_positions = self.row_positions[slot, :ring]
        context_valid = (row_positions >= 0) & (row_positions < positions[:1])
        key_positions = torch.cat([positions, row_positions])
        block_valid = torch.ones_like(positions, dtype=torch.bool) if live is None else \
            torch.arange(block_len, device=positions.device) < live
        key_valid = torch.cat([block_valid, context_valid])
        masks = {kind: position_mask(positions, key_positions, *kind) & key_valid for kind in self.attention_kinds}
        rows = slice(self.scratch - block_len, self.scratch + ring)
        keys, values = self.k_cache[slot, :, :, rows], self.v_cache[slot, :, :, rows]
        for i, layer in enumerate(self.layers):
            args = (x, cos_sin, keys[i], values[i], masks[self.layer_attention[i]])
            x = self.compiled_layer(layer, *args) if block_len in self.compiled_blocks else layer(*args)
        return self.norm(x)

    def forward_with_context(
        self,
        noise_embedding: torch.Tensor,
        positions: torch.Tensor,
        context_features: torch.Tensor,
        context_positions: torch.Tensor,
    ) -> torch.Tensor:
        """Stateless forward: the block attends to the given context rows (subject to each layer's causal and
        window rules by position), without touching the ring. Same result as append_context + forward."""
        x = noise_embedding.to(self.fc.weight.dtype)
        context = self.fuse(context_features)
        cos_sin = self.rotary(positions, x.dtype)
        context_cos_sin = self.rotary(context_positions, x.dtype)
        key_positions = torch.cat([positions, context_positions])
        masks = {kind: position_mask(positions, key_positions, *kind) for kind in self.attention_kinds}
        for i, layer in enumerate(self.layers):
            context_k, context_v = layer.self_attn.project_kv(context, context_cos_sin)
            scratch = context_k.new_empty(*context_k.shape[:-2], x.shape[-2], context_k.shape[-1])
            keys, values = torch.cat([scratch, context_k], dim=-2), torch.cat([scratch, context_v], dim=-2)
            x = layer(x, cos_sin, keys, values, masks[self.layer_attention[i]])
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        logits = lm_head(hidden)
        if self.cfg.output_multiplier != 1.0:
            logits = logits * self.cfg.output_multiplier
        softcap = self.cfg.final_logit_softcapping
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return logits


# ---------------------------------------------------------------------------------------------------------
# Checks and loading
# ---------------------------------------------------------------------------------------------------------


def check_compatible(
    cfg: DraftConfig, target_hidden_size: int, target_vocab_size: int, target_num_layers: int
) -> None:
    """Raise ValueError naming what does not fit between a draft and a target."""
    if cfg.hidden_size != target_hidden_size:
        raise ValueError(
            f"draft hidden size {cfg.hidden_size} does not match the target's hidden size {target_hidden_size}"
        )
    if cfg.vocab_size != target_vocab_size:
        raise ValueError(f"draft vocabulary size {cfg.vocab_size} does not match the target's vocabulary size "
                         f"{target_vocab_size}")
    if cfg.mask_token_id is None:
        raise ValueError("draft config has no mask token id (dflash_config.mask_token_id)")
    if not 0 <= cfg.mask_token_id < target_vocab_size:
        raise ValueError(
            f"draft mask token id {cfg.mask_token_id} is outside the target's vocabulary (size {target_vocab_size})"
        )
    outside = [i for i in cfg.target_layer_ids if not 0 <= i < target_num_layers]
    if outside:
        raise ValueError(
            f"draft target layer ids {outside} are out of range for a target with {target_num_layers} layers"
        )


def _name_list(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _read_safetensors(folder: Path, device: torch.device | str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        if not (folder / name).is_file():
            raise ValueError(f"{folder}: shard {name} listed in the index is missing")
        tensors.update(load_file(folder / name, device=str(device)))
    return tensors


def dequantize_int8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Int8 matrices stored with a scale per group of a row's elements (`<name>_scale` [rows, groups], as
    `train.checkpoint.quantize_int8` writes them) back to the dtype of the folder's other tensors."""
    scales = {name.removesuffix("_scale"): t for name, t in tensors.items() if name.endswith("_scale")}
    if not scales:
        return tensors
    dtype = next((t.dtype for n, t in tensors.items() if t.is_floating_point() and not n.endswith("_scale")),
                 torch.float32)

    def restore(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (q.float().unflatten(1, (scale.shape[1], -1)) * scale.float()[..., None]).flatten(1).to(dtype)

    return {name: restore(t, scales[name]) if name in scales else t
            for name, t in tensors.items() if not name.endswith("_scale")}


def load_draft_folder(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> DFlashDraft:
    """Load a z-lab HF draft folder (config.json + safetensors, sharded or not). dtype None keeps the file's."""
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{folder}: no config.json, not a DFlash draft folder")
    config = json.loads(config_file.read_text())
    architectures = config.get("architectures") or []
    if DRAFT_ARCHITECTURE not in architectures:
        raise ValueError(f"{folder}: architectures {architectures} is not {DRAFT_ARCHITECTURE!r}")
    cfg = DraftConfig.from_hf(config)

    # BeeLlama's converter strips a `model.` prefix when present; accept checkpoints that have one.
    tensors = {name.removeprefix("model."): t
               for name, t in dequantize_int8(_read_safetensors(folder, device)).items()}
    with torch.device("meta"):
        model = DFlashDraft(cfg)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        problems = []
        if missing:
            problems.append(f"missing tensors: {_name_list(missing)}")
        if unexpected:
            problems.append(f"unexpected tensors: {_name_list(unexpected)}")
        raise ValueError(f"{folder}: checkpoint does not match its config; " + "; ".join(problems))
    wrong_shapes = [
        f"{name} {tuple(tensors[name].shape)} (expected {tuple(t.shape)})"
        for name, t in expected.items()
        if tensors[name].shape != t.shape
    ]
    if wrong_shapes:
        raise ValueError(f"{folder}: tensors with wrong shapes: {_name_list(wrong_shapes)}")
    if dtype is not None:
        tensors = {name: t.to(dtype) for name, t in tensors.items()}
    model.load_state_dict(tensors, assign=True)
    model.rotary.to_empty(device=device)  # the frequencies are recomputed on the real device in Rotary._apply
    return model.eval()
