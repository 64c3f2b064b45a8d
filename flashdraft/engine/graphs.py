"""CUDA graph capture and replay for static-shape step functions (on the CPU the same functions run eagerly).
engine/steps.py owns which steps exist and their keys; this module only captures and replays them."""
from collections.abc import Callable, Hashable

import torch
from torch import Tensor


class GraphCache:
    """Graphs by key, each group of them sharing one memory pool. Within a pool a graph's intermediates may lie where
    a graph captured after it keeps its outputs, so replaying the earlier graph overwrites those outputs: a group's
    outputs must be read before another graph of the group replays. The decode loop reads a step's outputs through
    its sampling and its drafter's observation, so those run in groups of their own (`pool`), while the steps share
    one pool (the memory the step graphs take stays that of the largest)."""

    def __init__(self, device: str):
        self.device = device
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, list[Tensor], tuple[Tensor, ...]]] = {}
        self.pools: dict[str, object] = {}

    @property
    def captures(self) -> bool:
        return self.device.startswith("cuda")

    def run(self, key: Hashable, fn: Callable[..., tuple[Tensor, ...]], inputs: list[Tensor],
            pool: str = "steps") -> tuple[Tensor, ...]:
        """fn(*inputs) by key's graph (captured on first use into the memory pool named `pool`)."""
        if not self.captures:  # the same static shapes, run eagerly (CPU, tests)
            return fn(*inputs)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.capture(fn, inputs, pool)
            self.graphs[key] = entry
        graph, static_inputs, outputs = entry
        for buf, x in zip(static_inputs, inputs):
            buf.copy_(x, non_blocking=True)
        graph.replay()
        return outputs

    def capture(self, fn, inputs: list[Tensor], pool: str = "steps"):
        static_inputs = [x.clone() for x in inputs]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up outside the graph (allocator, cuBLAS workspaces)
            fn(*static_inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pools.get(pool)):
            outputs = fn(*static_inputs)
        self.pools.setdefault(pool, graph.pool())
        return graph, static_inputs, outputs
