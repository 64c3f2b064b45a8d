"""K split across programs and summed: the products for a few rows of x (gguf_gemv, gguf_mma, gguf_matmul) and the
split attention kernel give a small output too few programs, so each program takes a split of K (or of the keys)
and writes partial sums, which are then added in split order (deterministic: a token's bits do not depend on
timing).

Adding them took a second launch after each split product (`sum_splits`), about a tenth of a decode step's ~700
launches. With SPLIT_SUM "kernel" each tile's programs count their arrivals in `split_counts` instead, and the last
to arrive adds the splits itself (`last_to_arrive`): the usual release/acquire handoff (a CTA barrier, then one
thread's acq_rel atomic at GPU scope; on sm_90 MEMBAR.GPU, ATOMG, CCTL.IVALL), the partials read from L2, and the
count set back to 0 for the next kernel. Kernels launched after on the same stream (PDL included) count only after
this one has finished, so one buffer per device serves them all.
"""
import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from flashdraft.kernels import pdl
from flashdraft.kernels.pdl import start_dependents, wait_for_inputs

# "kernel": each tile's last program adds the splits; "launch": a sum_splits launch after the product does (the
# same bits). "launch" is the faster on an H100: 8B Q4_K_M decode 3.509 ms against 3.642, IQ4_XS 3.462 against 3.603
# (docs/PERF.md, sixteenth session), as the fourth session's in-kernel sum was.
SPLIT_SUM = os.environ.get("FLASHDRAFT_SPLIT_SUM", "launch")
MAX_TILES = 4096  # K is split only where the output gives fewer tiles than the target programs (hundreds)


@functools.cache
def split_counts(device: torch.device) -> Tensor:
    """Each tile's count of arrived splits, int32 zeros between kernels."""
    return torch.zeros(MAX_TILES, device=device, dtype=torch.int32)


@triton.jit
def last_to_arrive(count_ptr, splits):
    """Called by every program of a tile once it has stored its partial sums: whether it is the tile's last to
    arrive (then every split's stores are visible to it, read with cache_modifier=".cg"; it calls `reset`)."""
    tl.debug_barrier()
    return tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == splits - 1


@triton.jit
def reset(count_ptr):
    tl.atomic_xchg(count_ptr, 0)


@triton.jit
def sum_if_last(partial, stride_ps, out, ok, count_ptr, splits):
    """The tile's last program adds the splits' partial sums (pointers `partial` + split * stride_ps) in order, the
    bits of sum_splits, into `out`."""
    if last_to_arrive(count_ptr, splits):
        total = tl.load(partial, mask=ok, other=0.0, cache_modifier=".cg")
        for s in range(1, splits):
            total += tl.load(partial + s * stride_ps, mask=ok, other=0.0, cache_modifier=".cg")
        tl.store(out, total.to(out.dtype.element_ty), mask=ok)
        reset(count_ptr)


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, splits, numel, n, stride_om, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out [M, n] (rows stride_om apart) = partial [splits, M, n].sum(0) in out's dtype, the splits added in order
    (deterministic), one launch."""
    start_dependents(PDL)
    wait_for_inputs(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < numel
    acc = tl.load(partial_ptr + i, mask=ok, other=0.0)
    for s in range(1, splits):
        acc += tl.load(partial_ptr + s * numel + i, mask=ok, other=0.0)
    tl.store(out_ptr + (i // n) * stride_om + i % n, acc.to(out_ptr.dtype.element_ty), mask=ok)


def outputs(x: Tensor, n: int, splits: int, out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(out [M, N] in x's dtype, partial [splits, M, N]): one split writes out itself, more write float32 partial
    sums. `out` may be given: columns of a wider output (rows strided)."""
    out = torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype) if out is None else out
    return out, out[None] if splits == 1 else torch.empty(splits, x.shape[0], n, device=x.device, dtype=torch.float32)


def in_kernel(tiles: int) -> bool:
    """Whether a kernel of `tiles` tiles adds (or merges) its splits itself: SPLIT_SUM "kernel", and a count for
    every tile; otherwise a launch of its own does."""
    return SPLIT_SUM == "kernel" and tiles <= MAX_TILES


def sum_args(out: Tensor, partial: Tensor, tiles: int) -> dict:
    """The product kernels' arguments for adding the splits of partial [splits, M, N] into out [M, N] themselves."""
    here = partial.shape[0] > 1 and in_kernel(tiles)
    return dict(sum_ptr=out, count_ptr=split_counts(out.device) if here else partial, stride_sm=out.stride(0),
                SUM_HERE=here)


def finish(partial: Tensor, out: Tensor, args: dict) -> None:
    """out = the splits' sum, unless the kernel added them (sum_args) or K was not split."""
    if partial.shape[0] > 1 and not args["SUM_HERE"]:
        sum_splits(partial, out)


def sum_splits(partial: Tensor, out: Tensor) -> None:
    """out [M, N] (its rows may be strided) = partial [splits, M, N] summed over splits in order, in out's dtype
    (one launch)."""
    block = 1024
    _sum_splits_kernel[(triton.cdiv(out.numel(), block),)](partial, out, partial.shape[0], out.numel(), out.shape[1],
                                                          out.stride(0), BLOCK=block, **pdl.launch(out))
