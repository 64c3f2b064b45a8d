"""DFlash drafts stored as GGUF: BeeLlama's `dflash-draft` and upstream llama.cpp's `dflash` (and the
`*-dflash-draft` forks' names), read into z-lab's config.json form and state-dict names.

- `dflash-draft` (BeeLlama): `{arch}.dflash.target_layer_ids` holds HF's layer ids as they are; `dflash_fc`,
  `dflash_hidden_norm`; `blk.N.post_attention_norm` is the pre-MLP norm.
- `dflash` (llama.cpp): `dflash.target_layers` holds each id + 1 (the runtime taps the input of the next
  layer); `fc`, `enc.output_norm`; `blk.N.ffn_norm` is the pre-MLP norm; the mask id may sit in the tokenizer
  keys. Token embedding and LM head are absent or ignored: the draft shares the target's."""
from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from flashdraft.formats.gguf import GGUFFile
from flashdraft.quant.dequant import FLOAT_TYPES, dequantize, tensor_bytes

GLOBAL_NAMES = {"dflash_fc": "fc", "fc": "fc", "dflash.fc": "fc", "dflash_hidden_norm": "hidden_norm",
                "enc.output_norm": "hidden_norm", "dflash.hidden_norm": "hidden_norm", "output_norm": "norm"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
               "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
# DFlash2 (llama.cpp's `dflash` with convolutions and a selector): per layer, without `.weight` where z-lab's
# names have none
LAYER_PARAMETERS = {"attn_conv_base": "attention_conv.base_kernel", "ffn_conv_base": "mlp_conv.base_kernel"}
LAYER_NAMES |= {"attn_conv_proj": "attention_conv.kernel_projection", "ffn_conv_proj": "mlp_conv.kernel_projection"}
GLOBAL_PARAMETERS = {"selector_predecessor": "candidate_selector.predecessor_codebook",
                     "selector_successor": "candidate_selector.successor_codebook"}
GLOBAL_NAMES |= {"selector_hidden": "candidate_selector.hidden_projection"}
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
SHARED_WITH_TARGET = {"token_embd", "output"}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)(\.weight)?")


def is_draft_architecture(arch: str) -> bool:
    return arch == "dflash" or arch.endswith("dflash-draft")


def is_draft_gguf(g: GGUFFile) -> bool:
    return is_draft_architecture(g.architecture)


def draft_hf_config(g: GGUFFile) -> dict[str, Any]:
    """z-lab's config.json dict for a draft GGUF."""
    arch, md = g.architecture, g.metadata
    if not is_draft_gguf(g):
        raise ValueError(f"{g.path.name}: a GGUF of architecture {arch!r} is not a DFlash draft "
                         f"(expected dflash-draft or dflash)")

    def get(*keys: str, default: Any = None) -> Any:
        return next((md[k] for k in keys if md.get(k) is not None), default)

    if arch == "dflash":
        stored = get(f"{arch}.target_layers")
        if stored is None:
            raise ValueError(f"{g.path.name}: no {arch}.target_layers")
        ids = [int(i) - 1 for i in stored] if min(stored) >= 1 else [int(i) for i in stored]  # stored + 1
    else:
        ids = get(f"{arch}.dflash.target_layer_ids", f"{arch}.target_layer_ids")
        if ids is None:
            raise ValueError(f"{g.path.name}: no {arch}.dflash.target_layer_ids")
        ids = [int(i) for i in ids]
    n_layers = int(get(f"{arch}.block_count"))
    heads = int(get(f"{arch}.attention.head_count"))
    hidden = int(get(f"{arch}.embedding_length"))
    tokens = md.get("tokenizer.ggml.tokens")
    vocab = get(f"{arch}.vocab_size", default=len(tokens) if tokens else None)
    if vocab is None and "token_embd.weight" in g.tensors:
        vocab = g.tensors["token_embd.weight"].shape[0]
    window = get(f"{arch}.attention.sliding_window")
    pattern = get(f"{arch}.attention.sliding_window_pattern")
    if window and isinstance(pattern, list):
        layer_types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        window, layer_types = None, ["full_attention"] * n_layers
    softcap = get(f"{arch}.final_logit_softcapping")
    dflash = {"mask_token_id": get(f"{arch}.dflash.mask_token_id", f"{arch}.mask_token_id",
                                   "tokenizer.ggml.mask_token_id"),
              "target_layer_ids": ids}
    if softcap:
        dflash["final_logit_softcapping"] = float(softcap)
    if get(f"{arch}.logit_scale") not in (None, 1.0):
        dflash["output_multiplier"] = float(get(f"{arch}.logit_scale"))
    dflash2 = {name: get(f"{arch}.{name}", f"{arch}.dflash.{name}") for name in DFLASH2_KEYS}
    if dflash2["conv_kernel_size"] is not None:  # DFlash2: convolutions and the candidate selector
        dflash.update({name: int(v) for name, v in dflash2.items() if v is not None})
    extra = {}
    if "conv_kernel_size" in dflash and (causal := get(f"{arch}.attention.causal")) is not None:
        extra["is_causal"] = bool(causal)  # (DFlash2's own default: bidirectional, as llama.cpp's)
    return extra | {
        "architectures": ["DFlash2DraftModel" if "conv_kernel_size" in dflash else "DFlashDraftModel"],
        "model_type": "qwen3", "hidden_size": hidden,
        "intermediate_size": int(get(f"{arch}.feed_forward_length")), "num_hidden_layers": n_layers,
        "num_attention_heads": heads, "num_key_value_heads": int(get(f"{arch}.attention.head_count_kv", default=heads)),
        "head_dim": int(get(f"{arch}.attention.key_length", default=hidden // heads)), "hidden_act": "silu",
        "rms_norm_eps": float(get(f"{arch}.attention.layer_norm_rms_epsilon", default=1e-6)),
        "rope_theta": float(get(f"{arch}.rope.freq_base", default=10000.0)),
        "max_position_embeddings": int(get(f"{arch}.context_length", default=32768)),
        "vocab_size": None if vocab is None else int(vocab), "layer_types": layer_types,
        "use_sliding_window": window is not None, "sliding_window": window,
        "num_target_layers": int(get(f"{arch}.dflash.n_target_layers", default=max(ids) + 1)),  # the files' best
        "block_size": int(get(f"{arch}.dflash.block_size", f"{arch}.block_size", default=16)),
        "dflash_config": dflash,
    }


def draft_tensor_name(name: str) -> str | None:
    """z-lab's state-dict name of a draft GGUF tensor (None: shared with the target, not loaded)."""
    if m := _LAYER.fullmatch(name):
        layer, part, weight = m.groups()
        if weight and part in LAYER_NAMES:
            return f"layers.{layer}.{LAYER_NAMES[part]}.weight"
        if not weight and part in LAYER_PARAMETERS:
            return f"layers.{layer}.{LAYER_PARAMETERS[part]}"
    else:
        base = name.removesuffix(".weight")
        if base in GLOBAL_NAMES:
            return f"{GLOBAL_NAMES[base]}.weight"
        if base in GLOBAL_PARAMETERS:
            return GLOBAL_PARAMETERS[base]
        if base in SHARED_WITH_TARGET:
            return None
    raise ValueError(f"unexpected tensor {name!r} in a DFlash draft GGUF")


def iter_draft_tensors(g: GGUFFile, dtype: torch.dtype | None, device: torch.device | str,
                       keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
    """(z-lab name, dequantized tensor) pairs, all in `dtype` (None: the fusion matrix's stored float type, else
    float32; the norms, stored as F32, follow it). keep_quantized: matrices of a type the GPU kernels read come as
    `layers.quantized.QuantizedWeight`, as a target's do (formats/gguf.iter_gguf_tensors)."""
    from flashdraft.formats.gguf import keeps_quantized, mapped_bytes, stored_weight
    from flashdraft.layers.quantized import kernel_types
    kept = kernel_types() if keep_quantized else ()
    if dtype is None:
        fc = next((t for t in g.tensors.values() if draft_tensor_name(t.name) == "fc.weight"), None)
        dtype = FLOAT_TYPES.get(fc.qtype, torch.float32) if fc is not None else torch.float32
    for t in g.tensors.values():
        name = draft_tensor_name(t.name)
        if name is None:
            continue
        if name.endswith(".weight") and keeps_quantized(t, kept):  # (a bare parameter is no module's weight)
            yield name, stored_weight(t, mapped_bytes(t))
            continue
        try:
            yield name, dequantize(tensor_bytes(t), t.qtype, t.shape, dtype, device)
        except ValueError as e:
            raise ValueError(f"tensor {t.name}: {e}") from None
