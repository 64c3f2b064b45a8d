"""K split across programs and summed: the products for a few rows of x (gguf_gemv, gguf_mma, gguf_matmul) give a
small output too few programs, so each program takes a split of K and writes float32 partial sums, which one more
launch (`finish`) adds in split order (deterministic: a token's bits do not depend on timing), or, inside a
torch.compile graph, the graph's own additions (`add_splits`: fused into the kernel that reads the product).

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


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, splits, numel, n, stride_om, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out [M, n] (rows stride_om apart) = partial [splits, M, n].sum(0) in out's dtype, the splits added in order
    (deterministic), one launch."""
    wait_for_inputs(PDL)
    start_dependents(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < numel
    acc = tl.load(partial_ptr + i, mask=ok, other=0.0)
    for s in range(1, splits):
        acc += tl.load(partial_ptr + s * numel + i, mask=ok, other=0.0)
    tl.store(out_ptr + (i // n) * stride_om + i % n, acc.to(out_ptr.dtype.element_ty), mask=ok)


def outputs(x: Tensor, n: int, splits: int, out: Tensor | None = None,
            summed: bool = True) -> tuple[Tensor | None, Tensor]:
    """(out [M, N] in x's dtype, partial [splits, M, N]): one split writes out itself, more write float32 partial
    sums. `out` may be given: columns of a wider output (rows strided). summed=False: (None, the partials: float32,
    or for one split the product in x's dtype), for a caller that adds them itself (`add_splits`)."""
    if not summed:
        return None, torch.empty(splits, x.shape[0], n, device=x.device, dtype=partial_dtype(x, splits))
    out = torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype) if out is None else out
    return out, out[None] if splits == 1 else torch.empty(splits, x.shape[0], n, device=x.device, dtype=torch.float32)


def partial_dtype(x: Tensor, splits: int) -> torch.dtype:
    """float32 for partial sums; one split is the product itself, in x's dtype (its reader reads half the bytes)."""
    return torch.float32 if splits > 1 else x.dtype


def add_splits(partial: Tensor, dtype: torch.dtype) -> Tensor:
    """partial [splits, M, N] summed in split order (float32), in dtype, as torch operations: inside a torch.compile
    graph they fuse into the kernel that reads the product (a residual add, a norm, a rotation) in place of a launch
    of their own (`finish`), with the same float32 additions in the same order."""
    out = partial[0]
    for s in range(1, partial.shape[0]):
        out = out + partial[s]
    return out.to(dtype)


def finish(partial: Tensor, out: Tensor | None) -> None:
    """out = the splits' sum where K was split (partial [splits, M, N], out [M, N], its rows maybe strided); nothing
    for partials left to `add_splits` (out None)."""
    if out is not None and partial.shape[0] > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(out.numel(), block),)](partial, out, partial.shape[0], out.numel(),
                                                              out.shape[1], out.stride(0), BLOCK=block,
                                                              **pdl.launch(out))
