"""How many prompt tokens an engine step reads while other slots decode.

A prompt that arrives while streams decode is read in slices between their steps; a step that reads a slice
delays every stream's next token by the slice's time. The pacer keeps such a step within `ratio` decode steps: it
fits the time of a step with a slice as a fixed part (the decode steps themselves among it) plus a part per token
(from the shortest and the longest of the last slices; the engine times those steps with the device
synchronised) and takes the most tokens that fit, a decode step being the moving average of the steps that read
no prompt. Where the fixed part alone overshoots: if a slice costs a whole pass of the target whatever its length
(`whole_pass`: eager slices), small slices would only stretch the prompt out, and it reads `most`; read in graph
replays of `least` tokens each, it reads `least` (a replay is the smallest pause there is). A slice step slower
than `outlier` decode steps is not a slice's cost (a kernel compiled or a graph captured on first use) and is left
out of the fit.
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
    # eager slices, once a decode step is timed, before any slice is (graph replays start at `least`: two beside
    # three streams of the Gemma 4 31B shape took ~49 ms against 13 ms steps, 2026-12-07 H100)
    first: int = 32
    whole_pass: bool = True  # a slice costs a whole pass (eager); False: graph replays of `least` tokens
    alpha: float = 0.2
    outlier: float = 50.0  # a slice step slower than this many decode steps is not fitted
    step_s: float | None = None
    slices: deque = field(default_factory=lambda: deque(maxlen=32))  # (tokens, seconds)

    def observe_step(self, seconds: float) -> None:
        """A decode step that read no prompt (the time between two such steps' starts)."""
        self.step_s = seconds if self.step_s is None else self.step_s + self.alpha * (seconds - self.step_s)

    def observe_slice(self, tokens: int, seconds: float) -> None:
        """A step that read `tokens` prompt tokens beside its decode steps, in `seconds`."""
        if tokens > 0 and (self.step_s is None or seconds <= self.outlier * self.step_s):
            self.slices.append((tokens, seconds))

    def fit(self) -> tuple[float, float]:
        """(fixed seconds, seconds per token) of a step with a slice: from the shortest and the longest lengths (the
        median time of each) where the longest is at least twice the shortest, else all of it per token."""
        times: dict[int, list[float]] = {}
        for n, t in self.slices:
            times.setdefault(n, []).append(t)
        short, long = min(times), max(times)
        t_short, t_long = (statistics.median(times[n]) for n in (short, long))
        per_token = (t_long - t_short) / (long - short) if long >= 2 * short else 0.0
        if per_token <= 0:  # too close to tell the parts apart, or noise: all of it per token
            return 0.0, t_long / long
        return max(t_short - per_token * short, 0.0), per_token

    def size(self) -> int:
        if self.step_s is None:  # no decode step timed yet (prompts that arrived together): nothing to weigh against
            return self.most
        if not self.slices:
            return self.first if self.whole_pass else self.least
        fixed, per_token = self.fit()
        budget = self.ratio * self.step_s
        if fixed >= budget or per_token == 0:
            return self.most if self.whole_pass else self.least
        tokens = int((budget - fixed) / per_token) // self.least * self.least
        return min(self.most, max(self.least, tokens))
