"""A chain of drafters (llama.cpp's `--spec-type ngram-mod,draft-dflash`): n-gram lookups first, one model drafter
last. Each step takes the first lookup that found a run (at least its n_min tokens), else the model drafter's
proposal, per row, with tensor operations only (every member proposes; inside a CUDA graph nothing branches on
data). Every member observes every committed position: the model drafter keeps its context whichever proposal a
step verified."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from flashdraft.draft.ngram import NGramDrafter


class ChainState:
    def __init__(self, members: list) -> None:
        self.members = members

    @property
    def bytes(self) -> int:
        return sum(m.state.bytes for m in self.members)


class ChainDrafter(nn.Module):
    """The Drafter (draft/interface.py) of lookups followed by one model drafter (a submodule where it is one, so
    that its weights count as the drafter's)."""

    def __init__(self, lookups: list[NGramDrafter], model) -> None:
        super().__init__()
        self.lookups, self.model = lookups, model
        self.members = [*lookups, model]
        self.name = ",".join(m.name for m in self.members)
        # the model drafter's block: a lookup's longer runs are cut to it (verify steps as wide as the longest
        # lookup, 65 rows by default, would mostly check repeated anchors wherever the lookup finds nothing)
        self.block_size = model.block_size
        self.target_layers = tuple(model.target_layers)  # lookups read none
        self.slot_tensors = all(getattr(m, "slot_tensors", False) for m in self.members)
        self.state: ChainState | None = None

    @property
    def cfg(self):
        return self.model.cfg

    def setup_cache(self, window, n_slots=1, cache_dtypes=(None, None)):
        for m in self.members:
            m.setup_cache(window, n_slots, cache_dtypes)
        self.state = ChainState(self.members)
        # the member that proposed each slot's last step
        self.sources = torch.zeros(n_slots, dtype=torch.long, device=self.lookups[0].device)

    def proposed_by(self, slot: int) -> str:
        """The member that proposed the slot's last step (read on the host, after the step)."""
        return self.members[int(self.sources[slot])].name

    def read_target_state(self, state):
        if hasattr(self.model, "read_target_state"):
            self.model.read_target_state(state)

    def reset(self, slot=0, keep=0):
        for m in self.members:
            m.reset(slot, keep)

    def observe(self, tokens, features, positions, slots=0):
        for m in self.lookups:
            m.observe(tokens, None, positions, slots)
        self.model.observe(tokens, features, positions, slots)

    def propose(self, target, anchors, positions, slots, k, live=None, block=None, context_rows=None) -> Tensor:
        """[1, k]: the first lookup's tokens where it found a run, else the model drafter's (its tokens past its
        own block: the anchor, as a lookup's past its run)."""
        model_k = min(k, self.model.block_size - 1)
        model_block = None if block is None else min(block, self.model.block_size)
        chosen = self.model.propose(target, anchors, positions, slots, model_k, live, model_block, context_rows)
        if model_k < k:
            chosen = torch.cat([chosen, anchors[:1, None].expand(1, k - model_k)], dim=1)
        source = torch.full((1,), len(self.lookups), dtype=torch.long, device=chosen.device)
        for i in reversed(range(len(self.lookups))):  # the first lookup with a run wins
            tokens, run = self.lookups[i].lookup(anchors, positions, slots, k, block)
            chosen = torch.where(run > 0, tokens, chosen)
            source = torch.where(run > 0, i, source)
        self.sources[slots] = source
        return chosen

    def compile_layers(self, block_sizes=None):
        self.model.compile_layers(None if block_sizes is None else
                                  tuple(min(b, self.model.block_size) for b in block_sizes))
