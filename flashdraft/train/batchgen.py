"""Batched generation with continuous refill, for regenerating training data.

A pool of `rows` sequences decodes together, one token per row per step, over a static KV cache
[layers, rows, kv_heads, columns, head_dim] in which a row's column is its position. A row that finishes
is refilled with the next prompt (a batched prefill of the rows freed since the last check), so the pool
stays full until the prompts run out. The decode step has static shapes and, on CUDA, replays as one CUDA
graph. Rows are independent: a row's answer equals what the same target gives that prompt alone.
Greedy, or plain temperature sampling.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flashdraft.draft.model import draft_attention
from flashdraft.engine.graphs import GraphCache
from flashdraft.engine.sampling import SamplingParams, sample
from flashdraft.models.layers import apply_rope, position_mask, rope_table
from flashdraft.train.features import project_qkv

CHECK_EVERY = 8  # decode steps between looks at which rows finished (the one host sync)
PREFILL_ROWS = 64


class Pool:
    """The static state of the pool: cache, rope table, rows' next input token and its position."""

    def __init__(self, target, rows: int, columns: int):
        cfg = target.cfg
        weight = target.model.embed_tokens.weight
        shape = (cfg.num_layers, rows, cfg.num_kv_heads, columns, cfg.head_dim)
        self.target, self.rows, self.columns = target, rows, columns
        self.k_cache = torch.zeros(shape, device=weight.device, dtype=weight.dtype)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.rope = rope_table(cfg, columns).to(weight.device)
        self.key_columns = torch.arange(columns, device=weight.device)
        self.row_index = torch.arange(rows, device=weight.device)


def _qkv(layer, h: Tensor, cos_sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    attn = layer.self_attn
    q, k, v = project_qkv(attn, h)
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    return apply_rope(q, cos_sin), apply_rope(k, cos_sin), v


def _finish_layer(layer, x: Tensor, attn_out: Tensor) -> Tensor:
    x = x + layer.self_attn.o_proj(attn_out)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def decode_step(pool: Pool, tokens: Tensor, positions: Tensor) -> Tensor:
    """tokens, positions [R] (one per row; a row's position is its cache column) -> logits [R, V]."""
    target = pool.target
    cos_sin = pool.rope[positions, None]  # [R, 1, 2, D]
    mask = position_mask(positions[:, None], pool.key_columns, True, target.cfg.sliding_window)  # [R, 1, C]
    x = target.embed(tokens)[None]  # [1, R, H]: the rows stand on the token axis for projections and RoPE
    for i, layer in enumerate(target.model.layers):
        q, k, v = _qkv(layer, layer.input_layernorm(x), cos_sin)  # [1, R, heads, D]
        pool.k_cache[i, pool.row_index, :, positions] = k[0].to(pool.k_cache.dtype)
        pool.v_cache[i, pool.row_index, :, positions] = v[0].to(pool.v_cache.dtype)
        out = draft_attention(q[0, :, :, None], pool.k_cache[i], pool.v_cache[i], mask)  # [R, 1, heads*D]
        x = _finish_layer(layer, x, out.transpose(0, 1))
    return target.logits(target.model.norm(x[0]))


def prefill_rows(pool: Pool, rows: Tensor, prompts: list[list[int]]) -> Tensor:
    """Write the prompts into cache rows `rows` from column 0 (right-padded: columns past a prompt's end are
    rewritten by its own decode steps before they are attended). Returns each prompt's last logits [n, V]."""
    target = pool.target
    device = rows.device
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    ids = ids.to(device)
    positions = torch.arange(width, device=device)
    mask = position_mask(positions, positions, True, target.cfg.sliding_window)
    x = target.embed(ids)
    for i, layer in enumerate(target.model.layers):
        q, k, v = _qkv(layer, layer.input_layernorm(x), pool.rope[:width, None])  # [n, T, heads, D]
        pool.k_cache[i, rows, :, :width] = k.transpose(1, 2).to(pool.k_cache.dtype)
        pool.v_cache[i, rows, :, :width] = v.transpose(1, 2).to(pool.v_cache.dtype)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
            enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2).flatten(2)
        x = _finish_layer(layer, x, out)
    last = torch.tensor([len(p) - 1 for p in prompts], device=device)
    return target.logits(target.model.norm(x[torch.arange(len(prompts), device=device), last]))


@torch.inference_mode()
def batch_generate(target, prompts: list[list[int]], max_new_tokens: int, eos: list[int], rows: int = 256,
                   temperature: float = 0.0) -> list[list[int]]:
    """New tokens for each prompt (up to and including the first end-of-turn token), in prompt order."""
    device = target.model.embed_tokens.weight.device
    rows = max(1, min(rows, len(prompts)))
    width = max_new_tokens + CHECK_EVERY  # a row may run a few steps past its end before it is seen
    pool = Pool(target, rows, max(map(len, prompts)) + width)
    graphs = GraphCache(str(device))
    eos_t, eos_set = torch.tensor(eos, device=device), set(eos)
    out = torch.zeros((rows, width), dtype=torch.long, device=device)
    count = torch.zeros(rows, dtype=torch.long, device=device)
    tokens = torch.zeros(rows, dtype=torch.long, device=device)
    positions = torch.zeros(rows, dtype=torch.long, device=device)
    owner = [-1] * rows  # the prompt each row answers (-1: idle)
    results: list[list[int] | None] = [None] * len(prompts)
    next_prompt = 0
    sampling = SamplingParams(temperature=temperature)

    def refill(free: list[int]) -> None:
        nonlocal next_prompt
        take = free[:len(prompts) - next_prompt]
        if not take:
            return
        chosen = list(range(next_prompt, next_prompt + len(take)))
        next_prompt += len(take)
        index = torch.tensor(take, device=device)
        first = torch.cat([  # in groups, so the prefill's attention scores stay small when the whole pool fills
            sample(prefill_rows(pool, index[i:i + PREFILL_ROWS], [prompts[j] for j in chosen[i:i + PREFILL_ROWS]]),
                   sampling, None) for i in range(0, len(take), PREFILL_ROWS)])
        out[index, 0] = first
        count[index] = 1
        tokens[index] = first
        positions[index] = torch.tensor([len(prompts[j]) for j in chosen], device=device)
        for r, j in zip(take, chosen):
            owner[r] = j

    refill(list(range(rows)))
    while any(o >= 0 for o in owner):
        for _ in range(CHECK_EVERY):
            (tokens,) = graphs.run(("decode", rows), lambda t, p: (sample(decode_step(pool, t, p), sampling, None),),
                                   [tokens, positions])
            out[pool.row_index, count.clamp(max=width - 1)] = tokens
            count += 1
            positions = (positions + 1).clamp(max=pool.columns - 1)
        seen = torch.arange(width, device=device)[None, :] < count.clamp(max=max_new_tokens)[:, None]
        done = ((torch.isin(out, eos_t) & seen).any(1) | (count >= max_new_tokens)).tolist()
        free = [r for r in range(rows) if done[r] and owner[r] >= 0]
        if not free:
            continue
        finished = out[free].tolist()
        limits = count[free].clamp(max=max_new_tokens).tolist()
        for r, row, limit in zip(free, finished, limits):
            row = row[:limit]
            cut = next((i + 1 for i, t in enumerate(row) if t in eos_set), len(row))
            results[owner[r]] = row[:cut]
            owner[r] = -1
        refill(free)
    return results  # type: ignore[return-value]
