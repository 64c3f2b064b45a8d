"""What the engine may call on a drafter: `Drafter`, the per-slot `DrafterState` it keeps, and the `LoadOptions` a
drafter kind loads with (draft/registry.py). Shapes carry a batch axis B; the engine calls `observe` and `propose`
one slot at a time (`slots` an int, a fixed index inside a step's graph), also inside a batched step.

The engine reads a drafter's `target_layers` once, has the target's steps capture those layers' outputs
(`features`), and hands the drafter the tokens and features of every position it commits through `observe`: never
a rejected draft token, so a drafter never rolls back. A speculative step asks `propose` for k tokens after each
row's anchor (the last committed token, whose own features come with the next `observe`), and the target verifies
the anchor and them."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from flashdraft.layers.kv_cache import Slots


class DrafterState(Protocol):
    """What a drafter keeps per slot between steps, in static buffers that the step graphs read and write."""

    @property
    def bytes(self) -> int: ...


class HostGate(Protocol):
    """Drafter.host_gate's per-request gate: the tokens as the host reads them, whether a step of a `block`-wide
    draft should draft, and how many of its proposals the last such step accepted."""

    def add(self, tokens: list[int]) -> None: ...

    def open(self, block: int) -> bool: ...

    def record(self, accepted: int) -> None: ...


@dataclass(frozen=True)
class LoadOptions:
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    quantized: bool = False  # GGUF matrices stay in their block format (engine.keep_quantized)
    embed_scale: float | None = None  # token embedding rows times this (--spec-draft-embed-scale; None: the draft's)
    params: dict[str, Any] = field(default_factory=dict)  # a kind's own settings (--spec-ngram-mod-n-max: n_max)
    target_source: Path | None = None  # the target's file or folder (a drafter inside the checkpoint: MTP)


class Drafter(Protocol):
    name: str  # the registry's name for its kind (/props reports it)
    block_size: int  # the most tokens one step verifies: the anchor and up to block_size - 1 proposed
    target_layers: tuple[int, ...]  # decoder layers whose outputs `observe` receives, concatenated (() for none)
    state: DrafterState | None  # set by setup_cache
    # (optional, default False) `propose` and `observe` also take the slot as a [1] tensor, so that one CUDA graph
    # serves every slot (engine/steps.Steps.observe) and every combination of slots in a batched step
    # (engine/steps.Steps.speculative_batch)
    slot_tensors: bool
    # (optional) `read_target_state(state)`: a drafter that attends over the target's own caches (a Gemma 4
    # assistant) is handed the target's models.interface.ModelState once, after setup_cache (engine/steps.Steps);
    # its `propose` reads the rows the target wrote before the anchor's position
    # (optional) `host_gate(prompt_ids) -> gate`: a lookup that proposes nothing most of the time (n-gram) gives each
    # request a host-side gate (HostGate): with the adaptive width on, the request's steps are plain while it is
    # shut and full width while it is open, instead of the width controller's probes

    def setup_cache(self, window: int, n_slots: int = 1,
                    cache_dtypes: tuple[torch.dtype | None, torch.dtype | None] = (None, None)) -> None:
        """Allocate `state` for `n_slots` slots, each holding what the drafter needs of the last `window`
        positions. `cache_dtypes`: K and V storage of a drafter that keeps attention context (None: its dtype)."""
        ...

    def reset(self, slot: int = 0, keep: int = 0) -> None:
        """Forget the slot's positions from `keep` on (0: all of them)."""
        ...

    def observe(self, tokens: Tensor, features: Tensor | None, positions: Tensor, slots: Slots = 0) -> None:
        """tokens, positions [B, T] of newly committed positions (increasing), features [B, T, F] the outputs of
        `target_layers` there (None when it names none)."""
        ...

    def propose(self, target, anchors: Tensor, positions: Tensor, slots: Slots, k: int, live: Tensor | None = None,
                block: int | None = None, context_rows: int | None = None) -> Tensor:
        """anchors [B] at positions [B] -> [B, k] tokens for the positions after each anchor. `target`: the
        models.interface.CausalLM drafted for (its token embedding and LM head). `live` ([B], a tensor so that one
        CUDA graph serves every value): only the first live - 1 proposals are wanted (the rest may be anything).
        `block` (static, default block_size): the rows a block drafter fills, fixed for a request so that narrower
        verify widths check the same proposals. `context_rows` (static): positions before the anchor that a
        drafter's attention needs to read (the target's attention bucket). Tensor operations only, with no host
        synchronisation: on CUDA the call is captured in the step's graph."""
        ...

    def compile_layers(self, block_sizes: tuple[int, ...] | None = None) -> None:
        """torch.compile what `propose` runs for blocks of these sizes (a drafter without layers does nothing)."""
        ...
