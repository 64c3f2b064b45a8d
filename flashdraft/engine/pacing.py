"""How many prompt tokens an engine step reads while other slots decode.

A prompt that arrives while streams decode is read in slices between their steps; each slice delays every
stream's next token by its own time. The pacer keeps that delay within a share of a decode step: it fits a slice's
time as a fixed part plus a part per token (from the shortest and the longest of the last slices, timed by the
engine with the device synchronised) and takes the most tokens whose slice fits `(ratio - 1)` decode steps, a
decode step being the moving average of the steps that read no prompt. Where the fixed part alone overshoots (a
slice costs a whole pass of the target whatever its length), small slices would only stretch the prompt out: it
reads `most` then.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class SlicePacer:
    ratio: float = 2.5  # a step with a slice against a decode step (issue 47: inter-token latency at most 3x)
    least: int = 16  # slices are multiples of this (fewer shapes to plan and compile)
    most: int = 512
    first: int = 64  # before anything is timed
    alpha: float = 0.2
    step_s: float | None = None
    slices: deque = field(default_factory=lambda: deque(maxlen=32))  # (tokens, seconds)

    def observe_step(self, seconds: float) -> None:
        """A decode step that read no prompt (the time between two such steps' starts)."""
        self.step_s = seconds if self.step_s is None else self.step_s + self.alpha * (seconds - self.step_s)

    def observe_slice(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.slices.append((tokens, seconds))

    def fit(self) -> tuple[float, float]:
        """(fixed seconds, seconds per token) of a slice: from the shortest and the longest lengths timed (the
        median time of each) where the longest is at least twice the shortest, else all of it per token."""
        times: dict[int, list[float]] = {}
        for n, t in self.slices:
            times.setdefault(n, []).append(t)
        short, long = min(times), max(times)
        t_short, t_long = (statistics.median(times[n]) for n in (short, long))
        if long < 2 * short:
            return 0.0, t_long / long
        per_token = max((t_long - t_short) / (long - short), 0.0)
        return max(t_short - per_token * short, 0.0), per_token

    def size(self) -> int:
        if self.step_s is None or not self.slices:
            return self.first
        fixed, per_token = self.fit()
        budget = (self.ratio - 1) * self.step_s
        if fixed >= budget or per_token == 0:
            return self.most
        tokens = round((budget - fixed) / per_token / self.least) * self.least  # nearest: a size may grow
        return min(self.most, max(self.least, tokens))
