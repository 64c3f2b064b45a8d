"""Batched generation with flashdraft's own target weights and a static KV cache (left padding).

Made for regenerating training data: many prompts answered at once, the cache allocated once per batch,
no per-step bookkeeping beyond one token per row. Greedy, or plain temperature sampling.
"""
from __future__ import annotations

import torch
from torch import Tensor

from flashdraft.draft.model import draft_attention
from flashdraft.models.layers import rope_table
from flashdraft.train.features import project_qkv


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [N, T, heads, D]; cos/sin [N, T, 1, D] (per-row positions)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _layer(layer, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, start: int,
           mask: Tensor) -> Tensor:
    """x [N, T, H] at cache columns start..start+T; mask [N, T, start+T] (True = attend)."""
    attn = layer.self_attn
    t = x.shape[1]
    h = layer.input_layernorm(x)
    q, k, v = project_qkv(attn, h)
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    k_cache[:, :, start:start + t] = k.transpose(1, 2)
    v_cache[:, :, start:start + t] = v.transpose(1, 2)
    out = draft_attention(q.transpose(1, 2), k_cache[:, :, :start + t], v_cache[:, :, :start + t], mask)
    x = x + attn.o_proj(out)
    return x + layer.mlp(layer.post_attention_layernorm(x))


@torch.inference_mode()
def batch_generate(target, prompts: list[list[int]], max_new_tokens: int, eos: list[int], pad_id: int,
                   temperature: float = 0.0, generator: torch.Generator | None = None) -> list[list[int]]:
    """New tokens for each prompt (up to and including the first end-of-turn token)."""
    cfg = target.cfg
    device = target.model.embed_tokens.weight.device
    dtype = target.model.embed_tokens.weight.dtype
    n, width = len(prompts), max(map(len, prompts))
    total = width + max_new_tokens
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    key_valid = torch.zeros((n, total), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        key_valid[i, width - len(p):width] = True
    ids, key_valid = ids.to(device), key_valid.to(device)
    pad = (width - torch.tensor([len(p) for p in prompts], device=device))  # per-row left padding
    table = rope_table(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, total).to(device)
    cache_shape = (cfg.num_layers, n, cfg.num_kv_heads, total, cfg.head_dim)
    k_cache = torch.zeros(cache_shape, device=device, dtype=dtype)
    v_cache = torch.zeros(cache_shape, device=device, dtype=dtype)
    eos_t = torch.tensor(eos, device=device)

    def run(tokens: Tensor, start: int) -> Tensor:
        t = tokens.shape[1]
        columns = torch.arange(start, start + t, device=device)
        positions = (columns[None, :] - pad[:, None]).clamp(min=0)  # [N, T]
        cos_sin = table[positions]  # [N, T, 2, D]
        cos, sin = cos_sin[:, :, 0, None, :].to(dtype), cos_sin[:, :, 1, None, :].to(dtype)
        keys = torch.arange(start + t, device=device)
        # A padding query sees only itself: a row with no key would give NaN, and NaN values leak through
        # zero attention weights into the rows that do use these cache columns' neighbours.
        own = keys[None, None, :] == columns[None, :, None]
        mask = (key_valid[:, None, :start + t] | own) & (keys[None, None, :] <= columns[None, :, None])
        if cfg.sliding_window is not None:
            mask &= (positions[:, :, None] - (keys[None, None, :] - pad[:, None, None])) < cfg.sliding_window
        x = target.embed(tokens)
        for i, layer in enumerate(target.model.layers):
            x = _layer(layer, x, cos, sin, k_cache[i], v_cache[i], start, mask)
        return target.logits(target.model.norm(x[:, -1]))

    def pick(logits: Tensor) -> Tensor:
        if temperature <= 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)

    out = torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=device)
    finished = torch.zeros(n, dtype=torch.bool, device=device)
    token = pick(run(ids, 0))
    steps = 0
    for step in range(max_new_tokens):
        out[:, step] = torch.where(finished, pad_id, token)
        finished |= torch.isin(token, eos_t)
        steps = step + 1
        if step + 1 == max_new_tokens or (step % 16 == 15 and bool(finished.all())):
            break
        key_valid[:, width + step] = True
        token = pick(run(token[:, None], width + step))
    rows = out[:, :steps].tolist()
    eos_set = set(eos)
    results = []
    for row in rows:
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_set), len(row))
        results.append(row[:cut])
    return results
