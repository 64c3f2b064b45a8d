"""Adaptive verify width: how many drafted tokens each speculative step checks (BeeLlama's "profit" rule).

Expected tokens from a step of width w (the anchor plus w - 1 drafted tokens) are E_w = 1 + sum_{k < w-1} s_k,
where s_k, the chance that draft position k+1 is accepted, is an exponential moving average over the steps
that checked it. Each candidate width has a cost relative to a plain one-token step, measured once per engine
(`measure_costs`). The controller keeps the width with the most expected tokens per unit of cost, and moves
only when another width beats it by a margin. Estimates start optimistic (every position accepted), so a
request starts at full width; that guess gives way fast: the first `fast_steps` steps that check drafted tokens
move the estimates halfway to what they saw, so a draft that accepts nothing costs about four full-width steps, not the
dozen the moving average alone takes to decay (four requests at once, each its first dozen steps at full width: most
of a 5.5% loss, 2026-12-07 H100), while one early rejection does not narrow a good draft for long. A narrower
width learns nothing of the positions it does not check, so every `explore_every` steps one step goes a candidate
wider; width 1 is plain decoding, and from there a full-width step every `probe_every` steps keeps the estimates
fresh: that interval doubles after each probe whose tokens did not pay for its cost (up to `probe_most`, so a draft
that never fits, a random one, or one whose verify steps cost more than it brings, costs next to nothing) and falls
back to `probe_every` once a probe pays. Decisions depend on acceptance alone, never on the clock during a request,
so a seeded request repeats exactly.

A request's estimates start from what the requests before it learned (`AcceptancePrior`: a draft that accepted
nothing then starts plain, probing, instead of spending its first steps at full width); the probe interval starts
afresh, so a request whose text the draft suits finds that out within `probe_every` steps.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class WidthController:
    costs: dict[int, float]  # width -> step cost relative to a plain step (costs[1] == 1)
    alpha: float = 0.15
    margin: float = 0.05
    probe_every: int = 16
    probe_most: int = 256
    explore_every: int = 12
    survival: list[float] = field(default_factory=list)
    current: int = 0
    steps_at_current: int = 0
    checked: int = 0  # steps that checked drafted tokens (what the estimates learned from)
    probe_interval: int = 0  # plain steps before the next probe (probe_every, doubled by each fruitless probe)
    fast_steps: int = 4  # checking steps that move the estimates halfway (the optimistic guess; none from a prior)

    def __post_init__(self) -> None:
        widest = max(self.costs)
        self.survival = self.survival or [1.0] * (widest - 1)
        self.current = self.current or widest
        self.probe_interval = self.probe_interval or self.probe_every

    def expected_tokens(self, width: int) -> float:
        return 1.0 + sum(self.survival[:width - 1])

    def score(self, width: int) -> float:
        return self.expected_tokens(width) / self.costs[width]

    def cost(self, width: int) -> float:
        """A step's cost at any width: a measured width's, else the next wider measured one's (a step narrowed by
        the output budget, the context's end or the request's n_max runs that width's graph)."""
        return self.costs[min((w for w in self.costs if w >= width), default=max(self.costs))]

    def width(self) -> int:
        if self.current == 1:
            return max(self.costs) if self.steps_at_current >= self.probe_interval else 1
        if self.current < max(self.costs) and self.steps_at_current >= self.explore_every:
            return min(w for w in self.costs if w > self.current)
        return self.current

    def record(self, width: int, accepted: int) -> None:
        """After a step of `width` whose first `accepted` drafted tokens were accepted."""
        if width != self.current:  # a probe or an exploration step
            self.steps_at_current = 0
            if self.current == 1:  # a probe pays where its tokens beat the plain steps its cost would buy
                self.probe_interval = (min(2 * self.probe_interval, self.probe_most)
                                       if accepted + 1 <= self.cost(width) else self.probe_every)
        else:
            self.steps_at_current += 1
        if width == 1:
            return
        self.checked += 1
        rate = max(self.alpha, 0.5) if self.checked <= self.fast_steps else self.alpha
        for k in range(width - 1):
            self.survival[k] += rate * (float(accepted > k) - self.survival[k])
        best = max(self.costs, key=self.score)
        if self.score(best) > self.score(self.current) * (1 + self.margin):
            self.current, self.steps_at_current = best, 0


@dataclass
class AcceptancePrior:
    """Where a request's acceptance estimates start: all accepted (optimistic) until a request has checked drafted
    tokens, then a moving average of finished requests' estimates (`weight` on the latest)."""
    weight: float = 0.5
    survival: list[float] | None = None

    def controller(self, costs: dict[int, float]) -> WidthController:
        if self.survival is None:
            return WidthController(dict(costs))
        c = WidthController(dict(costs), survival=list(self.survival), fast_steps=0)
        c.current = max(sorted(c.costs), key=c.score)
        return c

    def learn(self, c: WidthController) -> None:
        if not c.checked:
            return
        if self.survival is None or len(self.survival) != len(c.survival):
            self.survival = list(c.survival)
        else:
            self.survival = [p + self.weight * (s - p) for p, s in zip(self.survival, c.survival)]


def batch_width(controllers: list[WidthController], costs: dict[int, float]) -> int:
    """One verify width for slots that step together: the width with the most expected tokens over all of them per
    unit of the batch's step cost at that width (`costs`: relative to the batch's plain step, measured at that
    batch size). Width 1 where nothing pays: the slots then decode plain, batched."""
    return max(sorted(costs), key=lambda w: sum(c.expected_tokens(w) for c in controllers) / costs[w])


def candidate_widths(block: int, graphs: bool) -> list[int]:
    """Plain and full width with CUDA graphs (a verify step costs about a decode step there, and every width
    is a graph per context bucket); powers of two up to the block on the CPU, where cost grows with width."""
    widths = {1, block} if graphs else {1, block} | {w for w in (2, 4, 8) if w < block}
    return sorted(widths)


def measure_costs(run_width: Callable[[int], None], widths: list[int], sync: Callable[[], None],
                  repeats: int = 3) -> dict[int, float]:
    """Each width's step time (best of `repeats` after one warm-up run) relative to width 1's."""
    seconds = {}
    for w in widths:
        run_width(w)
        sync()
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            run_width(w)
            sync()
            best = min(best, time.perf_counter() - t)
        seconds[w] = best
    return {w: seconds[w] / seconds[1] for w in widths}
