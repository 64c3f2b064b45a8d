"""The rotated KV types' rotation (quant/kv_types.rotation: R = H diag(s) / sqrt(G) per group of G values of a head,
H the Sylvester Hadamard matrix, s fixed random signs) in Triton, for CUDA: `rotate_rows` takes a query into the
rotated domain, or an attention output back, in one launch where torch took three per call (a float copy, a
batched product, a cast back), and `rotated_group` is the rotation inside the write and merge kernels. Both
apply H by the fast transform (log2 G stages of G additions) instead of the G x G product, whose 64 KB matrix
every program loaded (H200 profile, 8B shape: the merge kernel took 6.8 us per decode layer against 2.7 unrotated).
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

from flashdraft.kernels import pdl
from flashdraft.kernels.pdl import start_dependents, wait_for_inputs
from flashdraft.quant.kv_types import rotation_group, rotation_signs


@triton.jit
def hadamard(x, G: tl.constexpr):
    """Groups x [N, G] (G a power of two up to 256) -> each times H (symmetric, unnormalised), float32: log2 G
    stages of Pease's form of the fast transform (pairs 2k, 2k + 1 -> their sum at k, difference at k + G / 2)."""
    N: tl.constexpr = x.shape[0]
    for i in tl.static_range(8):
        if (2 << i) <= G:
            a, b = tl.split(tl.reshape(x, [N, G // 2, 2]))
            x = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 2, 1]), [N, G])
    return x


@triton.jit
def rotated_group(x, signs_ptr, G: tl.constexpr, INVERSE: tl.constexpr):
    """Groups x [N, G] float32 -> x R^T (into the rotated domain) or, INVERSE, x R (back), as layers/kv_quant.rotate
    up to float32 rounding; signs_ptr: kv_types.rotation_signs (s / sqrt(G))."""
    s = tl.load(signs_ptr + tl.arange(0, G))[None, :]
    if INVERSE:
        return hadamard(x, G) * s
    return hadamard(x * s, G)


@triton.jit
def _rotate_kernel(x_ptr, signs_ptr, out_ptr, stride_xt, stride_xh, stride_ot, stride_oh, H, N: tl.constexpr,
                   G: tl.constexpr, INVERSE: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    start_dependents(PDL)
    row = tl.program_id(0)
    t, h = row // H, row % H
    at = tl.arange(0, N)[:, None] * G + tl.arange(0, G)[None, :]
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + at).to(tl.float32)
    y = rotated_group(x, signs_ptr, G, INVERSE)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + at, y.to(out_ptr.dtype.element_ty))


# custom ops (here and in kv_quantize.py): torch.compile cannot read the PDL instructions' inline assembly to find
# what a raw Triton launch writes, and then takes every input as written (copies around each launch)
@torch.library.custom_op("flashdraft::rotate_rows", mutates_args=())
def rotate_rows(x: Tensor, inverse: bool = False) -> Tensor:
    """x [T, H, D] (D contiguous) -> each head's groups times R^T (or R, inverse) in x's dtype, as
    layers/kv_quant.rotate (float32 products, summed in another order)."""
    t, h, d = x.shape
    g = rotation_group(d)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(t, h, d, device=x.device, dtype=x.dtype)
    if t * h:
        _rotate_kernel[(t * h,)](x, rotation_signs(g, x.device), out, x.stride(0), x.stride(1), out.stride(0),
                                 out.stride(1), h, N=d // g, G=g, INVERSE=inverse, **pdl.launch(x))
    return out


@rotate_rows.register_fake
def _(x: Tensor, inverse: bool = False) -> Tensor:
    return x.new_empty(x.shape)
