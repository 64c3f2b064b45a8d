"""Keeping tensor-parallel ranks in step. Every rank runs the same engine code on the same request, so
the ranks make the same decisions from the same logits (all-reduced and all-gathered, identical on every
rank). Two things only rank 0 knows travel from it: the request itself, and before each decode step
whether to take it (a cancelled request or a closed stream stops rank 0 alone).
"""
import functools
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

IDLE_TIMEOUT = timedelta(days=365)  # followers wait for the next request as long as the server runs


@functools.cache
def control_group() -> dist.ProcessGroup:
    """A gloo group for the requests: objects pass through CPU memory, and the wait between two requests
    may be far longer than the timeout of the group the model's collectives use."""
    return dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)


def from_rank0(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (the others' argument is ignored)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=control_group())
    return box[0]


def in_lockstep(steps: Iterator[list[int]], device: str) -> Iterator[list[int]]:
    """The decode steps, advanced on every rank together: before each step rank 0 says whether all ranks
    take it. On rank 0 closing this iterator early tells the others to stop; a rank that stops by itself
    (EOS, stop strings, the token budget) finds rank 0 stopping at the same step."""
    flag = torch.empty(1, dtype=torch.int32, device=device)

    def rank0_says(go_on: bool) -> bool:
        flag.fill_(int(go_on))
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    at_yield = False
    try:
        while rank0_says(True):
            new = next(steps, None)
            if new is None:  # the budget is spent: every rank ends here without a word
                return
            at_yield = True
            yield new
            at_yield = False
    finally:
        if at_yield and rank0_says(False) and dist.get_rank() != 0:
            raise RuntimeError("tensor-parallel ranks diverged: this rank stopped a generation that rank 0 went on with")
        steps.close()
