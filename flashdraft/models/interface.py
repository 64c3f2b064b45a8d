"""What the engine, the draft and training may call on a target model: `CausalLM`, and the `ModelState` it
allocates. Shapes carry a batch axis B: one row per slot served in the step (`slots` an int for one slot, a [B]
tensor for a batch)."""
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from flashdraft.layers.kv_cache import Slots

# Which positions get logits: "all", "last", a LongTensor [B] (one position per row), or None (no logits).
LogitsAt = str | Tensor | None


class ModelState(Protocol):
    """Everything a model keeps between steps for its slots (one cache object per layer)."""
    max_len: int

    @property
    def by_position(self) -> bool:
        """Every cache is indexed by position, so a slot goes back to any shorter length by that length alone.
        A recurrent layer's state (Gated DeltaNet) goes back only within the last step (`allow_rollback`)."""
        ...

    def allow_rollback(self, width: int) -> None:
        """Steps of up to `width` tokens (verify blocks) may be followed by a step that starts at any length within
        them (the accepted prefix): a recurrent layer then keeps its state after each of their tokens."""
        ...

    def reusable(self, slot: int, held: int, shared: int) -> int:
        """A slot's caches hold `held` tokens whose first `shared` start a new prompt: how many the prompt keeps
        (all `shared` by position; a recurrent state the whole `held`, else its checkpoint's length, else none)."""
        ...

    def checkpoint(self, slot: int, length: int) -> None:
        """Keep the slot's state after its first `length` tokens for a later prompt that shares them."""
        ...

    def resume(self, slot: int, length: int) -> None:
        """The slot's next step starts at `length` (a prompt that reuses that many tokens)."""
        ...

    def commit(self, slot: int, length: int) -> None:
        """After a verify step: the slot's first `length` positions are kept, and the next step starts there.
        Position-indexed caches need nothing (stale rows are masked by position), nor does a recurrent state kept
        after each token of the step (`allow_rollback`)."""
        ...

    @property
    def bytes(self) -> int: ...


class CausalLM(Protocol):
    cfg: object  # the family's config; every family's has vocab_size, hidden_size, num_layers, eos_token_ids
    rank: int
    world_size: int

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    def new_state(self, n_slots: int, max_len: int, cache_types: tuple[str, str] | None = None) -> ModelState:
        """cache_types: (K, V) storage, quant.kv_types.KV_CACHE_TYPES names (None: the model's dtype)."""
        ...

    def forward(self, ids: Tensor, positions: Tensor, state: ModelState | None = None, slots: Slots = 0,
                attn_len: int | None = None, capture: Sequence[int] = (), fresh: bool = False,
                logits_at: LogitsAt = "all", last_layer: int | None = None,
                eager: bool = False) -> tuple[Tensor | None, Tensor | None]:
        """ids, positions [B, T] -> (logits [B, T or 1, V] as `logits_at` asks, captured features [B, T, L*H]).
        With a state, K/V are written at the rows of `positions` in `slots` and attention reads the first
        `attn_len` rows (default: up to the largest position), masked by position. `fresh`: every row's
        positions are arange(T) (a first prefill chunk, or training with no state): plain causal attention.
        `capture`: decoder layer ids whose outputs (HF hidden_states[i + 1]) are concatenated, in that order.
        `last_layer`: stop after that layer (features only; no logits). `eager`: no compiled layers whatever the
        width (a prompt's slice: its attended length is no step's, and compiling for it would stall the streams)."""
        ...

    def embed(self, ids: Tensor) -> Tensor:
        """The first decoder layer's input for ids (a family may scale the rows, as Gemma)."""
        ...

    def token_embedding(self, ids: Tensor) -> Tensor:
        """The embedding's rows as stored: the DFlash draft's input, times its input_embedding_scale."""
        ...

    def logits(self, hidden: Tensor) -> Tensor:
        """Final-normed hidden states -> full-vocabulary logits (gathered over tensor-parallel ranks)."""
        ...

    def compile_layers(self, widths: tuple[int, ...]) -> None: ...
