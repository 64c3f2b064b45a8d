"""Synthetic acceptance for benchmarking (llama.cpp's --spec-synth-len / --spec-synth-rates): the drafter still
drafts and the target still verifies every block, but whether a drafted token is accepted is drawn at random with
given per-position probabilities instead of checked against the target's own token. Two engines (or two widths)
then do the same draft-and-verify work at the same acceptance, so a comparison measures the engines, not the
drafts. The text it makes is not the model's output.

`rates[i]` is the unconditional chance that drafted position i (0-based) is accepted, the ones before it included;
a step accepts position i with the conditional chance rates[i] / rates[i - 1] given that i - 1 was accepted. A mean
acceptance length L (the target's token included: L = 1 + sum(rates)) resolves, as llama.cpp resolves it, into
geometric rates p, p^2, ..., p^n_max with p found by bisection.
"""
import math
import random

import torch
from torch import Tensor

from flashdraft.engine.sampling import SamplingParams, check_sampled

WARNING = "synthetic speculative acceptance is enabled for benchmarking; generated output is not valid"


def check_flags(length: float | None, rates: list[float] | None) -> None:
    """The checks that need no draft (so a command line fails before anything loads), llama.cpp's texts."""
    if length is not None and rates:
        raise ValueError("synthetic acceptance length and rates are mutually exclusive")
    for i, r in enumerate(rates or ()):
        if not math.isfinite(r) or not 0.0 <= r <= 1.0:
            raise ValueError("synthetic acceptance rates must be finite and within [0, 1]")
        if i > 0 and r > rates[i - 1]:
            raise ValueError("synthetic acceptance rates must be monotonically non-increasing")
    if length is not None and not (math.isfinite(length) and length >= 1.0):
        raise ValueError("synthetic acceptance length must be finite and at least 1")


def resolve_rates(length: float | None, rates: list[float] | None, n_max: int) -> list[float]:
    """The unconditional per-position rates for drafts of up to `n_max` tokens ([] when neither is given), with
    llama.cpp's checks and error texts (common_speculative_synth_rates_resolve)."""
    if length is None and not rates:
        return []
    if length is not None and rates:
        raise ValueError("synthetic acceptance length and rates are mutually exclusive")
    if n_max <= 0:
        raise ValueError("synthetic acceptance requires at least one speculative token")
    if rates:
        if len(rates) != n_max:
            raise ValueError(f"synthetic acceptance rates must contain {n_max} values, got {len(rates)}")
        check_flags(None, rates)
        return list(rates)
    length_max = n_max + 1.0
    if not math.isfinite(length) or not 1.0 <= length <= length_max:
        raise ValueError(f"synthetic acceptance length must be finite and within [1, {length_max:.0f}]")
    p = 0.0
    if length == length_max:
        p = 1.0
    elif length > 1.0:
        lo, hi = 0.0, 1.0
        for _ in range(32):
            mid = 0.5 * (lo + hi)
            if sum(mid ** (j + 1) for j in range(n_max)) < length - 1.0:
                lo = mid
            else:
                hi = mid
        p = 0.5 * (lo + hi)
    return [p ** (i + 1) for i in range(n_max)]


def conditional(rates: list[float]) -> list[float]:
    """The chance of accepting position i given that position i - 1 was accepted."""
    return [r / before if before > 0 else 0.0 for r, before in zip(rates, [1.0] + rates[:-1])]


def mean_length(rates: list[float]) -> float:
    return 1.0 + sum(rates)


class SyntheticAcceptance:
    """An acceptance rule (engine/generate.AcceptRule) for one request: drafted position i is accepted with
    `probs[i]` (conditional) while the ones before it were, never an end-of-generation token (it would end the
    answer early); the step's next token is the target's own token at the first position not accepted, as a real
    rejection's. Draws come from `random.Random(seed)`: a seeded request repeats."""

    def __init__(self, probs: list[float], eos: set[int], seed: int | None):
        self.probs, self.eos = probs, eos
        self.rng = random.Random(seed)

    def __call__(self, drafted: Tensor, logits: Tensor, params: SamplingParams,
                 posterior: Tensor) -> tuple[int, int]:
        both = torch.cat([drafted, posterior]).tolist()
        proposed, target_tokens = both[:len(drafted)], both[len(drafted):]
        accepted = 0
        for i, token in enumerate(proposed):
            if not (self.rng.random() < self.probs[i] and token not in self.eos):
                break
            accepted += 1
        check_sampled(target_tokens[accepted:accepted + 1])
        return accepted, target_tokens[accepted]
