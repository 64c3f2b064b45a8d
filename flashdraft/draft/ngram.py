"""N-gram lookup drafter: no model, no target layers; it proposes what followed the last n tokens the last time they
occurred in the request's prompt and output (llama.cpp's `--spec-type ngram-mod`, and `ngram-simple`).

What it computes, for an anchor at position P (the last committed token; the positions before it are observed):
- the key is the n = `n_match` tokens ending at the anchor (the n - 1 committed before it, then the anchor);
- ngram-mod: the next token is the one that followed the key's latest earlier occurrence whose follower is
  committed (before P); the key then moves on by one token (dropping its first, adding the proposed one) and the
  lookup repeats, each time over the committed tokens only, up to `n_max` tokens or the first key never seen;
- ngram-simple: after the first lookup, the tokens that followed that occurrence are copied, as long as they are
  committed, up to `n_max`;
- a run shorter than `n_min` (at most n_max) proposes nothing. A step still verifies its whole width, so the
  positions past the run (all of them when nothing matched) hold the anchor repeated: cheap, nearly always
  rejected; with the adaptive width on, a step drafts only where the host's `LookupGate` expects a run, and is
  plain (feeding this drafter) elsewhere. Verifying stays lossless whatever is proposed.

What differs from llama.cpp (common/ngram-mod.cpp, common/speculative.cpp):
- llama.cpp keeps one hash table (4M entries, n-gram hash -> next token) shared by every slot and request,
  filled from each prompt and, 32 tokens at a time, from the output, and reset when a quarter full or after five
  drafts in a row with under a quarter accepted; a hash collision proposes another n-gram's follower. Here each
  slot searches its own request's committed positions exactly (the latest occurrence, as the table's last write
  wins), every committed position at once, with no entries from other requests and no resets.
- llama.cpp drafts only when the run is at least n_min long, and verifies just the run; here a step verifies
  n_max + 1 rows (the run first, the anchor after it), and, with the adaptive width on, only where the host's
  `LookupGate` finds that the lookup would propose a run (the step is plain elsewhere); the proposal itself is
  the lookup's, exact.
- ngram-simple: llama.cpp ignores a match at position 0 and wants more than size_n + size_m + 1 tokens of
  history; here any earlier occurrence counts.

The state (`NGramState`) holds each slot's tokens by position in a ring of `window` rows (the context, unless
--draft-window is smaller) and, per position, a 62-bit fingerprint of the n tokens ending there. A lookup compares
the key's fingerprint with every row's, then the n tokens of each match it takes are compared exactly, so a
fingerprint collision (about 2^-62 a pair) can only end a run early. Tensor operations only: the lookups run inside
the step's CUDA graph."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flashdraft.layers.kv_cache import slot_row

# llama.cpp's defaults (common/common.h: common_params_speculative_ngram_mod, ngram_simple)
NGRAM_MOD = dict(n_match=24, n_max=64, n_min=48)
NGRAM_SIMPLE = dict(size_n=12, size_m=48)
LIMIT = 1024  # llama.cpp's bound on each of the n-gram flags

_PRIME = 2 ** 31 - 1  # fingerprints: two sums of token * random factor modulo this prime, side by side


@dataclass(frozen=True)
class NGramConfig:
    n_match: int = NGRAM_MOD["n_match"]  # the key's length, the anchor included (--spec-ngram-mod-n-match)
    n_max: int = NGRAM_MOD["n_max"]  # the most tokens proposed (--spec-ngram-mod-n-max)
    n_min: int = NGRAM_MOD["n_min"]  # a shorter run proposes nothing (--spec-ngram-mod-n-min)
    chain: bool = True  # ngram-mod: every token looked up; False (ngram-simple): copied after the first lookup

    def __post_init__(self) -> None:
        flags = ("--spec-ngram-mod-n-match", "--spec-ngram-mod-n-max", "--spec-ngram-mod-n-min") if self.chain \
            else ("--spec-ngram-simple-size-n", "--spec-ngram-simple-size-m", None)
        for flag, value, low in zip(flags, (self.n_match, self.n_max, self.n_min), (1, 1, 0)):
            if flag and not low <= value <= LIMIT:
                raise ValueError(f"{flag} {value}: must be between {low} and {LIMIT}")


def config_for(spec_type: str, params: dict) -> NGramConfig:
    """The configuration of `--spec-type ngram-mod` or `ngram-simple` from the flags' values by name (missing:
    llama.cpp's defaults). ngram-simple's size_n is also its minimum run, as in llama.cpp."""
    if spec_type == "ngram-simple":
        n, m = params.get("size_n", NGRAM_SIMPLE["size_n"]), params.get("size_m", NGRAM_SIMPLE["size_m"])
        return NGramConfig(n_match=n, n_max=m, n_min=n, chain=False)
    return NGramConfig(**{name: params.get(name, default) for name, default in NGRAM_MOD.items()})


class NGramState:
    """Per slot: `tokens` and `held` (the position a row holds, -1: none) by row p % window, and `prints`, the
    fingerprint of the n tokens ending at the row's position (-1: fewer than n observed)."""

    def __init__(self, n_slots: int, window: int, device: str | torch.device):
        self.window = window
        self.tokens = torch.zeros(n_slots, window, dtype=torch.long, device=device)
        self.held = torch.full((n_slots, window), -1, dtype=torch.long, device=device)
        self.prints = torch.full((n_slots, window), -1, dtype=torch.long, device=device)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tokens, self.held, self.prints))


class LookupGate:
    """On the host, for one request: whether `NGramDrafter.lookup` at its last token read would propose a run (at
    least n_min tokens, n_max or the block's width if fewer, at least 1), followed over the tokens read as the
    lookup follows them over the observed ones: an occurrence counts once its follower is observed (two tokens
    before the last) and while its key is in the drafter's window; ngram-mod looks each next key up again,
    ngram-simple copies what followed the first. Keys are hashed, each keeping its latest occurrence (as the
    lookup takes). Where steps that drafted keep being rejected (MISSES in a row with under a quarter of the run
    accepted: llama.cpp's reset rule), the gate stays shut for QUIET tokens, twice as long after each such spell.
    The host reads a plain step's token one step late, so a shut gate looks one token behind."""
    MISSES = 5
    QUIET = 64
    QUIET_MOST = 1024

    def __init__(self, config: NGramConfig, tokens: list[int], window: int | None = None):
        self.config, self.n, self.window = config, config.n_match, window
        self.tokens: list[int] = []
        self.latest: dict[int, int] = {}  # hash of an n-gram -> the index of its last token, latest occurrence
        self.wanted = 1  # the run the last open() found
        self.misses = self.spells = self.quiet_until = 0
        self.add(tokens)

    def add(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens) - 3  # the latest occurrence whose follower the drafter has observed
            if end + 1 >= self.n:
                self.latest[hash(tuple(self.tokens[end + 1 - self.n:end + 1]))] = end

    def open(self, block: int) -> bool:
        cfg, last = self.config, len(self.tokens) - 1
        need = max(min(cfg.n_min, cfg.n_max, block - 1), 1)
        if last < self.quiet_until or last + 1 < self.n:
            return False
        oldest = last - self.window if self.window else 0  # the first position the drafter's ring still holds
        key = self.tokens[last + 1 - self.n:]
        at = self.latest.get(hash(tuple(key)))
        if at is None or at + 1 - self.n < oldest:
            return False
        if not cfg.chain:
            found = last - 1 - at >= need
        else:
            for _ in range(need - 1):
                key = key[1:] + [self.tokens[at + 1]]
                at = self.latest.get(hash(tuple(key)))
                if at is None or at + 1 - self.n < oldest:
                    return False
            found = True
        self.wanted = need
        return found

    def record(self, accepted: int) -> None:
        """After a step that drafted where the gate was open: its first `accepted` proposals were accepted."""
        if 4 * accepted >= self.wanted:
            self.misses = self.spells = 0
            return
        self.misses += 1
        if self.misses >= self.MISSES:
            self.quiet_until = len(self.tokens) - 1 + min(self.QUIET << self.spells, self.QUIET_MOST)
            self.misses, self.spells = 0, self.spells + 1


class NGramDrafter:
    """The Drafter (draft/interface.py) of `--spec-type ngram-mod` (chain) or `ngram-simple`: proposals of
    n_max tokens at most, so a verify block of n_max + 1."""
    target_layers = ()
    slot_tensors = True  # propose and observe take the slot as a [1] tensor too: one graph for every slot

    def __init__(self, config: NGramConfig, device: str | torch.device = "cpu", name: str = "ngram-mod"):
        self.config, self.device, self.name = config, device, name
        self.block_size = config.n_max + 1
        self.state: NGramState | None = None
        factors = torch.randint(1, _PRIME, (2, config.n_match), generator=torch.Generator().manual_seed(0))
        self.factors = factors.to(device)

    # ---- Drafter

    def setup_cache(self, window, n_slots=1, cache_dtypes=(None, None)):
        if window <= self.config.n_match:
            raise ValueError(f"the n-gram drafter's window of {window} positions must be longer than its "
                             f"{self.config.n_match}-token key (--draft-window, --ctx-size)")
        self.state = NGramState(n_slots, window, self.device)

    def reset(self, slot=0, keep=0):
        s = self.state
        gone = s.held[slot] >= keep
        s.held[slot].masked_fill_(gone, -1)
        s.prints[slot].masked_fill_(gone, -1)

    def observe(self, tokens, features, positions, slots=0):
        """One row (B = 1, `slots` an int or a [1] tensor)."""
        s, n = self.state, self.config.n_match
        tokens, positions = tokens[0, -s.window:], positions[0, -s.window:]  # earlier rows would be overwritten
        rows = positions % s.window
        s.tokens[slots, rows] = tokens
        s.held[slots, rows] = positions
        s.prints[slots, rows] = self._prints_at(slots, positions[:, None] - n + 1 + self._span(n))

    def propose(self, target, anchors, positions, slots, k, live=None, block=None, context_rows=None):
        """One row (B = 1, `slots` an int or a [1] tensor): [1, k] tokens after anchors[0] at positions[0]."""
        return self.lookup(anchors, positions, slots, k, block)[0]

    def host_gate(self, prompt_ids: list[int]) -> LookupGate:
        """The slot's gate over the tokens the host reads (engine/generate.SlotState.gate)."""
        return LookupGate(self.config, prompt_ids, None if self.state is None else self.state.window)

    def lookup(self, anchors: Tensor, positions: Tensor, slots, k: int, block: int | None = None
               ) -> tuple[Tensor, Tensor]:
        """propose's [1, k] tokens, and the run found ([], 0: nothing proposed; the tokens past it are the anchor):
        a chain (draft/chain.py) takes the lookup's tokens where it found a run, else its model drafter's."""
        s, cfg, n = self.state, self.config, self.config.n_match
        tokens, held, prints = (slot_row(t, slots) for t in (s.tokens, s.held, s.prints))
        n_max = min(cfg.n_max, (block or self.block_size) - 1)
        steps = min(n_max, max(k, cfg.n_min))  # enough for the n_min rule; the first k are the same for any k
        anchor, at = anchors[0], positions[0]
        # rows whose n-gram may be taken: complete, and its follower observed (so before the anchor)
        follows = (held >= 0) & (prints >= 0) & (held.roll(-1) == held + 1)
        candidates = torch.where(follows, held, -1)
        key = torch.cat([self._gather(tokens, at - n + 1 + self._span(n - 1)), anchors[:1]])
        key_ok = (at >= n - 1) & self._holds(held, at - n + 1 + self._span(n - 1)).all()
        key_print = torch.where(key_ok, self._print(key), -2)  # -2 matches no row
        latest = self._latest(prints, candidates, key_print)
        ends = [latest]  # the position each proposed token's n-gram ends at (its follower is the proposal)
        for _ in range(steps - 1):
            if cfg.chain:
                latest = self._latest(prints, candidates, self._gather(prints, latest + 1))
            else:
                latest = latest + 1
            ends.append(latest)
        ends = torch.cat(ends)
        # exact checks: each n-gram taken equals its key, which for the later tokens is the n-gram ending at the
        # previous proposal's position
        span = self._span(n)
        taken = ends[:, None] - n + 1 + span
        keys = torch.cat([ends[:1] - n + 1, ends[:-1] + 2 - n])[:, None] + span
        same = self._gather(tokens, taken) == self._gather(tokens, keys)
        same[0] = self._gather(tokens, taken[0]) == key
        index = self._span(steps)
        ok = ((ends >= 0) & (self._gather(candidates, ends) == ends) & same.all(-1)
              & self._holds(held, taken).all(-1) & (self._holds(held, keys).all(-1) | (index == 0)))
        run = ok.long().cumprod(0).sum()
        run = torch.where(run >= min(cfg.n_min, n_max), run, 0)
        proposed = torch.where(index < run, self._gather(tokens, ends + 1), anchor)
        if steps < k:  # past n_max (a chain's block may be a wider drafter's): the anchor, as past a run
            proposed = torch.cat([proposed, anchor.expand(k - steps)])
        return proposed[:k][None], run

    def compile_layers(self, block_sizes=None):
        pass

    # ---- helpers (tensor operations only)

    def _span(self, n: int) -> Tensor:
        return torch.arange(n, device=self.factors.device)

    def _gather(self, values: Tensor, positions: Tensor) -> Tensor:
        return values[positions % self.state.window]

    def _holds(self, held: Tensor, positions: Tensor) -> Tensor:
        return (positions >= 0) & (self._gather(held, positions) == positions)

    def _print(self, grams: Tensor) -> Tensor:
        """Fingerprints of n-grams [..., n] (ids below 2^31): 62 bits, two sums modulo a prime."""
        a, b = (((grams * f) % _PRIME).sum(-1) % _PRIME for f in self.factors)
        return a * 2 ** 31 + b

    def _prints_at(self, slot: int | Tensor, grams: Tensor) -> Tensor:
        """Fingerprints of the n-grams at positions [T, n] of a slot (-1 where one of them is not held)."""
        s = self.state
        complete = self._holds(slot_row(s.held, slot), grams).all(-1)
        return torch.where(complete, self._print(self._gather(slot_row(s.tokens, slot), grams)), -1)

    @staticmethod
    def _latest(prints: Tensor, candidates: Tensor, key_print: Tensor) -> Tensor:
        """The latest candidate position whose fingerprint is key_print (-1: none), [1]: a one-element index, as
        a zero-dimensional one would be read on the host."""
        return torch.where(prints == key_print, candidates, -1).amax(0, keepdim=True)


def create(spec_type: str, target, options) -> NGramDrafter:
    """The registry's constructor (draft/registry.py): no files, `options.params` the flags' values by name."""
    return NGramDrafter(config_for(spec_type, options.params), options.device, name=spec_type)
