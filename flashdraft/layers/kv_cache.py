"""Per-layer K/V stores. A cache object owns its rows, KV-head count, head size and storage type; a layer of
another shape, a sliding ring or a quantized store is a new kind here, not a new engine path.

- `KVCache`: rows indexed by position (the target's layers). A forward writes the rows of its positions and
  attends to rows at positions <= its own, so rows past the committed length are stale and harmless: rolling
  back is resetting a length.
- `WindowKVCache`: a sliding-window layer's ring of window + step rows (row p % rows).
- `RingKVCache`: a window ring (row p % window) after scratch rows that a step's own block K/V go into, with
  the position each ring row holds (the DFlash draft's context)."""
import torch
from torch import Tensor

Slots = int | slice | Tensor  # one slot (a Python int: a fixed index for CUDA graphs), a range, or one per batch row


class KVSlots:
    """One layer's cache as one forward sees it: the rows of its slots. Made outside compiled layers, so that a
    compiled layer receives the slot's own view as an input and writes it in place (indexing a slot out of the
    whole cache inside the graph would make torch.compile copy the whole cache back after the write)."""

    def __init__(self, cache: "KVCache", slots: Slots):
        self.dtype = cache.dtype
        self.single = isinstance(slots, int)
        if self.single:
            self.k, self.v = cache.k[slots], cache.v[slots]  # [KV, rows, D]
        else:
            self.k, self.v, self.slots = cache.k, cache.v, slots
            self.index = torch.arange(cache.k.shape[0], device=cache.k.device)[slots]

    def write(self, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """k/v [B, T, KV, D] at positions [B, T]."""
        if self.single:  # along the row axis of the slot's own view
            self.k.index_copy_(1, positions[0], k[0].transpose(0, 1).to(self.dtype))
            self.v.index_copy_(1, positions[0], v[0].transpose(0, 1).to(self.dtype))
            return
        self.k[self.index[:, None], :, positions] = k.to(self.dtype)
        self.v[self.index[:, None], :, positions] = v.to(self.dtype)

    def read(self, length: int, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """The first `length` rows: [B, KV, length, D] (views for one slot or a range)."""
        if self.single:
            k, v = self.k[None, :, :length], self.v[None, :, :length]
        else:
            k, v = self.k[self.slots, :, :length], self.v[self.slots, :, :length]
        return (k, v) if dtype is None else (k.to(dtype), v.to(dtype))


class KVCache:
    def __init__(self, n_slots: int, kv_heads: int, rows: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str):
        shape = (n_slots, kv_heads, rows, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.rows, self.kv_heads, self.head_dim, self.dtype = rows, kv_heads, head_dim, dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.k.element_size() * self.k.shape[0]

    def view(self, slots: Slots) -> KVSlots:
        return KVSlots(self, slots)

    def write(self, slots: Slots, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """k/v [B, T, KV, D] at positions [B, T] of the given slots."""
        self.view(slots).write(positions, k, v)

    def read(self, slots: Slots, length: int, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """The first `length` rows of the slots: [B, KV, length, D] (views for an int or a slice)."""
        return self.view(slots).read(length, dtype)


def window_positions(end: Tensor, rows: int) -> Tensor:
    """[B, rows]: the position each row of a WindowKVCache holds once positions up to `end` [B] are written (the
    latest p <= end with p % rows == row; negative: nothing yet)."""
    row = torch.arange(rows, device=end.device)
    return end[:, None] - (end[:, None] - row) % rows


class WindowSlots:
    """A WindowKVCache as one forward sees it (see KVSlots)."""

    def __init__(self, cache: "WindowKVCache", slots: Slots):
        self.dtype, self.rows = cache.dtype, cache.rows
        self.single = isinstance(slots, int)
        if self.single:
            self.k, self.v = cache.k[slots], cache.v[slots]  # [KV, rows, D]
        else:
            self.k, self.v = cache.k, cache.v
            self.index = torch.arange(cache.k.shape[0], device=cache.k.device)[slots]

    def write(self, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """k/v [B, T, KV, D] at positions [B, T] (increasing): the last `rows` of them land at rows p % rows."""
        positions, k, v = positions[:, -self.rows:], k[:, -self.rows:], v[:, -self.rows:]
        rows = positions % self.rows
        if self.single:
            self.k.index_copy_(1, rows[0], k[0].transpose(0, 1).to(self.dtype))
            self.v.index_copy_(1, rows[0], v[0].transpose(0, 1).to(self.dtype))
            return
        self.k[self.index[:, None], :, rows] = k.to(self.dtype)
        self.v[self.index[:, None], :, rows] = v.to(self.dtype)

    def read(self, length: int | None = None, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """Every row: [B, KV, rows, D]; which position each holds is window_positions' (`length` is unused: the
        ring is read whole)."""
        k, v = (self.k[None], self.v[None]) if self.single else (self.k[self.index], self.v[self.index])
        return (k, v) if dtype is None else (k.to(dtype), v.to(dtype))


class WindowKVCache:
    """A sliding-window layer's K/V: a ring of `window + extra` rows (row p % rows) instead of the whole context,
    enough for the window behind every query of a step of up to `extra` tokens. Which position a row holds
    follows from the step's last position (window_positions); rows an earlier, longer step wrote past it (the
    rejected part of a verify block) then come out more than a window back, so the window mask drops them."""

    def __init__(self, n_slots: int, kv_heads: int, window: int, extra: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str):
        self.rows, self.window, self.extra = window + extra, window, extra
        self.k = torch.zeros((n_slots, kv_heads, self.rows, head_dim), device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, dtype

    def view(self, slots: Slots) -> WindowSlots:
        return WindowSlots(self, slots)


class RingKVCache:
    def __init__(self, n_slots: int, kv_heads: int, window: int, scratch: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, row_positions: Tensor | None = None):
        """`row_positions` [n_slots, window] (-1: empty) may be shared by the rings of several layers that are
        always written together."""
        shape = (n_slots, kv_heads, scratch + window, head_dim)
        # Zeros, not empty: masked rows still meet V in the softmax-weighted sum, and 0 * NaN would be NaN.
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.window, self.scratch, self.dtype = window, scratch, dtype
        self.row_positions = row_positions if row_positions is not None else \
            torch.full((n_slots, window), -1, device=device, dtype=torch.long)

    def write(self, slot: int, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """k/v [KV, n, D] of increasing positions [n] (n <= window) into the ring rows p % window. The owner of
        `row_positions` records the positions (once for all the rings that share the table)."""
        rows = positions % self.window
        self.k[slot, :, self.scratch + rows] = k.to(self.dtype)
        self.v[slot, :, self.scratch + rows] = v.to(self.dtype)

    def block_view(self, slot: int, block_len: int, ring_rows: int) -> tuple[Tensor, Tensor]:
        """One contiguous view [KV, block_len + ring_rows, D]: `block_len` scratch rows (for the step's own K/V),
        then the first `ring_rows` rows of the ring."""
        rows = slice(self.scratch - block_len, self.scratch + ring_rows)
        return self.k[slot, :, rows], self.v[slot, :, rows]


class KVState:
    """A target's state for all its slots: one cache per layer. Rollback after a verify is by position, so
    `commit` has nothing to do for these caches (a recurrent layer's state would copy its accepted step here)."""

    def __init__(self, layers: list[KVCache], max_len: int):
        self.layers, self.max_len = layers, max_len

    def commit(self, slot: int, length: int) -> None:
        pass

    @property
    def bytes(self) -> int:
        return sum(c.k.numel() * c.k.element_size() * 2 for c in self.layers)
