"""Per-layer K/V stores. A cache object owns its rows, KV-head count, head size and storage type; a layer of
another shape, a sliding ring or a quantized store is a new kind here, not a new engine path.

- `KVCache`: rows indexed by position (the target's layers). A forward writes the rows of its positions and
  attends to rows at positions <= its own, so rows past the committed length are stale and harmless: rolling
  back is resetting a length.
- `window_cache`: a sliding-window layer's ring of window + step rows (row p % rows).
- `RingKVCache`: a window ring (row p % window) after scratch rows that a step's own block K/V go into, with
  the position each ring row holds (the DFlash draft's context).
- `RecurrentCache`: a recurrent layer's state and its convolution's last inputs per slot (Gated DeltaNet), one
  value for the whole prefix: the state at the last step's start and that step's inputs, replayed up to wherever
  the next step starts within it (the accepted prefix of a verify block).
The target's caches store K and V through codecs (f32/f16/bf16, or llama.cpp's block types: layers/kv_quant.py).
A quantized K store may hold its keys minus a fixed `key_shift` per KV head (the model's mean key): every score of
a query then moves by the same q . shift, which softmax ignores, while the blocks no longer spend their scale on
the mean (Qwen2's key bias). Reads add the shift back; the split kernel reads the shifted rows as stored."""
import torch
from torch import Tensor

from flashdraft.layers.kv_quant import KVCodec, kv_codecs

Slots = int | slice | Tensor  # one slot (a Python int: a fixed index for CUDA graphs), a range, or one per batch row


def slot_row(table: Tensor, slot: int | Tensor) -> Tensor:
    """A slot's row of a per-slot table, the slot an int or a [1] tensor (a copy then: one CUDA graph serves every
    slot)."""
    return table[slot] if isinstance(slot, int) else table.index_select(0, slot)[0]


class KVSlots:
    """One layer's cache as one forward sees it: the rows of its slots. Made outside compiled layers, so that a
    compiled layer receives the slot's own view as an input and writes it in place (indexing a slot out of the
    whole cache inside the graph would make torch.compile copy the whole cache back after the write). Rows are
    stored through the cache's codecs (layers/kv_quant.py): quantized as written, expanded as read."""

    def __init__(self, cache: "KVCache", slots: Slots):
        self.codecs, self.window, self.key_shift = cache.codecs, cache.window, cache.key_shift
        self.single = isinstance(slots, int)
        if self.single:
            self.k, self.v = cache.k[slots], cache.v[slots]  # [KV, rows, row size]
        else:
            self.k, self.v, self.slots = cache.k, cache.v, slots
            self.index = torch.arange(cache.k.shape[0], device=cache.k.device)[slots]

    def write(self, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """k/v [B, T, KV, D] at positions [B, T]; a window ring keeps the last of them at rows p % rows."""
        if self.window:
            rows = self.k.shape[-2]
            positions, k, v = positions[:, -rows:] % rows, k[:, -rows:], v[:, -rows:]
        head_dim = k.shape[-1]
        if self.single and k.is_cuda and all(c.kernel_writes(head_dim) for c in self.codecs):
            from flashdraft.kernels import kv_quantize  # K and V quantized into their rows in one launch
            kc, vc = self.codecs
            kv_quantize.write_kv_rows(self.k, self.v, positions[0], k[0], v[0], kc.name, vc.name, kc.rotates(head_dim),
                                      vc.rotates(head_dim), self.key_shift)
            return
        k, v = self.codecs[0].encode(k, self.key_shift), self.codecs[1].encode(v)
        if self.single:  # along the row axis of the slot's own view
            self.k.index_copy_(1, positions[0], k[0].transpose(0, 1))
            self.v.index_copy_(1, positions[0], v[0].transpose(0, 1))
            return
        self.k[self.index[:, None], :, positions] = k
        self.v[self.index[:, None], :, positions] = v

    def _rows(self, length: int) -> slice:
        """The first `length` rows (a window ring: all its rows, see window_positions)."""
        return slice(None) if self.window else slice(None, length)

    def stored(self, length: int) -> tuple[Tensor, Tensor]:
        """The rows as stored (keys minus `key_shift`), as views: one slot's [KV, length, row size], or (slots a
        range or a tensor) every slot's [S, KV, length, row size], batch row b's slot being `index[b]`."""
        rows = self._rows(length)
        if self.single:
            return self.k[:, rows], self.v[:, rows]
        return self.k[:, :, rows], self.v[:, :, rows]

    def read(self, length: int, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """The rows expanded: [B, KV, length, D]."""
        rows = self._rows(length)
        if self.single:
            k, v = self.k[None, :, rows], self.v[None, :, rows]
        else:
            k, v = self.k[self.slots, :, rows], self.v[self.slots, :, rows]
        shift = None if self.key_shift is None else self.key_shift[:, None]  # heads before rows here
        return self._expand(k, v, shift, dtype)

    def _expand(self, k: Tensor, v: Tensor, shift: Tensor | None, dtype: torch.dtype | None) -> tuple[Tensor, Tensor]:
        """Stored K/V rows -> rows in `dtype`, the keys' shift added back."""
        if shift is None:
            return self.codecs[0].decode(k, dtype), self.codecs[1].decode(v, dtype)
        keys = self.codecs[0].decode(k, torch.float32) + shift
        return keys.to(dtype or self.codecs[0].dtype), self.codecs[1].decode(v, dtype)

    def as_read(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """New rows k/v [B, T, KV, D] as a read of the cache will give them back, in their own dtype: a chunk that
        attends to its own K/V (a fresh prefill) then sees what a step attending through the cache sees, so an
        answer does not depend on whether its prompt's start came from the prompt cache (llama.cpp attends through
        its cache too)."""
        kc, vc = self.codecs
        if kc.storage_dtype == k.dtype and vc.storage_dtype == v.dtype:  # float rows of the model's own dtype
            return k, v
        return self._expand(kc.encode(k, self.key_shift), vc.encode(v), self.key_shift, k.dtype)


class KVCache:
    """Rows by position, or (`window`) a sliding-window layer's ring of `rows` = window + step rows."""

    by_position = True  # row p holds position p (a ring: p % rows): a shorter length needs no work

    def __init__(self, n_slots: int, kv_heads: int, rows: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, codecs: tuple[KVCodec, KVCodec] | None = None, window: int = 0):
        self.codecs = codecs or kv_codecs(None, dtype)
        k, v = self.codecs
        k.prepare(device, head_dim), v.prepare(device, head_dim)
        self.k = torch.zeros((n_slots, kv_heads, rows, k.row_size(head_dim)), device=device, dtype=k.storage_dtype)
        self.v = torch.zeros((n_slots, kv_heads, rows, v.row_size(head_dim)), device=device, dtype=v.storage_dtype)
        self.rows, self.kv_heads, self.head_dim, self.dtype, self.window = rows, kv_heads, head_dim, dtype, window
        self.key_shift: Tensor | None = None  # float32 [KV, head_dim], subtracted from keys as they are written

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V one position takes in every slot (a window ring takes them for its rows only)."""
        k, v = self.codecs
        return self.kv_heads * (k.bytes_per_row(self.head_dim) + v.bytes_per_row(self.head_dim)) * self.k.shape[0]

    def view(self, slots: Slots) -> KVSlots:
        return KVSlots(self, slots)

    def write(self, slots: Slots, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """k/v [B, T, KV, D] at positions [B, T] of the given slots."""
        self.view(slots).write(positions, k, v)

    def read(self, slots: Slots, length: int, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """The first `length` rows of the slots: [B, KV, length, D] (views for an int or a slice)."""
        return self.view(slots).read(length, dtype)

    @property
    def bytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


def window_cache(n_slots: int, kv_heads: int, window: int, extra: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, codecs: tuple[KVCodec, KVCodec] | None = None) -> KVCache:
    """A sliding-window layer's K/V: a ring of `window + extra` rows (row p % rows) instead of the whole context,
    enough for the window behind every query of a step of up to `extra` tokens. Which position a row holds
    follows from the step's last position (window_positions); rows an earlier, longer step wrote past it (the
    rejected part of a verify block) then come out more than a window back, so the window mask drops them."""
    return KVCache(n_slots, kv_heads, window + extra, head_dim, dtype, device, codecs, window=window)


def window_positions(end: Tensor, rows: int) -> Tensor:
    """[B, rows]: the position each row of a window ring holds once positions up to `end` [B] are written (the
    latest p <= end with p % rows == row; negative: nothing yet)."""
    row = torch.arange(rows, device=end.device)
    return end[:, None] - (end[:, None] - row) % rows


class RingKVCache:
    def __init__(self, n_slots: int, kv_heads: int, window: int, scratch: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, row_positions: Tensor | None = None, v_dtype: torch.dtype | None = None):
        """`row_positions` [n_slots, window] (-1: empty) may be shared by the rings of several layers that are
        always written together. `dtype` stores K, `v_dtype` V (default: `dtype`)."""
        shape = (n_slots, kv_heads, scratch + window, head_dim)
        # Zeros, not empty: masked rows still meet V in the softmax-weighted sum, and 0 * NaN would be NaN.
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=v_dtype or dtype)
        self.window, self.scratch, self.dtype = window, scratch, dtype
        self.row_positions = row_positions if row_positions is not None else \
            torch.full((n_slots, window), -1, device=device, dtype=torch.long)

    def write(self, slot: int | Tensor, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """k/v [KV, n, D] of increasing positions [n] (n <= window) into the ring rows p % window of `slot` (an int
        or a [1] tensor). The owner of `row_positions` records the positions (once for all the rings that share
        the table)."""
        rows = self.scratch + positions % self.window
        if isinstance(slot, Tensor):  # (slot, rows) index [n] entries of [KV, D]
            self.k[slot.expand(len(rows)), :, rows] = k.transpose(0, 1).to(self.k.dtype)
            self.v[slot.expand(len(rows)), :, rows] = v.transpose(0, 1).to(self.v.dtype)
            return
        self.k[slot, :, rows] = k.to(self.k.dtype)
        self.v[slot, :, rows] = v.to(self.v.dtype)

    def block_view(self, slot: int | Tensor, block_len: int, ring_rows: int) -> tuple[Tensor, Tensor]:
        """One contiguous view [KV, block_len + ring_rows, D]: `block_len` scratch rows (for the step's own K/V),
        then the first `ring_rows` rows of the ring. `slot` a [1] tensor: a copy of those rows (one CUDA graph then
        serves every slot), whose scratch rows the step may write as the view's."""
        rows = slice(self.scratch - block_len, self.scratch + ring_rows)
        return slot_row(self.k[:, :, rows], slot), slot_row(self.v[:, :, rows], slot)


class RecurrentSlots:
    """One recurrent layer's state as one forward sees it: views of its slots' rows, made outside compiled layers
    (as KVSlots). A forward continues the state after the tokens before its first position (`replayed`, or the
    kernel of kernels/delta_rule.py in place) and keeps what the next step needs (`keep`); rows are picked by
    tensors, so one CUDA graph serves every position."""

    def __init__(self, cache: "RecurrentCache", slots: Slots):
        if isinstance(slots, int):
            slots = slice(slots, slots + 1)
        self.index = slots if isinstance(slots, Tensor) else None
        whole = self.index is not None
        self.state, self.base, self.conv = ((cache.state, cache.base, cache.conv) if whole else
                                            (cache.state[slots], cache.base[slots], cache.conv[slots]))
        self.inputs = cache.inputs if whole else [t[slots] for t in cache.inputs]
        self.rows, self.steps = cache.rows, cache.steps

    def slots(self, device: torch.device) -> Tensor:
        """The index of each batch row's slot in this view's tensors [B]."""
        return self.index if self.index is not None else torch.arange(self.state.shape[0], device=device)

    def replayed(self, start: Tensor) -> Tensor:
        """The state after the first start [B] tokens of each slot [B, heads, key dim, value dim] (float32): the kept
        state, then the kept inputs of the tokens from its length to `start` (at most `steps`)."""
        from flashdraft.layers.gated_deltanet import replay
        slots = self.slots(start.device)
        return replay(self.state[slots], self.base[slots], start, [t[slots] for t in self.inputs])

    def keep(self, start: Tensor, state: Tensor | None, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> None:
        """After a forward of T tokens from start [B] (k, v [B, H, T, D], g, beta [B, H, T]): where T <= steps, the
        state at `start` (`state`; None: the kernel wrote it) and the tokens' inputs, from which the next step
        replays up to wherever it starts within them; else the state after them (`state`, or the kernel's)."""
        slots, T = self.slots(start.device), k.shape[2]
        if T <= self.steps:
            rows = (start[:, None] + torch.arange(T, device=start.device)) % self.steps
            for kept, x in zip(self.inputs, (k, v, g, beta)):
                kept[slots[:, None], rows] = x.transpose(1, 2)
            self.base[slots] = start
        else:
            self.base[slots] = start + T
        if state is not None:
            self.state[slots] = state

    def read_conv(self, start: Tensor) -> Tensor:
        """The convolution's inputs after the first start [B] tokens of each slot [B, channels, kernel - 1]."""
        return self.conv[self.slots(start.device)[:, None], start[:, None] % self.rows][:, 0]

    def write_conv(self, lengths: Tensor, conv: Tensor) -> None:
        """The convolution's inputs after the first lengths [B, n] tokens: conv [B, n, channels, kernel - 1]."""
        self.conv[self.slots(lengths.device)[:, None], lengths % self.rows] = conv.to(self.conv.dtype)


class RecurrentCache:
    """A recurrent layer's per-slot state: a float32 matrix [key dim, value dim] per head, and the last
    `kernel - 1` inputs of its causal convolution. A forward from position 0 (`fresh`) starts from zeros; any
    other continues from the state after the tokens before its first position.

    Each slot keeps one state, after `base` tokens, and the inputs of up to `steps` tokens from there (a step's
    own: k, v, decay and beta per head), so that after a verify block every length from its start to its end can
    be continued from by replaying the accepted tokens' inputs; the convolution keeps its inputs after each of
    those lengths in a ring of `rows` (row n % rows: after n tokens). Rolling back to the accepted prefix is
    starting the next step there, as with position-indexed K/V: nothing to copy. A step of more than `steps`
    tokens keeps the state after its last. One step (a plain step's token) until `allow_rollback` asks for more."""

    by_position = False
    bytes_per_token = 0

    def __init__(self, n_slots: int, heads: int, key_dim: int, value_dim: int, channels: int, kernel: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.state = torch.zeros((n_slots, heads, key_dim, value_dim), device=device, dtype=torch.float32)
        self.base = torch.zeros(n_slots, device=device, dtype=torch.long)
        self.conv = torch.zeros((n_slots, 2, channels, kernel - 1), device=device, dtype=dtype)
        # one token's inputs even without rollback: a plain step queued after the one that sampled the end of the
        # answer runs that token before the host has seen it, and the slot then holds the state before it
        self.inputs = self._inputs(1)
        # one saved state per slot (KVState.checkpoint: after a prompt), for a later prompt that shares it
        self.saved_state = torch.zeros_like(self.state)
        self.saved_conv = torch.zeros_like(self.conv[:, 0])

    def _inputs(self, steps: int) -> list[Tensor]:
        n, heads, key_dim, value_dim = self.state.shape
        return [self.state.new_zeros(shape) for shape in ((n, steps, heads, key_dim), (n, steps, heads, value_dim),
                                                          (n, steps, heads), (n, steps, heads))]

    @property
    def rows(self) -> int:
        return self.conv.shape[1]

    @property
    def steps(self) -> int:
        return self.inputs[0].shape[1]

    def allow_rollback(self, width: int) -> None:
        """Keep the inputs of forwards of up to `width` tokens (before any slot holds one: made anew)."""
        if width > self.steps:
            self.inputs = self._inputs(width)
            self.conv = self.conv.new_zeros((self.conv.shape[0], width + 1, *self.conv.shape[2:]))

    def at(self, slot: int, length: int) -> tuple[Tensor, Tensor]:
        """The state and the convolution's inputs after the slot's first `length` tokens (the state replayed: a
        length from the kept state's to `steps` past it)."""
        device = self.state.device
        state = self.view(torch.tensor([slot], device=device)).replayed(torch.tensor([length], device=device))[0]
        return state, self.conv[slot, length % self.rows]

    def save(self, slot: int, length: int) -> None:
        """Keep the state after the slot's first `length` tokens aside."""
        state, conv = self.at(slot, length)
        self.saved_state[slot].copy_(state)
        self.saved_conv[slot].copy_(conv)

    def restore(self, slot: int, length: int) -> None:
        """Make the saved state (taken after `length` tokens) the one a step from `length` continues."""
        self.state[slot].copy_(self.saved_state[slot])
        self.base[slot] = length
        self.conv[slot, length % self.rows].copy_(self.saved_conv[slot])

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.state, self.conv, self.saved_state, self.saved_conv, *self.inputs))

    def view(self, slots: Slots) -> RecurrentSlots:
        return RecurrentSlots(self, slots)


class KVState:
    """A target's state for all its slots: one cache per layer. Where every cache is indexed by position
    (`by_position`), a slot goes back to any shorter length; a recurrent layer's state (RecurrentCache) goes back
    only within the last step, which is what a verify step needs (`allow_rollback`), and to the one length per
    slot whose state was saved (`checkpoint`: a prompt's end), which is what the next turn of a conversation
    needs when it does not repeat the last answer verbatim (reasoning left out by the template)."""

    def __init__(self, layers: list, max_len: int):
        self.layers, self.max_len = layers, max_len
        self.saved: dict[int, int] = {}  # slot -> the length whose recurrent states are saved

    @property
    def by_position(self) -> bool:
        return all(c.by_position for c in self.layers)

    def allow_rollback(self, width: int) -> None:
        """Steps of up to `width` tokens (verify blocks) may be followed by a step that starts at any length within
        them. Position-indexed caches need nothing; a recurrent cache keeps the inputs of such a step."""
        for cache in self.layers:
            if not cache.by_position:
                cache.allow_rollback(width)

    def reusable(self, slot: int, held: int, shared: int) -> int:
        """A slot's caches hold `held` tokens, the first `shared` of which start a new prompt: how many of them
        the prompt can keep. Position-indexed caches keep any prefix, but a window ring (window_cache) only a prompt
        that continues all `held`: the last step may have written up to its allowance of rows past `held` (a
        rejected draft, a padded prompt slice), which overwrote the window before any shorter prefix. A recurrent
        state is the state after all `held` tokens, so it serves a prompt that continues them all, else the saved
        state where the prompt shares that much."""
        if shared < held and any(getattr(c, "window", 0) for c in self.layers):
            return 0
        if self.by_position or (shared == held and self.holds(slot, held)):
            return shared
        saved = self.saved.get(slot, 0)
        return saved if saved <= shared else 0

    def holds(self, slot: int, length: int) -> bool:
        """Whether every recurrent cache can continue the slot from `length` tokens (kept state and inputs reach
        it: not where a request ended mid-prompt past the tokens the slot is said to hold)."""
        bases = [c.base[slot] for c in self.layers if not c.by_position]
        steps = min((c.steps for c in self.layers if not c.by_position), default=0)
        return not bases or all(0 <= length - base <= steps for base in torch.stack(bases).tolist())  # one read

    def checkpoint(self, slot: int, length: int) -> None:
        """Save the recurrent states after the slot's first `length` tokens (nothing to do by position)."""
        if not self.by_position:
            for cache in self.layers:
                if not cache.by_position:
                    cache.save(slot, length)
            self.saved[slot] = length

    def resume(self, slot: int, length: int) -> None:
        """A step from `length` comes next: where that is the saved length, the saved states are the ones it
        continues (the live ones may be past it)."""
        if length and self.saved.get(slot) == length:
            for cache in self.layers:
                if not cache.by_position:
                    cache.restore(slot, length)

    def commit(self, slot: int, length: int) -> None:
        """After a verify step the slot keeps its first `length` positions. No cache kind has work here: K/V rows
        past it are masked by position, and a recurrent cache keeps the step's inputs, which the next step,
        starting at `length`, replays up to there."""

    @property
    def bytes(self) -> int:
        return sum(c.bytes for c in self.layers)
