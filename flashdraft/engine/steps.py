"""The decode loop's steps: what each kind computes, its static shape, its CUDA graph key, and the list of keys
warm-up captures, in one place (so warm-up cannot miss a key that decoding uses).

A step attends over a fixed number of cache rows (a bucket: the next power of two that covers the needed
length), so one graph serves every position inside its bucket, and attention never reads rows past the bucket.
Kinds: a plain step (one token; with `follow` it also captures the drafter's features), a speculative step (the
drafter proposes after its anchor, the target verifies the first `width` tokens), a prompt's slice read beside
other slots' steps, the drafter's observation of n committed rows, and the sampler (engine/sampling.DeviceSampler:
a token per row of logits; one graph per SamplerKey). The drafter is read through draft/interface.Drafter only.
"""
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import Tensor

from flashdraft.engine.graphs import GraphCache
from flashdraft.layers.attention import reads_by_position
from flashdraft.layers.kv_cache import KVCache
from flashdraft.engine.sampling import DeviceSampler

MIN_BUCKET = 256
SLICE_WIDTH = 16  # prompt tokens a slice graph reads (engine/generate.prefill_slice): the mma kernels' 16 rows


def bucket_for(length: int, max_len: int) -> int:
    b = MIN_BUCKET
    while b < length:
        b *= 2
    return min(b, max_len)


@dataclass(frozen=True)
class PlainKey:
    slot: int
    bucket: int
    follow: bool


@dataclass(frozen=True)
class SpecKey:
    slot: int
    bucket: int
    block: int
    width: int


@dataclass(frozen=True)
class BatchKey:
    """A plain step of `rows` slots in one target call (the slots an input: one graph serves any of them; `rows`
    padded, Steps.padded_rows)."""
    rows: int
    bucket: int
    follow: bool


@dataclass(frozen=True)
class SpecBatchKey:
    """A speculative step of `rows` slots in one call: the drafter proposes for each, the target verifies `width`
    rows of every slot at once. The slots are an input where the drafter takes them as tensors
    (Drafter.slot_tensors); else the graph is the slot combination's (`slots`)."""
    rows: int
    slots: tuple[int, ...] | None
    block: int
    width: int


@dataclass(frozen=True)
class SliceKey:
    """`width` tokens of a prompt over the cache, read while other slots decode (the slot an input)."""
    width: int
    bucket: int
    follow: bool


@dataclass(frozen=True)
class ContextKey:
    slot: int | None  # None: the slot is an input (Drafter.slot_tensors)
    rows: int


def plain_step(target, state, token: Tensor, pos: Tensor, slot: int, attn_len: int,
               capture: tuple[int, ...] | None = None) -> tuple[Tensor | None, ...]:
    """One token [1] through the target: (logits [1, V],), or (logits, features [1, L*H] or None) when a drafter
    follows along (`capture`: its target layers), which needs every committed position. The token may be a sampler's
    failure flag (-1), queued before the host reads it (engine/generate.PendingToken): it runs as token 0, and the
    step's output is never used."""
    logits, feats = target(token.clamp(min=0)[None], pos[None], state, slot, attn_len=attn_len, capture=capture or ())
    return (logits[0],) if capture is None else (logits[0], None if feats is None else feats[0])


def speculative_step(target, state, draft, anchor: Tensor, positions: Tensor, slot: int, attn_len: int,
                     verify: int | None = None, live: Tensor | None = None, context_rows: int | None = None):
    """The drafter proposes after `anchor` [1] for the block of `positions` (the anchor's first), then the target
    verifies the anchor and the first `verify` - 1 proposals (default: the whole block). A block drafter fills
    the whole block whatever `verify` (its first `live` rows), so a narrower verify checks the same proposals;
    it reads `context_rows` of its context (default attn_len: the rows past the bucket hold none yet). Returns
    (checked [verify]: the anchor and the proposals, logits [verify, V], features [verify, L*H] or None)."""
    verify = verify or len(positions)
    drafted = draft.propose(target, anchor, positions[:1], slot, verify - 1, live, len(positions),
                            context_rows or attn_len)
    checked = torch.cat([anchor, drafted[0]])
    logits, feats = target(checked[None], positions[None, :verify], state, slot, capture=draft.target_layers,
                           attn_len=attn_len)
    return checked, logits[0], None if feats is None else feats[0]


class Steps:
    """Runs the decode loop's steps for one target (and draft) over their state; on CUDA each key is captured
    once as a graph and replayed. `static`: steps attend over whole buckets (CUDA graphs); elsewhere over the
    exact length. `whole_cache`: every cache the target attends through the split kernel by position
    (layers/attention.reads_by_position), which splits the keys by the last position's bucket at run time, so the
    target's part of a step attends over the whole cache and one graph serves every bucket (the draft's context
    read stays bounded by the bucket: speculative steps keep a key per bucket)."""

    def __init__(self, target, state, draft=None, device: str = "cpu", n_slots: int = 1):
        self.target, self.state, self.draft, self.n_slots = target, state, draft, n_slots
        self.capture = tuple(draft.target_layers) if draft is not None else ()  # read once
        self.slot_inputs = getattr(draft, "slot_tensors", False)  # batched drafter steps take the slots as input
        if draft is not None:  # a verify step may be cut back to any of its lengths
            state.allow_rollback(draft.block_size)
        if hasattr(draft, "read_target_state"):  # a drafter attending over the target's caches
            draft.read_target_state(state)
        self.graphs = GraphCache(device)
        self.static = self.graphs.captures
        self.device = device
        self.whole_cache = self.static and all(reads_by_position(c, True) for c in state.layers
                                               if isinstance(c, KVCache) and not c.window)
        self.samplers: dict[int, DeviceSampler] = {}
        self.position_table: Tensor | None = None
        self.slot_tensors: dict[tuple[int, ...], Tensor] = {}
        self.sample_inputs: tuple[Tensor, Tensor, Tensor] | None = None  # the sampler graphs' inputs (`sample`)

    def positions(self, start: int, n: int = 1) -> Tensor:
        """Positions start, ..., start + n - 1 [n] on the device as a view of one table: no host-to-device copy,
        which would wait for every step queued before it."""
        if self.position_table is None:
            self.position_table = torch.arange(self.state.max_len, device=self.device)
        return self.position_table[start:start + n]

    def attended(self, length: int) -> int:
        return bucket_for(length, self.state.max_len) if self.static else length

    def target_length(self, attn_len: int) -> int:
        """The length the target's attention is launched over for a step of bucket attn_len."""
        return self.state.max_len if self.whole_cache else attn_len

    def plain(self, slot: int, token: Tensor, pos: Tensor, attn_len: int, follow: bool) -> tuple[Tensor | None, ...]:
        capture = self.capture if follow else None
        attn_len = self.target_length(attn_len)

        def step(t, p):
            return plain_step(self.target, self.state, t, p, slot, attn_len, capture)

        return self.graphs.run(PlainKey(slot, attn_len, follow), step, [token, pos])

    def padded_rows(self, rows: int) -> int:
        """The rows a plain step of `rows` slots runs: the next power of two, at most the slots (a graph per padded
        size, as nano-vllm captures them: 2, 4, 8 at -np 8, not 2..8), where every cache is by position (a padded
        row repeats the last one, which writes the same keys and values to the same rows again); else `rows`."""
        if rows <= 2 or not self.state.by_position:
            return rows
        return min(1 << (rows - 1).bit_length(), max(self.n_slots, rows))

    def plain_batch(self, states: list, attn_len: int, follow: bool) -> tuple[Tensor, Tensor | None, Tensor]:
        """One plain step of several slots (engine/generate.SlotState: each its last token at its position) in one
        target call: (logits [B, V], features [B, F] when `follow`, the positions [B])."""
        rows = len(states)
        states = states + states[-1:] * (self.padded_rows(rows) - rows)
        tokens = torch.cat([s.token_t for s in states])
        positions = torch.cat([self.positions(s.pos) for s in states])
        slots = self.slot_index(tuple(s.slot for s in states))
        capture = self.capture if follow else ()
        attn_len = self.target_length(attn_len)

        def step(t, p, rows):
            logits, feats = self.target(t.clamp(min=0)[:, None], p[:, None], self.state, rows, attn_len=attn_len,
                                        capture=capture)
            return logits[:, 0], None if feats is None else feats[:, 0]

        logits, feats = self.graphs.run(BatchKey(len(states), attn_len, follow), step, [tokens, positions, slots])
        return logits[:rows], feats[:rows] if follow else None, positions[:rows]

    def speculative_batch(self, states: list, lives: list[int], width: int,
                          block: int) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
        """One speculative step of several slots (each a full block ahead of it in the context), the target
        verifying `width` rows of each in one call (`lives`: each block's rows that hold wanted tokens): (ids
        [B, width]: anchors and proposals, logits [B, width, V], features [B, width, F] or None, positions
        [B, block]). The drafter reads its whole context window (one graph for every length)."""
        dev = self.device
        anchors = torch.cat([torch.full((1,), s.token, device=dev) for s in states])  # fills, no copies
        live = torch.cat([torch.full((1,), n, device=dev) for n in lives])
        positions = torch.stack([self.positions(s.pos, block) for s in states])
        slots = tuple(s.slot for s in states)
        key = self.spec_batch_key(slots, block, width)
        attn_len = self.target_length(self.state.max_len)

        def step(a, p, n, rows):
            drafted = torch.cat([self.draft.propose(self.target, a[i:i + 1], p[i, :1],
                                                    rows[i:i + 1] if key.slots is None else key.slots[i], width - 1,
                                                    n[i:i + 1], block, self.state.max_len) for i in range(key.rows)])
            checked = torch.cat([a[:, None], drafted], dim=1)
            logits, feats = self.target(checked, p[:, :width], self.state, rows, capture=self.draft.target_layers,
                                        attn_len=attn_len)
            return checked, logits, feats

        ids, logits, feats = self.graphs.run(key, step, [anchors, positions, live, self.slot_index(slots)])
        return ids, logits, feats, positions

    def prompt_slice(self, slot: int, ids: Tensor, start: int, follow: bool) -> tuple[Tensor, Tensor | None]:
        """SLICE_WIDTH prompt tokens ids at positions start, ... over the slot's cache (a graph, its slot an input: a
        slice costs about a verify step, where an eager pass of the target costs its launches): (logits
        [SLICE_WIDTH, V], features [SLICE_WIDTH, F] when `follow`)."""
        positions = self.positions(start, len(ids))
        attn_len = self.target_length(self.attended(start + len(ids)))
        capture = self.capture if follow else ()

        def step(t, p, rows):
            logits, feats = self.target(t[None], p[None], self.state, rows, attn_len=attn_len, capture=capture)
            return logits[0], None if feats is None else feats[0]

        logits, feats = self.graphs.run(SliceKey(len(ids), attn_len, follow), step,
                                        [ids, positions, self.slot_index((slot,))])
        return logits, feats if follow else None

    def spec_batch_key(self, slots: tuple[int, ...], block: int, width: int) -> SpecBatchKey:
        return SpecBatchKey(len(slots), None if self.slot_inputs else slots, block, width)

    def slot_index(self, slots: tuple[int, ...]) -> Tensor:
        """The slots as a [B] tensor on the device, made once per combination (no host-to-device copy per step)."""
        if slots not in self.slot_tensors:
            self.slot_tensors[slots] = torch.tensor(slots, dtype=torch.long, device=self.device)
        return self.slot_tensors[slots]

    def speculative(self, slot: int, anchor: Tensor, positions: Tensor, live: Tensor, attn_len: int,
                    width: int, block: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """positions: the block's. A block shorter than the engine's `block` (the context's end) runs eagerly: no
        graph for that shape."""
        def step(a, p, n):
            return speculative_step(self.target, self.state, self.draft, a, p, slot, self.target_length(attn_len),
                                    width, n, context_rows=attn_len)

        if len(positions) != block:
            return step(anchor, positions, live)
        return self.graphs.run(SpecKey(slot, attn_len, block, width), step, [anchor, positions, live])

    def proposed_by(self, slot: int) -> str | None:
        """The name of the drafter that proposed the slot's last verify step: a chain's member that did
        (`proposed_by`, read after the step), else the drafter's own."""
        if self.draft is None:
            return None
        by = getattr(self.draft, "proposed_by", None)
        return by(slot) if by is not None else self.draft.name

    def observe(self, slot: int, tokens: Tensor, features: Tensor | None, positions: Tensor) -> None:
        """Hand the drafter the tokens [n] (and features [n, L*H]) of newly committed positions [n] (a graph per
        row count up to the drafter's block on CUDA, the counts warm-up captures; more rows, a prompt's slice
        beside a smaller block, eagerly)."""
        def step(t, p, at, *f):  # the slot an input (one graph for every slot), or the graph the slot's own
            return (self.draft.observe(t[None], f[0][None] if f else None, p[None], at if self.slot_inputs else slot),)

        inputs = [tokens, positions, self.slot_index((slot,))] + ([] if features is None else [features])
        if len(positions) > self.draft.block_size:
            step(*inputs)
            return
        self.graphs.run(ContextKey(None if self.slot_inputs else slot, len(positions)), step, inputs, pool="observe")

    def sampler(self, slot: int, vocab: int) -> DeviceSampler:
        """The slot's sampler (its state stays on the device, overwritten by each request: DeviceSampler.begin)."""
        if slot not in self.samplers:
            self.samplers[slot] = DeviceSampler(vocab, self.state.max_len, self.device)
        return self.samplers[slot]

    def sample(self, slot: int, logits: Tensor, positions: Tensor, drafted: Tensor | None = None,
               commit: bool = False) -> Tensor:
        """A token per row of logits [R, V] by the slot's sampler (row r's token goes to positions[r] + 1; drafted
        [R - 1]: the tokens rows 1.. follow; commit: a one-row call whose token commits, for the penalties' window).
        On CUDA one graph replay per call: the inputs go to buffers shared by every slot's graphs (the engine loop
        samples one slot at a time), and the tokens come back in the graph's own output buffer, which the next call
        of the same key overwrites."""
        sampler = self.samplers[slot]
        rows = logits.shape[0]
        key = sampler.key(slot, rows, commit)
        if not self.graphs.captures:
            return sampler(key, logits, positions, drafted)
        if self.sample_inputs is None:
            most = self.draft.block_size if self.draft is not None else 1
            self.sample_inputs = (torch.empty(most, logits.shape[-1], device=self.device),
                                  torch.zeros(most, dtype=torch.long, device=self.device),
                                  torch.zeros(max(most - 1, 1), dtype=torch.long, device=self.device))
        all_logits, all_positions, all_drafted = self.sample_inputs
        all_logits[:rows].copy_(logits)
        all_positions[:rows].copy_(positions)
        if key.penalized and rows > 1:
            all_drafted[:rows - 1].copy_(drafted)
        x, at, before = all_logits[:rows], all_positions[:rows], all_drafted[:rows - 1]
        return self.graphs.run(key, lambda: (sampler(key, x, at, before),), [], pool="sampler")[0]

    def warm_samplers(self, slots: range, params: list, rows: list[int]) -> None:
        """Run (on CUDA: capture) each slot's sampler for `params` at each of `rows` (1: a plain step or a first
        token; more: a verify block), so that a slot's first request pays for none of them (the sampler graphs are
        a slot's own, and a first token in a slot no request had used captured them while the other streams waited:
        most likely the 117 ms pause of three streams beside a 2000-token prompt, Gemma 4 31B shape, 2026-12-07
        H100)."""
        vocab = self.target.cfg.vocab_size
        for slot in slots:
            sampler = self.sampler(slot, vocab)
            for p in params:
                sampler.begin(p, 0, torch.zeros(1, dtype=torch.long, device=self.device))
                for n in rows:
                    drafted = torch.zeros(n - 1, dtype=torch.long, device=self.device) if n > 1 else None
                    self.sample(slot, torch.zeros(n, vocab, device=self.device),
                                torch.arange(n, device=self.device), drafted, commit=drafted is None)

    def warmup_keys(self, n_slots: int, block: int,
                    adaptive: bool) -> list[PlainKey | SpecKey | ContextKey | BatchKey | SliceKey]:
        """The keys the decode loop uses with this configuration (full-width verify; adaptive widths are captured
        as measure_width_costs times them). With a draft, plain steps that do not feed it (a request without
        speculation, the context's last position) are left to be captured on first use: the server's requests
        speculate, and each captured step costs start-up time (the Gemma 4 31B shape: 8 of its 40)."""
        max_len = self.state.max_len
        buckets = sorted({bucket_for(MIN_BUCKET * 2 ** i, max_len) for i in range(32) if MIN_BUCKET * 2 ** i < max_len * 2})
        keys: list[PlainKey | SpecKey | ContextKey | BatchKey | SliceKey] = []
        for slot in range(n_slots):
            for b in buckets:
                plain_bucket = self.target_length(b)  # one for every bucket with whole_cache
                if self.draft is None:
                    keys.append(PlainKey(slot, plain_bucket, False))
                if self.draft is not None and adaptive:
                    keys.append(PlainKey(slot, plain_bucket, True))
                if self.draft is not None and block > 1 and b >= block:
                    keys.append(SpecKey(slot, b, block, block))
            if self.draft is not None and block > 1:
                keys += [ContextKey(None if self.slot_inputs else slot, n) for n in range(1, block + 1)]
        for b in buckets:  # plain steps of several slots at once (a graph per batch size)
            follow = self.draft is not None
            if not follow or adaptive:
                keys += [BatchKey(rows, self.target_length(b), follow)
                         for rows in sorted({self.padded_rows(r) for r in range(2, n_slots + 1)})]
            if n_slots > 1 and self.state.by_position:  # a prompt read beside other slots' steps (prefill_slice)
                keys.append(SliceKey(SLICE_WIDTH, self.target_length(b), follow))
        return list(dict.fromkeys(keys))  # with whole_cache, the buckets' plain keys are one

    def run_key(self, key: PlainKey | SpecKey | ContextKey | BatchKey | SpecBatchKey | SliceKey) -> None:
        """Run (on CUDA: capture) one key's step on placeholder inputs."""
        dev = self.device
        if isinstance(key, SpecBatchKey):
            pos = max(0, min(64, self.state.max_len - key.block))
            states = [SimpleNamespace(token=0, pos=pos, slot=s) for s in key.slots or range(key.rows)]
            self.speculative_batch(states, [key.block] * len(states), key.width, key.block)
        elif isinstance(key, BatchKey):
            zero = torch.zeros(1, dtype=torch.long, device=dev)
            self.plain_batch([SimpleNamespace(token_t=zero, pos=0, slot=s) for s in range(key.rows)], key.bucket,
                             key.follow)
        elif isinstance(key, PlainKey):
            zero = torch.zeros(1, dtype=torch.long, device=dev)
            self.plain(key.slot, zero, zero.clone(), key.bucket, key.follow)
        elif isinstance(key, SliceKey):
            self.prompt_slice(0, torch.zeros(key.width, dtype=torch.long, device=dev),
                              max(0, min(64, key.bucket - key.width)), key.follow)
        elif isinstance(key, SpecKey):
            pos = max(0, min(64, key.bucket - key.block))
            self.speculative(key.slot, torch.zeros(1, dtype=torch.long, device=dev),
                             torch.arange(pos, pos + key.block, device=dev),
                             torch.tensor([key.block], device=dev), key.bucket, key.width, key.block)
        else:
            width = len(self.capture) * self.target.cfg.hidden_size
            feats = torch.zeros(key.rows, width, dtype=self.target.dtype, device=dev) if self.capture else None
            self.observe(key.slot or 0, torch.zeros(key.rows, dtype=torch.long, device=dev), feats,
                         torch.arange(key.rows, device=dev))
