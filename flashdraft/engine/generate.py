"""A request's decode in its cache slot as data (`SlotState`) and the functions that step it: read the prompt
(open_slot, prefill_slice, first_token), plan the next step, run it (step_plain, step_speculative; engine.Engine runs
several slots' steps as one call and hands each slot its rows: advance_plain, advance_speculative), hand out the
committed tokens. `decode` steps one slot alone (tensor parallelism, training data).

Target K/V beyond the committed length are stale and ignored (the cache is indexed by position), and a recurrent
layer keeps its state at a verify block's start and the block's inputs (layers/kv_cache.RecurrentCache), so rejected
draft tokens roll back by length alone. The drafter (draft/interface.Drafter) only ever observes committed positions,
so it never rolls back.
"""
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from flashdraft.engine.adaptive import WidthController
from flashdraft.engine.sampling import SamplingParams, check_sampled, fresh_seed, token_logprobs
from flashdraft.engine.steps import SLICE_WIDTH, Steps

if TYPE_CHECKING:
    from flashdraft.draft.interface import HostGate
    from flashdraft.engine.grammar import Constraint

PREFILL_CHUNK = 1024


@dataclass
class SpecStats:
    block_size: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)  # a + 1 per verify step (bonus included)
    draft_steps: list[list[int]] = field(default_factory=list)  # tokens proposed at each verify step
    accepted_per_position: list[int] = field(default_factory=list)  # [k] = steps whose draft token k+1 was accepted
    plain_steps: int = 0  # steps of one token the adaptive width took in between (the drafter following)
    # by the drafter that proposed each verify step (a chain's member; else the one drafter): tokens drafted, accepted
    drafted_by: dict[str, int] = field(default_factory=dict)
    accepted_by: dict[str, int] = field(default_factory=dict)

    @property
    def draft_n(self) -> int:
        return sum(len(d) for d in self.draft_steps)

    @property
    def draft_n_accepted(self) -> int:
        return sum(a - 1 for a in self.acceptance_lengths)

    def record(self, proposed: list[int], accepted: int, source: str | None = None) -> None:
        if source is not None:
            self.drafted_by[source] = self.drafted_by.get(source, 0) + len(proposed)
            self.accepted_by[source] = self.accepted_by.get(source, 0) + accepted
        self.draft_steps.append(proposed)
        self.acceptance_lengths.append(accepted + 1)
        if len(self.accepted_per_position) < len(proposed):
            self.accepted_per_position += [0] * (len(proposed) - len(self.accepted_per_position))
        for k in range(accepted):
            self.accepted_per_position[k] += 1


# An acceptance rule maps (drafted tokens [n], target logits [n+1, V], the params, the target's own tokens sampled
# at every row [n+1]) to (number accepted, next token).
AcceptRule = Callable[[Tensor, Tensor, SamplingParams, Tensor], tuple[int, int]]


def accept_matching_samples(drafted: Tensor, logits: Tensor, params: SamplingParams,
                            posterior: Tensor) -> tuple[int, int]:
    """Accept drafts while they equal the target's own token sampled at their block position (`posterior`).
    Each emitted token is then a sample of the target's filtered distribution given the committed
    prefix, whatever the draft proposed: lossless for greedy and for sampling. The noise of a position's draw is
    keyed by (seed, position), so a verify row draws what a plain step at that position would draw: a seeded
    speculative answer is the seeded plain one, token for token, wherever the logits agree."""
    both = torch.cat([drafted, posterior]).tolist()  # the one host synchronisation of a verify step
    proposed, target_tokens = both[:len(drafted)], both[len(drafted):]
    accepted = next((i for i, (d, t) in enumerate(zip(proposed, target_tokens)) if d != t), len(proposed))
    check_sampled(target_tokens[accepted:accepted + 1])  # the rows before equal drafted ids; the ones after don't count
    return accepted, target_tokens[accepted]


def prefill(target, state, prompt_ids: Tensor, slot: int, cached: int = 0, draft=None, end: int | None = None,
            chunk: int = PREFILL_CHUNK) -> Tensor:
    """Run the prompt from position `cached` on (the cache holds the K/V before it) to `end` (default: its end)
    through the target in chunks; returns the last logits [1, V]. With a drafter, it observes each chunk (its tokens,
    and the features of its target layers) for `slot` as the chunk ends, so a long prompt's features (16k positions
    x 6 layers of a 31B: 1 GB) are never held at once."""
    capture = draft.target_layers if draft is not None else ()
    end = len(prompt_ids) if end is None else end
    for start in range(cached, end, chunk):
        part = prompt_ids[start:min(start + chunk, end)]
        positions = torch.arange(start, start + len(part), device=prompt_ids.device)
        logits, feats = target(part[None], positions[None], state, slot, capture=capture,
                               attn_len=start + len(part), logits_at="last", fresh=start == 0, eager=True)
        if draft is not None:
            draft.observe(part[None], feats, positions[None], slot)
    return logits[0]


class FollowBuffer:
    """Plain steps on their way to the drafter: a plain step taken while the drafter follows (the adaptive width
    at 1) leaves its token and features row here, and the rows go to the drafter `block` at a time, or before the
    next speculative step or the end, whichever comes first. One observation of many rows reads the drafter's
    context weights once (the Gemma 4 31B DFlash draft's: ~150 MB) where one per token read them every step.
    Tokens and rows stay on the device: adding one never waits for the GPU."""

    def __init__(self, steps: Steps, slot: int, block: int, device: torch.device):
        self.steps, self.slot, self.block, self.device = steps, slot, block, device
        self.rows: Tensor | None = None
        self.ids = torch.zeros(block, dtype=torch.long, device=device)
        self.held = 0
        self.first = 0  # the rows held are positions first, first + 1, ... (plain steps in a row)

    def add(self, token: Tensor, features: Tensor | None, pos: int) -> None:
        """`token` [1] at position `pos` (the next after the rows held) and its features [1, width] (None: the
        drafter reads no target layers)."""
        if not self.held:
            self.first = pos
        if features is not None:
            if self.rows is None:
                self.rows = features.new_empty(self.block, features.shape[-1])
            # the graph's output buffer: overwritten by its next replay
            self.rows[self.held].copy_(features.reshape(-1))
        self.ids[self.held:self.held + 1].copy_(token)
        self.held += 1
        if self.held == self.block:
            self.flush()

    def flush(self) -> None:
        if held := self.held:
            positions = self.steps.positions(self.first, held)
            self.steps.observe(self.slot, self.ids[:held], None if self.rows is None else self.rows[:held], positions)
            self.held = 0


class PendingToken:
    """A plain step's sampled token [1] on its way to the host: copied into `landing` (pinned memory, [1]) behind
    `event`, so reading it waits for its own step only, not for the step queued after it. On the CPU (no event) it
    is there already."""

    def __init__(self, token: Tensor, landing: Tensor, event: "torch.cuda.Event | None"):
        self.host, self.event = landing, event
        landing.copy_(token, non_blocking=event is not None)
        if event is not None:
            event.record()

    def read(self) -> int:
        if self.event is not None:
            self.event.synchronize()
        return int(self.host[0])


@dataclass
class SlotState:
    """One request's decode in its cache slot between steps: what a step needs to plan, run and commit the next
    tokens (engine.Engine.step runs one step over every active slot's state)."""
    slot: int
    prompt: Tensor  # [n] on the device
    params: SamplingParams
    budget: int  # output tokens wanted (within the context)
    max_len: int
    speculative: bool  # the drafter follows and proposes (a drafter is loaded and the request speculates)
    block: int  # the drafter's block (1 without one)
    seed: int | None
    stats: SpecStats | None = None
    controller: WidthController | None = None
    logprobs: list | None = None
    constraint: "Constraint | None" = None
    max_width: int | None = None
    accept_rule: AcceptRule = accept_matching_samples
    prefilled: int = 0  # prompt tokens in the cache so far
    pos: int = 0  # position of `token`: committed, not yet in the target cache
    token: int = 0  # the last committed token on the host, once read ...
    token_t: Tensor | None = None  # ... and on the device
    produced: int = 0
    pending: PendingToken | None = None  # token_t on its way to the host (not yet counted in `produced`)
    following: FollowBuffer | None = None
    gate: "HostGate | None" = None  # the drafter's host-side gate (draft/interface.Drafter.host_gate)
    landings: list = field(default_factory=list)

    @property
    def overlap(self) -> bool:
        """A plain step's token is read after the next step is queued (the host's work on it overlaps the GPU's),
        unless the host must see each token or its rows first: a grammar masks the next rows by it, logprobs read
        the rows."""
        return self.constraint is None and self.logprobs is None

    @property
    def done(self) -> bool:
        return self.produced >= self.budget

    def taken(self, new: list[int]) -> list[int]:
        new = new[:self.budget - self.produced]
        self.produced += len(new)
        self.token = new[-1]
        if self.gate is not None:
            self.gate.add(new)
        return new

    def choose(self, steps: Steps, rows: Tensor, positions: Tensor,
               drafted: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(rows as the grammar masks them, the token drawn for each: engine/steps.Steps.sample)."""
        if self.constraint is not None:
            rows = self.constraint.apply(rows, [] if drafted is None else drafted.tolist())
        return rows, steps.sample(self.slot, rows, positions, drafted, commit=drafted is None)

    def report(self, rows: Tensor, tokens: list[int]) -> None:
        if self.constraint is not None:
            self.constraint.commit(tokens)
        if self.logprobs is not None and self.params.logprobs is not None:
            self.logprobs.extend(token_logprobs(rows[:len(tokens)], tokens, self.params.logprobs))


@dataclass(frozen=True)
class StepPlan:
    """What a slot's next step runs: `width` 1 is a plain step (`follow`: the drafter observes it), more a
    speculative one checking that many rows of the block (`live`: rows that hold wanted tokens)."""
    width: int
    live: int
    room: int  # positions left in the context
    attn_len: int
    follow: bool = False


def open_slot(steps: Steps, s: SlotState, cached: int = 0) -> None:
    """Start the request in its slot, whose cache (and the drafter's state) hold the first `cached` prompt tokens."""
    n = len(s.prompt)
    if not 0 <= cached < n:
        raise ValueError(f"cached {cached} of a {n}-token prompt: the last prompt token must run")
    if s.speculative:
        steps.draft.reset(s.slot, keep=cached)
    steps.state.resume(s.slot, cached)
    s.prefilled = cached


def prefill_slice(steps: Steps, s: SlotState, most: int = PREFILL_CHUNK, beside: bool = False) -> Tensor | None:
    """Run up to `most` more prompt tokens; the last prompt position's logits [1, V] once the prompt is in. `beside`
    other slots' steps, through the slice graph (`read_in_slices`) where every cache is by position (a recurrent
    state goes back only within a verify block: its slices run eagerly)."""
    n = len(s.prompt)
    end = min(n, s.prefilled + most)
    if beside and steps.state.by_position:
        logits = read_in_slices(steps, s, end)
    else:
        logits = read_eagerly(steps, s, end, min(most, PREFILL_CHUNK))
    if s.prefilled < n:
        return None
    steps.state.checkpoint(s.slot, n)  # a recurrent state after the prompt, for a next turn that shares only it
    return logits


def read_eagerly(steps: Steps, s: SlotState, end: int, chunk: int) -> Tensor:
    """The prompt from s.prefilled to `end` in eager passes of `chunk` tokens (the drafter observing where the slot
    speculates): the last position's logits [1, V]."""
    logits = prefill(steps.target, steps.state, s.prompt, s.slot, s.prefilled, steps.draft if s.speculative else None,
                     end, chunk)
    s.prefilled = end
    return logits


def read_in_slices(steps: Steps, s: SlotState, end: int) -> Tensor | None:
    """The prompt from s.prefilled to about `end` through steps.prompt_slice, SLICE_WIDTH tokens a graph replay (an
    eager pass of a large target costs its thousands of launches, whatever its length): whole slices past `end`
    where the prompt goes on, and its last slice padded past its end (the rows past it are stale, as a rejected
    draft's; caches by position only), or where that passes the context, the rest in an eager pass. The prompt's
    last logits [1, V] once it is in."""
    n, slot, width = len(s.prompt), s.slot, SLICE_WIDTH
    logits = None
    while s.prefilled < min(n, end):
        start = s.prefilled
        piece = s.prompt[start:start + width]
        real = len(piece)
        if real < width and start + width > steps.state.max_len:
            return read_eagerly(steps, s, n, width)
        if real < width:
            piece = torch.cat([piece, piece.new_zeros(width - real)])
        rows, features = steps.prompt_slice(slot, piece, start, follow=s.speculative and bool(steps.capture))
        if s.speculative:
            steps.observe(slot, piece[:real], None if features is None else features[:real],
                          steps.positions(start, real))
        s.prefilled = start + real
        logits = rows[real - 1:real]
    return None if logits is None else logits.clone()  # the graph's buffer: the next slice overwrites it


def first_token(steps: Steps, s: SlotState, logits: Tensor, generator: torch.Generator | None = None) -> list[int]:
    """Draw the first output token from the prompt's last logits [1, V] (returned, already counted)."""
    n = len(s.prompt)
    if s.seed is None and not s.params.greedy:
        s.seed = fresh_seed() if generator is None else int(torch.randint(0, 2 ** 62, (), generator=generator,
                                                                           device=generator.device))
    steps.sampler(s.slot, logits.shape[-1]).begin(s.params, s.seed or 0, s.prompt)
    device = s.prompt.device
    first = s.choose(steps, logits, torch.full((1,), n - 1, device=device))[1]
    s.token_t = first.clone()  # the sampler's buffer is reused
    s.token = int(first[0])
    check_sampled([s.token])
    if s.gate is not None:
        s.gate.add([s.token])
    s.report(logits, [s.token])
    s.produced, s.pos = 1, n
    if s.stats is not None:
        s.stats.block_size = s.block
    s.following = FollowBuffer(steps, s.slot, s.block, device)
    # two landing places (and their events): one being read while the next step's token is copied to the other
    s.landings = [(torch.empty(1, dtype=torch.long, pin_memory=s.token_t.is_cuda),
                   torch.cuda.Event() if s.token_t.is_cuda else None) for _ in range(2)]
    return [s.token]


def begin(steps: Steps, s: SlotState, cached: int = 0, generator: torch.Generator | None = None) -> list[int]:
    """Prefill the slot's prompt from `cached` on and draw its first token (returned, already counted)."""
    open_slot(steps, s, cached)
    return first_token(steps, s, prefill_slice(steps, s, len(s.prompt)), generator)


def plan(steps: Steps, s: SlotState, want: int | None = None) -> StepPlan | list[int]:
    """The slot's next step, or the tokens it hands out first without one (a plain step's token the host had not
    read, which a verify block anchors on, or the last one wanted). `want`: the width the engine chose for a batch
    of slots (default: the slot's width controller's, else its block where its drafter's gate is open or it has
    none, else 1)."""
    queued = s.pending is not None
    # As z-lab's loop, a block covers at most the tokens still wanted plus the anchor (`live`). The draft still runs
    # the full block, with the rows past `live` hidden, so the same CUDA graph serves the last steps; only the
    # context's end shrinks the block itself.
    room = s.max_len - s.pos
    live = min(s.block, s.budget - s.produced - queued + 1, room)
    if want is None:
        want = (s.controller.width() if s.controller is not None
                else s.block if s.gate is None or s.gate.open(s.block) else 1)
    width = min(want, s.max_width or s.block, room)
    if not steps.static:  # no captured shape to keep: verify no row past the wanted tokens
        width = min(width, live)
    if queued and (width > 1 or s.produced + 1 >= s.budget):
        new = [s.pending.read()]
        check_sampled(new)
        s.pending = None
        return s.taken(new)
    attn_len = steps.attended(s.pos + width)  # static shapes: the whole bucket, masked by position
    if width <= 1:
        return StepPlan(1, live, room, attn_len, follow=s.speculative and room > 1)
    return StepPlan(width, live, room, attn_len)


def advance_plain(steps: Steps, s: SlotState, p: StepPlan, logits: Tensor, features: Tensor | None,
                  positions: Tensor) -> list[int]:
    """After a plain step of the slot (its logits [1, V], features [1, F] when the drafter follows): the tokens
    it hands out (none while its token is on its way to the host)."""
    sampled = s.choose(steps, logits, positions)[1]
    if p.follow:
        s.following.add(s.token_t, features, s.pos)
        if s.controller is not None:
            s.controller.record(1, 0)
        if s.stats is not None:
            s.stats.plain_steps += 1
    s.pos += 1
    s.token_t = sampled.clone()
    if s.overlap:
        ahead, s.pending = s.pending, PendingToken(sampled, *s.landings[s.pos % 2])
        if ahead is None:
            return []
        new = [ahead.read()]
        check_sampled(new)
        return s.taken(new)
    new = [int(sampled[0])]
    check_sampled(new)
    s.report(logits, new[:s.budget - s.produced])
    return s.taken(new)


def step_plain(steps: Steps, s: SlotState, p: StepPlan) -> list[int]:
    positions = steps.positions(s.pos)
    out = steps.plain(s.slot, s.token_t, positions, p.attn_len, p.follow)
    return advance_plain(steps, s, p, out[0], out[1] if p.follow else None, positions)


def step_speculative(steps: Steps, s: SlotState, p: StepPlan) -> list[int]:
    """As z-lab's loop: the draft block shrinks only where the output budget or the context ends."""
    device = s.prompt.device
    s.following.flush()  # the drafter proposes from every committed position
    positions = torch.arange(s.pos, s.pos + min(s.block, p.room), device=device)
    anchor, live_t = (torch.full((1,), n, device=device) for n in (s.token, p.live))  # fills, no copies
    ids, logits, feats = steps.speculative(s.slot, anchor, positions, live_t, p.attn_len, p.width, s.block)
    return advance_speculative(steps, s, p, ids, logits, feats, positions)


def advance_speculative(steps: Steps, s: SlotState, p: StepPlan, ids: Tensor, logits: Tensor,
                        features: Tensor | None, positions: Tensor) -> list[int]:
    """After a speculative step of the slot (the anchor and proposals `ids` [width], their logits [width, V] and
    features [width, F] at `positions` [block]): accept, commit, hand the drafter the committed rows; the tokens
    it hands out."""
    checked = min(p.width, p.live)  # rows past `live` hold no wanted token: they neither count nor commit
    drafted, logits = ids[1:checked], logits[:checked]
    rows, posterior = s.choose(steps, logits, positions[:checked], drafted)
    accepted, bonus = s.accept_rule(drafted, rows, s.params, posterior)
    proposed = drafted.tolist()
    if s.stats is not None:
        s.stats.record(proposed, accepted, steps.proposed_by(s.slot))
    if s.controller is not None:
        s.controller.record(p.width, accepted)
    if s.gate is not None:
        s.gate.record(accepted)
    n_new = accepted + 1
    steps.state.commit(s.slot, s.pos + n_new)
    steps.observe(s.slot, ids[:n_new], None if features is None else features[:n_new], positions[:n_new])
    new = proposed[:accepted] + [bonus]
    steps.samplers[s.slot].commit(new, s.pos + 1)
    s.report(logits, new[:s.budget - s.produced])
    s.pos += n_new
    s.token_t = torch.full((1,), new[-1], device=s.prompt.device)
    return s.taken(new)


def step(steps: Steps, s: SlotState) -> list[int]:
    """One step of one slot: the tokens it commits and hands out (possibly none)."""
    p = plan(steps, s)
    if isinstance(p, list):
        return p
    return step_plain(steps, s, p) if p.width <= 1 else step_speculative(steps, s, p)


def finish(s: SlotState) -> None:
    """The slot's request ends (done, stopped or closed): the drafter holds every committed position, as the
    slot's prompt cache records."""
    if s.following is not None:
        s.following.flush()


def new_slot_state(steps: Steps, prompt_ids: Tensor, params: SamplingParams, slot: int = 0, speculative: bool = True,
                   block_size: int | None = None, stats: SpecStats | None = None, max_len: int | None = None,
                   accept_rule: AcceptRule = accept_matching_samples, controller: WidthController | None = None,
                   logprobs: list | None = None, constraint: "Constraint | None" = None, seed: int | None = None,
                   max_width: int | None = None, gate: "HostGate | None" = None) -> SlotState:
    """A request's state in `slot`, checked against the context (see `decode`)."""
    draft = steps.draft if speculative else None
    max_len = max_len or steps.state.max_len
    n = len(prompt_ids)
    if n >= max_len:
        raise ValueError(f"the prompt has {n} tokens, which does not fit the context of {max_len} tokens")
    block = (block_size or draft.block_size) if draft is not None else 1
    return SlotState(slot, prompt_ids, params, min(params.max_tokens, max_len - n), max_len, draft is not None, block,
                     seed, stats, controller, logprobs, constraint, max_width, accept_rule, gate=gate)


@torch.inference_mode()
def decode(steps: Steps, prompt_ids: Tensor, params: SamplingParams, slot: int = 0, speculative: bool = True,
           block_size: int | None = None, stats: SpecStats | None = None, max_len: int | None = None,
           generator: torch.Generator | None = None, accept_rule: AcceptRule = accept_matching_samples,
           controller: WidthController | None = None, logprobs: list | None = None,
           cached: int = 0, constraint: "Constraint | None" = None, seed: int | None = None,
           max_width: int | None = None) -> Iterator[list[int]]:
    """Yield the committed tokens of each step until `params.max_tokens` are out (the caller stops
    earlier on EOS or stop strings by closing the generator). With a drafter (and `speculative`), each step
    drafts a whole block and verifies `controller.width()` of it (default: all); width 1 is a plain step that
    the drafter still observes. logit_bias and the penalties apply to every verified row with
    that row's own prefix, so speculation stays lossless under them. With `params.logprobs` set, `logprobs`
    receives one sampling.token_logprobs entry per committed token, before the tokens are yielded. `cached`: the
    slot's cache (and the drafter's state) already hold the first `cached` prompt tokens (a prompt cache hit).
    `constraint` (engine/grammar.py) masks every verified row with the grammar's state after that row's own
    prefix, so a constrained answer stays lossless too. A sampled token's noise is keyed by (`seed`, its position,
    its id) (engine/sampling.race): the same seed gives the same answer, plain or speculative; without a seed, one
    is drawn from `generator` (a reproducible series of requests), else at random. `max_width`: no verify step
    checks more rows than this (the anchor included). One slot's steps in turn: engine.Engine.step runs the same
    steps over every active slot."""
    s = new_slot_state(steps, prompt_ids, params, slot, speculative, block_size, stats, max_len, accept_rule,
                       controller, logprobs, constraint, seed, max_width)
    yield from run_slot(steps, s, cached, generator)


def run_slot(steps: Steps, s: SlotState, cached: int = 0,
             generator: torch.Generator | None = None) -> Iterator[list[int]]:
    """The slot's steps one after another, yielding the tokens each hands out (see `decode`)."""
    if s.budget <= 0:
        return
    yield begin(steps, s, cached, generator)
    try:
        while not s.done:
            if new := step(steps, s):
                yield new
    finally:
        finish(s)
