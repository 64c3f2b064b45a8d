"""Batched generation with continuous refill, for regenerating training data.

A pool of `rows` sequences decodes together, one token per row per step, through the target's own forward over
a state with one slot per row, in which a row's column is its position. A row that finishes
is refilled with the next prompt (a batched prefill of the rows freed since the last check), so the pool
stays full until the prompts run out. The decode step has static shapes and, on CUDA, replays as one CUDA
graph. Rows are independent: a row's answer equals what the same target gives that prompt alone.
Greedy, or plain temperature sampling.
"""
from __future__ import annotations

import torch
from torch import Tensor

from flashdraft.engine.graphs import GraphCache
from flashdraft.engine.sampling import SamplingParams, sample

CHECK_EVERY = 8  # decode steps between looks at which rows finished (the one host sync)
PREFILL_ROWS = 64


class Pool:
    """The static state of the pool: the target's state with one slot per row, and the rows' columns."""

    def __init__(self, target, rows: int, columns: int):
        self.target, self.rows, self.columns = target, rows, columns
        self.state = target.new_state(rows, columns)
        self.row_index = torch.arange(rows, device=target.device)


def decode_step(pool: Pool, tokens: Tensor, positions: Tensor) -> Tensor:
    """tokens, positions [R] (one per row; a row's position is its cache column) -> logits [R, V]."""
    logits, _ = pool.target(tokens[:, None], positions[:, None], pool.state, slice(None), attn_len=pool.columns)
    return logits[:, 0]


def prefill_rows(pool: Pool, rows: Tensor, prompts: list[list[int]]) -> Tensor:
    """Write the prompts into cache rows `rows` from column 0 (right-padded: columns past a prompt's end are
    rewritten by its own decode steps before they are attended). Returns each prompt's last logits [n, V]."""
    device = rows.device
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    ids = ids.to(device)
    positions = torch.arange(width, device=device).expand(len(prompts), width)
    last = torch.tensor([len(p) - 1 for p in prompts], device=device)
    logits, _ = pool.target(ids, positions, pool.state, rows, fresh=True, logits_at=last)
    return logits[:, 0]


@torch.inference_mode()
def batch_generate(target, prompts: list[list[int]], max_new_tokens: int, eos: list[int], rows: int = 256,
                   temperature: float = 0.0) -> list[list[int]]:
    """New tokens for each prompt (up to and including the first end-of-turn token), in prompt order."""
    device = target.device
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
