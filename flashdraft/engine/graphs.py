"""CUDA graphs of the decode-loop steps, with static shapes.

A step attends over a fixed number of cache rows (a bucket: the next power of two that covers the
needed length), so one graph serves every position inside its bucket, and attention never reads rows
past the bucket. Graphs are captured per (step kind, slot, bucket); `warmup` captures them at start.
"""
from collections.abc import Callable

import torch
from torch import Tensor

from flashdraft.engine.sampling import argmax_rows

MIN_BUCKET = 256


def bucket_for(length: int, max_len: int) -> int:
    b = MIN_BUCKET
    while b < length:
        b *= 2
    return min(b, max_len)


def plain_step(target, token: Tensor, pos: Tensor, slot: int, attn_len: int,
               capture: list[int] | None = None) -> tuple[Tensor, ...]:
    """One token through the target: (logits,), or (logits, features) when `capture` names layers (a plain
    step taken while a draft follows along, which needs the features of every committed position)."""
    logits, feats = target(token, pos, slot=slot, capture=capture, attn_len=attn_len)
    return (logits,) if capture is None else (logits, feats)


def speculative_step(target, draft, block: Tensor, positions: Tensor, slot: int, attn_len: int,
                     verify: int | None = None, live: Tensor | None = None):
    """Draft one block after its anchor `block[0]`, then verify its first `verify` tokens (default: all).
    The draft always sees the whole block (its first `live` rows, see DFlashDraft.forward), so a narrower verify
    checks the same proposals. Returns (drafted [verify - 1], logits [verify, V], features [verify, L*H])."""
    verify = verify or len(block)
    noise = target.embed(block) * draft.cfg.input_embedding_scale
    hidden = draft(noise, positions, slot, live, attn_len)  # the ring rows past the bucket hold no context yet
    drafted = argmax_rows(draft.compute_logits(hidden[1:verify], target.logits))
    checked = torch.cat([block[:1], drafted])
    logits, feats = target(checked, positions[:verify], slot=slot, capture=draft.cfg.target_layer_ids,
                           attn_len=attn_len)
    return drafted, logits, feats


class GraphCache:
    def __init__(self, device: str):
        self.device = device
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[Tensor], tuple[Tensor, ...]]] = {}
        self.pool = None

    def run(self, key: tuple, fn: Callable[..., tuple[Tensor, ...]], inputs: list[Tensor]) -> tuple[Tensor, ...]:
        if not self.device.startswith("cuda"):  # the same static shapes, run eagerly (CPU, tests)
            return fn(*inputs)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.capture(fn, inputs)
            self.graphs[key] = entry
        graph, static_inputs, outputs = entry
        for buf, x in zip(static_inputs, inputs):
            buf.copy_(x, non_blocking=True)
        graph.replay()
        return outputs

    def capture(self, fn, inputs: list[Tensor]):
        static_inputs = [x.clone() for x in inputs]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up outside the graph (allocator, cuBLAS workspaces)
            fn(*static_inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn(*static_inputs)
        if self.pool is None:
            self.pool = graph.pool()
        return graph, static_inputs, outputs
