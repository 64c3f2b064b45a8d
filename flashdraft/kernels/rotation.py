"""The rotated KV types' rotation (layers/kv_quant.rotation: an orthogonal R per group of G values of a head) in
Triton, for CUDA: `rotate_rows` takes a query into the rotated domain, or an attention output back, in one launch
where torch took three per call (a float copy, a batched product, a cast back), and `rotated_group` is the
product inside the turbo write kernel (kernels/kv_quantize.py). Each program holds one row's groups and forms
every product x_i R[j, i] of a group at once (G <= 128: 16k values over its threads), summed along i.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

from flashdraft.kernels import pdl
from flashdraft.kernels.pdl import start_dependents, wait_for_inputs
from flashdraft.layers.kv_quant import rotation, rotation_group


@triton.jit
def rotated_group(x, r_ptr, G: tl.constexpr, INVERSE: tl.constexpr):
    """Groups x [N, G] float32 -> x R^T (each group times R transposed: into the rotated domain) or, INVERSE, x R
    (back), as layers/kv_quant.rotate; r_ptr: R [G, G] float32, row-major."""
    j = tl.arange(0, G)[:, None]  # output coordinate
    i = tl.arange(0, G)[None, :]  # input coordinate
    r = tl.load(r_ptr + (i * G + j if INVERSE else j * G + i))  # [G (j), G (i)]
    return tl.sum(x[:, None, :] * r[None, :, :], axis=2)


@triton.jit
def _rotate_kernel(x_ptr, r_ptr, out_ptr, stride_xt, stride_xh, stride_ot, stride_oh, H, N: tl.constexpr,
                   G: tl.constexpr, INVERSE: tl.constexpr, PDL: tl.constexpr):
    start_dependents(PDL)
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    t, h = row // H, row % H
    at = tl.arange(0, N)[:, None] * G + tl.arange(0, G)[None, :]
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + at).to(tl.float32)
    y = rotated_group(x, r_ptr, G, INVERSE)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + at, y.to(out_ptr.dtype.element_ty))


def rotation_warps(head_dim: int, group: int) -> int:
    """Warps for a program that rotates one head of head_dim values in groups (all G x G products of each group at
    once): 4 for small groups, else 8 per group up to 16 (Triton 3.6, sm_90: 80-160 registers a thread, no spills;
    Gemma 4's 512-value heads took 255 at 8 warps)."""
    return 4 if group <= 64 else min(16, 8 * (head_dim // group))


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
        _rotate_kernel[(t * h,)](x, rotation(g, x.device), out, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
                                 h, N=d // g, G=g, INVERSE=inverse, num_warps=rotation_warps(d, g), **pdl.launch(x))
    return out


@rotate_rows.register_fake
def _(x: Tensor, inverse: bool = False) -> Tensor:
    return x.new_empty(x.shape)
