"""Plain and speculative decode loops on one cache slot, over the steps of engine/steps.py.

Both loops yield the tokens each step commits. Target K/V beyond the committed length are stale and
ignored (the cache is indexed by position), and a recurrent layer keeps its state after each token of a verify
block (layers/kv_cache.RecurrentCache), so rejected draft tokens roll back by length alone. The drafter
(draft/interface.Drafter) only ever observes committed positions, so it never rolls back.
"""
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from flashdraft.engine.adaptive import WidthController
from flashdraft.engine.sampling import SamplingParams, check_sampled, fresh_seed, token_logprobs
from flashdraft.engine.steps import Steps

if TYPE_CHECKING:
    from flashdraft.engine.grammar import Constraint

PREFILL_CHUNK = 1024


@dataclass
class SpecStats:
    block_size: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)  # a + 1 per verify step (bonus included)
    draft_steps: list[list[int]] = field(default_factory=list)  # tokens proposed at each verify step
    accepted_per_position: list[int] = field(default_factory=list)  # [k] = steps whose draft token k+1 was accepted
    plain_steps: int = 0  # steps of one token the adaptive width took in between (the drafter following)

    @property
    def draft_n(self) -> int:
        return sum(len(d) for d in self.draft_steps)

    @property
    def draft_n_accepted(self) -> int:
        return sum(a - 1 for a in self.acceptance_lengths)

    def record(self, proposed: list[int], accepted: int) -> None:
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


def prefill(target, state, prompt_ids: Tensor, slot: int, cached: int = 0, draft=None) -> Tensor:
    """Run the prompt from position `cached` on (the cache holds the K/V before it) through the target in chunks;
    returns the last logits [1, V]. With a drafter, it observes each chunk (its tokens, and the features of its
    target layers) for `slot` as the chunk ends, so a long prompt's features (16k positions x 6 layers of a 31B:
    1 GB) are never held at once."""
    capture = draft.target_layers if draft is not None else ()
    for start in range(cached, len(prompt_ids), PREFILL_CHUNK):
        chunk = prompt_ids[start:start + PREFILL_CHUNK]
        positions = torch.arange(start, start + len(chunk), device=prompt_ids.device)
        logits, feats = target(chunk[None], positions[None], state, slot, capture=capture,
                               attn_len=start + len(chunk), logits_at="last", fresh=start == 0)
        if draft is not None:
            draft.observe(chunk[None], feats, positions[None], slot)
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
    checks more rows than this (the anchor included)."""
    target, state = steps.target, steps.state
    draft = steps.draft if speculative else None
    device = prompt_ids.device
    max_len = max_len or state.max_len
    n = len(prompt_ids)
    if n >= max_len:
        raise ValueError(f"the prompt has {n} tokens, which does not fit the context of {max_len} tokens")
    budget = min(params.max_tokens, max_len - n)
    if budget <= 0:
        return
    if not 0 <= cached < n:
        raise ValueError(f"cached {cached} of a {n}-token prompt: the last prompt token must run")
    if draft is not None:
        draft.reset(slot, keep=cached)
    state.resume(slot, cached)
    logits = prefill(target, state, prompt_ids, slot, cached, draft)
    state.checkpoint(slot, n)  # a recurrent state after the prompt, for a next turn that shares only the prompt
    if seed is None and not params.greedy:
        seed = fresh_seed() if generator is None else int(torch.randint(0, 2 ** 62, (), generator=generator,
                                                                         device=generator.device))
    steps.sampler(slot, logits.shape[-1]).begin(params, seed or 0, prompt_ids)

    def choose(rows: Tensor, positions: Tensor, drafted: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(rows as the grammar masks them, the token drawn for each: engine/steps.Steps.sample)."""
        if constraint is not None:
            rows = constraint.apply(rows, [] if drafted is None else drafted.tolist())
        return rows, steps.sample(slot, rows, positions, drafted, commit=drafted is None)

    def report(rows: Tensor, tokens: list[int]) -> None:
        if constraint is not None:
            constraint.commit(tokens)
        if logprobs is not None and params.logprobs is not None:
            logprobs.extend(token_logprobs(rows[:len(tokens)], tokens, params.logprobs))

    first = choose(logits, torch.full((1,), n - 1, device=device))[1]
    token_t = first.clone()  # the last committed token on the device: the sampler's buffer is reused
    token = int(first[0])  # ... and on the host, once read
    check_sampled([token])
    report(logits, [token])
    yield [token]
    produced, pos = 1, n  # pos: position of `token`, committed but not yet in the target cache
    block = (block_size or draft.block_size) if draft is not None else 1
    if stats is not None:
        stats.block_size = block
    following = FollowBuffer(steps, slot, block, device)
    # A plain step's token is read after the next step is queued (the host's work on it overlaps the GPU's), unless
    # the host must see each token or its rows first: a grammar masks the next rows by it, logprobs read the rows.
    overlap = constraint is None and logprobs is None
    pending: PendingToken | None = None  # token_t on its way to the host (not yet counted in `produced`)
    # two landing places (and their events): one being read while the next step's token is copied to the other
    landings = [(torch.empty(1, dtype=torch.long, pin_memory=token_t.is_cuda),
                 torch.cuda.Event() if token_t.is_cuda else None) for _ in range(2)]

    def taken(new: list[int]) -> list[int]:
        nonlocal produced, token
        new = new[:budget - produced]
        produced += len(new)
        token = new[-1]
        return new

    try:
        while produced < budget:
            queued = pending is not None
            # As z-lab's loop, a block covers at most the tokens still wanted plus the anchor (`live`). The draft
            # still runs the full block, with the rows past `live` hidden, so the same CUDA graph serves the last
            # steps; only the context's end shrinks the block itself.
            room = max_len - pos
            live = min(block, budget - produced - queued + 1, room)
            width = min(controller.width() if controller is not None else block, max_width or block, room)
            if not steps.static:  # no captured shape to keep: verify no row past the wanted tokens
                width = min(width, live)
            if queued and (width > 1 or produced + 1 >= budget):  # a verify block anchors on the host's token
                new = [pending.read()]
                check_sampled(new)
                pending = None
                yield taken(new)
                continue
            attn_len = steps.attended(pos + width)  # static shapes: the whole bucket, masked by position
            if width <= 1:
                follow = draft is not None and room > 1  # the drafter observes every committed position
                positions = steps.positions(pos)
                out = steps.plain(slot, token_t, positions, attn_len, follow)
                sampled = choose(out[0], positions)[1]
                if follow:
                    following.add(token_t, out[1], pos)
                    if controller is not None:
                        controller.record(1, 0)
                    if stats is not None:
                        stats.plain_steps += 1
                pos += 1
                token_t = sampled.clone()
                if overlap:
                    ahead, pending = pending, PendingToken(sampled, *landings[pos % 2])
                    if ahead is not None:
                        new = [ahead.read()]
                        check_sampled(new)
                        yield taken(new)
                    continue
                new = [int(sampled[0])]
                check_sampled(new)
                report(out[0], new[:budget - produced])
            else:
                # As z-lab's loop: the draft block shrinks only where the output budget or the context ends.
                following.flush()  # the drafter proposes from every committed position
                positions = torch.arange(pos, pos + min(block, room), device=device)
                anchor, live_t = (torch.full((1,), n, device=device) for n in (token, live))  # fills, no copies
                ids, logits, feats = steps.speculative(slot, anchor, positions, live_t, attn_len, width, block)
                checked = min(width, live)  # rows past `live` hold no wanted token: they neither count nor commit
                drafted, logits = ids[1:checked], logits[:checked]
                rows, posterior = choose(logits, positions[:checked], drafted)
                accepted, bonus = accept_rule(drafted, rows, params, posterior)
                proposed = drafted.tolist()
                if stats is not None:
                    stats.record(proposed, accepted)
                if controller is not None:
                    controller.record(width, accepted)
                n_new = accepted + 1
                state.commit(slot, pos + n_new)
                steps.observe(slot, ids[:n_new], None if feats is None else feats[:n_new], positions[:n_new])
                new = proposed[:accepted] + [bonus]
                steps.samplers[slot].commit(new, pos + 1)
                report(logits, new[:budget - produced])
                pos += accepted + 1
                token_t = torch.full((1,), new[-1], device=device)
            yield taken(new)
    finally:
        following.flush()  # the drafter holds every committed position, as the slot's prompt cache records
