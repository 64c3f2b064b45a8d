"""Target features for training: a batched causal forward through the frozen target, no KV cache.

Sequences are right-padded, so plain causal attention keeps padding out of every real position.
Only the layers up to the deepest captured one run.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flashdraft.models.layers import apply_rope, rope_table


def project_qkv(attn, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q [N, T, Hq, D], k and v [N, T, Hkv, D] from the target's fused q/k/v projection."""
    n, t, _ = x.shape
    q, k, v = attn.qkv_proj(x).split(attn.split_sizes["qkv_proj"], dim=-1)
    return (q.reshape(n, t, attn.num_heads, attn.head_dim), k.reshape(n, t, attn.num_kv_heads, attn.head_dim),
            v.reshape(n, t, attn.num_kv_heads, attn.head_dim))


def _attention(layer, x: Tensor, cos_sin: Tensor, mask: Tensor | None) -> Tensor:
    attn = layer.self_attn
    n, s, _ = x.shape
    q, k, v = project_qkv(attn, x)
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rope(q, cos_sin), apply_rope(k, cos_sin)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=mask is None,
        enable_gqa=attn.num_heads != attn.num_kv_heads)
    return attn.o_proj(out.transpose(1, 2).reshape(n, s, -1))


@torch.no_grad()
def target_features(target, input_ids: Tensor, layer_ids: list[int]) -> Tensor:
    """input_ids [N, S] (right-padded) -> concatenated outputs of decoder layers `layer_ids` [N, S, L*H],
    in that order (layer id i = HF hidden_states[i + 1]), as the target's forward captures them."""
    cfg = target.cfg
    s = input_ids.shape[1]
    cos_sin = rope_table(cfg, s)[:, None].to(input_ids.device)  # [S, 1, 2, D]: broadcast over heads
    mask = None
    if cfg.sliding_window is not None:
        pos = torch.arange(s, device=input_ids.device)
        offset = pos[:, None] - pos[None, :]
        mask = (offset >= 0) & (offset < cfg.sliding_window)
    x = target.embed(input_ids)
    captured: dict[int, Tensor] = {}
    for i, layer in enumerate(target.model.layers[:max(layer_ids) + 1]):
        x = x + _attention(layer, layer.input_layernorm(x), cos_sin, mask)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        if i in layer_ids:
            captured[i] = x
    return torch.cat([captured[i] for i in layer_ids], dim=-1)
