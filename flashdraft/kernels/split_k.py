"""K split across programs and summed: the products for a few rows of x (gguf_gemv, gguf_mma, gguf_matmul) give a
small output too few programs, so each program takes a split of K and writes partial sums, which one more launch
(`finish`) adds in split order (deterministic: a token's bits do not depend on timing), or, inside a torch.compile
graph, the graph's own additions (`add_splits`: fused into the kernel that reads the product).

Partial sums are float32 (the tensor-core kernel) or exact (the integer and int8 mma kernels): int64 fixed point,
FIXED_BITS fractional bits (`to_fixed`), each super-block's (or block's) float32 value truncated to a multiple of
2^-32 and then added exactly, so the sum does not depend on the order of the additions. The integer kernels (1-16
rows) and the int8 mma kernels (3-16 rows) tile K differently, yet give a token's row the same bits: a greedy
speculative answer equals the plain one on every route (a decoded row and a verified block). Values up to 2^31 in
magnitude fit; a projection's are many orders below.

Each tile's last program adding the splits itself (an arrival count per tile, a release/acquire handoff) saved ~80
of a decode step's ~700 launches but measured slower on an H100 (8B Q4_K_M decode 3.642 ms against 3.509, IQ4_XS
3.603 against 3.462; docs/perf-history.md, 2026-12-05 H100), as an earlier version had (H200, 2026-12-04), so the sum is
a launch of its own.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

from flashdraft.kernels import pdl
from flashdraft.kernels.pdl import start_dependents, wait_for_inputs


FIXED_BITS = 32
FIXED_ONE = float(2 ** FIXED_BITS)
_ONE = tl.constexpr(FIXED_ONE)  # the scale inside kernels (gguf_mma keeps its own for Gluon)


@triton.jit
def to_fixed(v):
    """float32 values -> int64 fixed point (FIXED_BITS fractional bits, truncated: the same on every route)."""
    return (v * _ONE).to(tl.int64)


@triton.jit
def from_fixed(acc):
    """int64 fixed point -> float32 (rounded to nearest once, then scaled exactly)."""
    return acc.to(tl.float32) * (1.0 / _ONE)


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, splits, numel, n, stride_om, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out [M, n] (rows stride_om apart) = partial [splits, M, n].sum(0) in out's dtype, the splits added in order
    (deterministic), one launch; int64 partials are fixed point."""
    wait_for_inputs(PDL)
    start_dependents(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < numel
    acc = tl.load(partial_ptr + i, mask=ok, other=0)
    for s in range(1, splits):
        acc += tl.load(partial_ptr + s * numel + i, mask=ok, other=0)
    if partial_ptr.dtype.element_ty == tl.int64:
        acc = from_fixed(acc)
    tl.store(out_ptr + (i // n) * stride_om + i % n, acc.to(out_ptr.dtype.element_ty), mask=ok)


def outputs(x: Tensor, n: int, splits: int, out: Tensor | None = None, summed: bool = True,
            exact: bool = False) -> tuple[Tensor | None, Tensor]:
    """(out [M, N] in x's dtype, partial [splits, M, N]): one split writes out itself, more write partial sums
    (float32, or exact: int64 fixed point). `out` may be given: columns of a wider output (rows strided).
    summed=False: (None, the partials, or for one split the product in x's dtype), for a caller that adds them
    itself (`add_splits`)."""
    if not summed:
        return None, torch.empty(splits, x.shape[0], n, device=x.device, dtype=partial_dtype(x, splits, exact))
    out = torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype) if out is None else out
    return out, out[None] if splits == 1 else torch.empty(splits, x.shape[0], n, device=x.device,
                                                          dtype=partial_dtype(x, splits, exact))


def partial_dtype(x: Tensor, splits: int, exact: bool = False) -> torch.dtype:
    """float32 or (exact) int64 fixed point for partial sums; one split is the product itself, in x's dtype (its
    reader reads half the bytes)."""
    return x.dtype if splits == 1 else torch.int64 if exact else torch.float32


def add_splits(partial: Tensor, dtype: torch.dtype) -> Tensor:
    """partial [splits, M, N] summed in split order, in dtype, as torch operations: inside a torch.compile graph
    they fuse into the kernel that reads the product (a residual add, a norm, a rotation) in place of a launch of
    their own (`finish`), with the same additions (float32, or exact in int64) and the same rounding."""
    out = partial[0]
    for s in range(1, partial.shape[0]):
        out = out + partial[s]
    if out.dtype == torch.int64:
        out = out.to(torch.float32) * (1.0 / FIXED_ONE)
    return out.to(dtype)


def finish(partial: Tensor, out: Tensor | None) -> None:
    """out = the splits' sum where K was split (partial [splits, M, N], out [M, N], its rows maybe strided); nothing
    for partials left to `add_splits` (out None)."""
    if out is not None and partial.shape[0] > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(out.numel(), block),)](partial, out, partial.shape[0], out.numel(),
                                                              out.shape[1], out.stride(0), BLOCK=block,
                                                              **pdl.launch(out))
