"""Sampling parameters, the filtered target distribution, and seeded sampling without host syncs."""
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0 or self.top_k == 1

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")


def filtered_probs(logits: Tensor, p: SamplingParams) -> Tensor:
    """The distribution every emitted token follows: top-k, top-p and min-p applied to softmax(logits),
    then the temperature applied to what survives (llama.cpp's sampler order). logits: [N, V]."""
    logits = logits.float()
    keep = torch.ones_like(logits, dtype=torch.bool)
    if 0 < p.top_k < logits.shape[-1]:
        kth = logits.topk(p.top_k, dim=-1).values[:, -1:]
        keep &= logits >= kth
    if p.top_p < 1.0:
        probs = logits.masked_fill(~keep, float("-inf")).softmax(-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs
        keep &= torch.zeros_like(keep).scatter(-1, order, before < p.top_p)
    if p.min_p > 0:
        probs = logits.masked_fill(~keep, float("-inf")).softmax(-1)
        keep &= probs >= p.min_p * probs.max(-1, keepdim=True).values
    return (logits / p.temperature).masked_fill(~keep, float("-inf")).softmax(-1)


ARGMAX_CHUNKS = 64


def argmax_rows(x: Tensor) -> Tensor:
    """torch.argmax over the last dim of [N, V] (first index on ties). On a GPU a long row is cut into chunks first:
    torch's reduction gives each row one thread block, 36 us for 15 rows of a 128k vocabulary on an H200."""
    if not x.is_cuda or x.shape[-1] % ARGMAX_CHUNKS or x.shape[-1] < 64 * ARGMAX_CHUNKS:
        return x.argmax(-1)
    return chunked_argmax(x)


def chunked_argmax(x: Tensor) -> Tensor:
    width = x.shape[-1] // ARGMAX_CHUNKS
    values, index = x.unflatten(-1, (ARGMAX_CHUNKS, width)).max(-1)  # the first maximum of each chunk
    best = values.argmax(-1, keepdim=True)  # the first chunk holding the row's maximum
    return (best * width + index.gather(-1, best)).squeeze(-1)


def sample(logits: Tensor, p: SamplingParams, generator: torch.Generator | None) -> Tensor:
    """One token per row of logits [N, V]: argmax when greedy, else an exponential race over the
    filtered distribution (equivalent to multinomial, but with no host synchronisation)."""
    if p.greedy:
        return argmax_rows(logits)
    probs = filtered_probs(logits, p)
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return argmax_rows(probs / noise)
