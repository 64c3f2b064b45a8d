"""New K/V rows quantized in one kernel per write (CUDA): llama.cpp's q8_0, q4_0, q4_1, q5_0 and q5_1 with the same
rounding as quant/kv_types.py's torch quantizers (and so the gguf package's), and iq4_nl with its levels (the
scale's least-squares refit sums 32 products in another order than torch's, so its fp16 scale may differ by an
ulp), written straight into the planar row layout the cache stores (every block's quants, then scales, then mins,
then fifth bits); and the rotated turbo3/turbo4 rows: norms, rotation (kernels/rotation.py), codes, scales and
packing in one kernel. The torch path takes ~30 small kernels per row batch; inside a decode step's graph that
was ~2 ms over a 32-layer model (docs/perf-history.md, 2026-12-04 H200)."""
import torch
import triton
import triton.language as tl
from torch import Tensor

from flashdraft.kernels import pdl
from flashdraft.kernels.iq4 import iq4_value
from flashdraft.kernels.pdl import start_dependents, wait_for_inputs
from flashdraft.kernels.split_attention import ROW_TYPES
from flashdraft.kernels.rotation import rotated_group
from flashdraft.quant.kv_types import KERNEL_QUANTIZED, KVFormat, rotation_group, rotation_signs, table

TYPE_IDS = {name: ROW_TYPES[name] for name in KERNEL_QUANTIZED}


@triton.jit
def _store_half(ptr, value):
    """fp16 of float32 `value` [NB] as two little-endian bytes at byte pointers ptr [NB]."""
    bits = value.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    tl.store(ptr, (bits & 0xFF).to(tl.uint8))
    tl.store(ptr + 1, (bits >> 8).to(tl.uint8))


@triton.jit
def _div(a, b):
    """a / b rounded as IEEE division (Triton's `/` on float32 is the approximate div.full.f32 on NVIDIA GPUs: a
    scale an ulp off moves values that sit on a rounding midpoint, and the rows would differ from the torch
    quantizers')."""
    return tl.math.div_rn(a, tl.full(a.shape, b, tl.float32))


@triton.jit
def _inverse(d):
    """1 / d, 0 where d is 0 (IEEE-rounded, see _div)."""
    return tl.where(d != 0, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), tl.where(d != 0, d, 1.0)), 0.0)


@triton.jit
def _iq4_nl_blocks(x, i):
    """Blocks x [NB, 32] -> (level indices [NB, 32] int32, scales [NB]) as quant/kv_types._quantize_iq4_nl: the
    scale from the first value of largest magnitude, each value to the nearest level (a tie to the upper one), then
    the least-squares scale for those levels weighted by x^2."""
    first = tl.argmax(tl.abs(x), axis=1, tie_break_left=True)
    d = _div(tl.sum(tl.where(i[None, :] == first[:, None], x, 0.0), axis=1), -127.0)
    inv = _inverse(d)
    v = x * inv[:, None]
    n = tl.zeros_like(v).to(tl.int32)  # levels <= v (a binary search over the 16 sorted levels)
    for step in tl.static_range(3, -1, -1):
        probe = n + (1 << step)
        n = tl.where(iq4_value(probe - 1) <= v, probe, n)
    upper = tl.minimum(tl.maximum(n, 1), 15)
    idx = tl.where(v - iq4_value(upper - 1) < iq4_value(upper) - v, upper - 1, upper)
    idx = tl.where(v <= -127.0, 0, tl.where(v >= 113.0, 15, idx))
    level = iq4_value(idx)
    w = x * x
    sumqx = tl.sum(w * level * x, axis=1)
    sumq2 = tl.sum(w * level * level, axis=1)
    d = tl.where(sumq2 > 0, sumqx / tl.where(sumq2 > 0, sumq2, 1.0), d)
    return idx, d


@triton.jit
def _load_blocks(x_row, s_row, signs_ptr, D: tl.constexpr, G: tl.constexpr, SHIFT: tl.constexpr):
    """One row's D values (float32 [D / 32, 32]), less its head's shift at s_row where SHIFT; G > 0: each group of G
    values rotated (x R^T, R's signs at signs_ptr: quant/kv_types.ROTATE_BLOCKS)."""
    NB: tl.constexpr = D // 32
    if G > 0:
        j = tl.arange(0, G)
        at = tl.arange(0, D // G)[:, None] * G + j[None, :]
        groups = tl.load(x_row + at).to(tl.float32)
        if SHIFT:
            groups -= tl.load(s_row + at)
        x = tl.reshape(rotated_group(groups, signs_ptr, G, False), [NB, 32])
    else:
        at = tl.arange(0, NB)[:, None] * 32 + tl.arange(0, 32)[None, :]
        x = tl.load(x_row + at).to(tl.float32)  # [NB, 32]
        if SHIFT:
            x -= tl.load(s_row + at)
    return x


@triton.jit
def _store_blocks(x, out, TYPE: tl.constexpr, D: tl.constexpr):
    """Blocks x [D / 32, 32] float32 -> their stored planar row at byte pointer `out`."""
    NB: tl.constexpr = D // 32
    b = tl.arange(0, NB)
    i = tl.arange(0, 32)
    if TYPE == 8:
        d = _div(tl.max(tl.abs(x), axis=1), 127.0)
        inv = _inverse(d)
        v = x * inv[:, None]
        q = tl.where(v < 0, -tl.floor(-v + 0.5), tl.floor(v + 0.5)).to(tl.int32)
        tl.store(out + b[:, None] * 32 + i[None, :], (q & 0xFF).to(tl.uint8))
        _store_half(out + D + 2 * b, d)
    else:
        HAS_MIN: tl.constexpr = TYPE == 3 or TYPE == 7
        FIVE: tl.constexpr = TYPE == 6 or TYPE == 7
        if TYPE == 20:
            q, d = _iq4_nl_blocks(x, i)
        elif HAS_MIN:
            TOP: tl.constexpr = 31.0 if FIVE else 15.0
            lo = tl.min(x, axis=1)
            d = _div(tl.max(x, axis=1) - lo, TOP)
            inv = _inverse(d)
            q = tl.floor((x - lo[:, None]) * inv[:, None] + 0.5)
            q = tl.minimum(tl.maximum(q, 0.0), TOP).to(tl.int32)
        else:
            LEVELS: tl.constexpr = 16.0 if FIVE else 8.0
            ax = tl.abs(x)
            first = tl.argmax(ax, axis=1, tie_break_left=True)  # the first value of largest magnitude, sign kept
            vmax = tl.sum(tl.where(i[None, :] == first[:, None], x, 0.0), axis=1)
            d = _div(vmax, -LEVELS)
            inv = _inverse(d)
            v = x * inv[:, None] + (LEVELS + 0.5)
            q = tl.where(v < 0, -tl.floor(-v), tl.floor(v))  # trunc
            q = tl.minimum(tl.maximum(q, 0.0), 2 * LEVELS - 1).to(tl.int32)
        # byte j of block b: value j in the low nibble, value j + 16 in the high one
        j = tl.arange(0, 16)
        low = tl.sum(tl.where(i[None, None, :] == j[None, :, None], q[:, None, :], 0), axis=2)  # [NB, 16]
        high = tl.sum(tl.where(i[None, None, :] == j[None, :, None] + 16, q[:, None, :], 0), axis=2)
        tl.store(out + b[:, None] * 16 + j[None, :], ((low & 15) | ((high & 15) << 4)).to(tl.uint8))
        _store_half(out + D // 2 + 2 * b, d)
        if HAS_MIN:
            _store_half(out + D // 2 + 2 * NB + 2 * b, lo)
        if FIVE:  # 32 fifth bits per block, bit i for value i, little-endian
            bits = ((q >> 4) & 1) << i[None, :]
            word = tl.sum(bits, axis=1)
            at = out + D // 2 + 2 * NB * (1 + HAS_MIN) + 4 * b
            for k in tl.static_range(4):
                tl.store(at + k, ((word >> (8 * k)) & 0xFF).to(tl.uint8))


@triton.jit
def _quantize_kernel(x_ptr, s_ptr, signs_ptr, out_ptr, stride_x, stride_o, heads, TYPE: tl.constexpr, D: tl.constexpr,
                     G: tl.constexpr, SHIFT: tl.constexpr, PDL: tl.constexpr):
    """One row of D values -> its stored planar row; SHIFT: the row's head's shift (float32 [heads, D] at s_ptr)
    subtracted first; G > 0: each group of G values rotated."""
    wait_for_inputs(PDL)
    start_dependents(PDL)
    row = tl.program_id(0)
    x = _load_blocks(x_ptr + row * stride_x, s_ptr + (row % heads) * D, signs_ptr, D, G, SHIFT)
    _store_blocks(x, out_ptr + row * stride_o, TYPE, D)


@triton.jit
def _write_kernel(k_ptr, v_ptr, pos_ptr, s_ptr, signs_ptr, kc_ptr, vc_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                  stride_kch, stride_kcr, stride_vch, stride_vcr, heads, K_TYPE: tl.constexpr, V_TYPE: tl.constexpr,
                  D: tl.constexpr, K_G: tl.constexpr, V_G: tl.constexpr, SHIFT: tl.constexpr, PDL: tl.constexpr):
    """A step's new K and V rows [T, heads, D] quantized into the cache rows of their positions (program (t * heads
    + h, 0) writes K, (.., 1) V): one launch for both instead of two quantizations and two row copies."""
    wait_for_inputs(PDL)
    start_dependents(PDL)
    t = tl.program_id(0) // heads
    h = tl.program_id(0) % heads
    pos = tl.load(pos_ptr + t).to(tl.int64)
    if tl.program_id(1) == 0:
        x = _load_blocks(k_ptr + t * stride_kt + h * stride_kh, s_ptr + h * D, signs_ptr, D, K_G, SHIFT)
        _store_blocks(x, kc_ptr + h * stride_kch + pos * stride_kcr, K_TYPE, D)
    else:
        x = _load_blocks(v_ptr + t * stride_vt + h * stride_vh, s_ptr, signs_ptr, D, V_G, False)
        _store_blocks(x, vc_ptr + h * stride_vch + pos * stride_vcr, V_TYPE, D)


@torch.library.custom_op("flashdraft::quantize_rows", mutates_args=())
def quantize_rows(x: Tensor, name: str, rotated: bool = False, shift: Tensor | None = None) -> Tensor:
    """Rows [..., D] (D a multiple of 32, a power-of-two block count) -> stored planar rows [..., row bytes];
    shift (float32 [heads, D], contiguous): subtracted first from rows x [..., heads, D] (layers/kv_cache's key
    shift); rotated: each
    head's groups rotated, as layers/kv_quant.rotate (float32 products summed in another order, so a value on a
    rounding boundary may take the next level)."""
    d = x.shape[-1]
    flat = x.reshape(-1, d)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty(flat.shape[0], KVFormat(name, x.dtype).row_size(d), device=x.device, dtype=torch.uint8)
    g = rotation_group(d) if rotated else 0
    r = rotation_signs(g, x.device) if rotated else out  # (any pointer when not rotated)
    if flat.shape[0]:
        _quantize_kernel[(flat.shape[0],)](flat, out if shift is None else shift, r, out, flat.stride(0), out.stride(0),
                                           x.shape[-2] if shift is not None else 1, TYPE=TYPE_IDS[name], D=d, G=g,
                                           SHIFT=shift is not None,
                                           **pdl.launch(x))
    return out.reshape(*x.shape[:-1], -1)


@triton.jit
def _rotated_kernel(x_ptr, s_ptr, signs_ptr, mids_ptr, levels_ptr, search_ptr, out_ptr, stride_x, stride_o, heads,
                    N: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, SEARCH: tl.constexpr, SHIFT: tl.constexpr,
                    PDL: tl.constexpr):
    """One row's N groups x [N, G] (less its head's shift where SHIFT, as _quantize_kernel) -> rotated (x R^T),
    each group's norm kept aside; for each of the SEARCH inverse scales at search_ptr, codes (how many level
    midpoints lie below each coordinate of the unit group times it, as torch.bucketize), the group keeping the
    best fit as quant/kv_types.quantize_rotated; codes packed in the row's planes, then each group's fp16 scale
    norm / |levels[codes]|."""
    wait_for_inputs(PDL)
    start_dependents(PDL)
    row = tl.program_id(0)
    gi = tl.arange(0, N)
    j = tl.arange(0, G)
    x = tl.load(x_ptr + row * stride_x + gi[:, None] * G + j[None, :]).to(tl.float32)
    if SHIFT:
        x -= tl.load(s_ptr + (row % heads) * (N * G) + gi[:, None] * G + j[None, :])
    norm = tl.sqrt(tl.sum(x * x, axis=1))
    to_unit = tl.where(norm != 0, tl.sqrt(G * 1.0) / tl.where(norm != 0, norm, 1.0), 0.0)
    z = rotated_group(x, signs_ptr, G, False) * to_unit[:, None]
    codes = tl.zeros([N, G], tl.int32)
    best = tl.full([N], float("-inf"), tl.float32)
    length2 = tl.zeros([N], tl.float32)  # |levels[codes]|^2 of the codes kept
    for s in range(SEARCH):
        zs = z * tl.load(search_ptr + s)
        trial = tl.zeros([N, G], tl.int32)
        for k in tl.static_range((1 << BITS) - 1):
            trial += (tl.load(mids_ptr + k) < zs).to(tl.int32)
        level = tl.load(levels_ptr + trial)
        dot = tl.sum(z * level, axis=1)
        trial_length2 = tl.sum(level * level, axis=1)
        fit = dot * tl.abs(dot) / trial_length2
        better = fit > best
        codes = tl.where(better[:, None], trial, codes)
        best = tl.where(better, fit, best)
        length2 = tl.where(better, trial_length2, length2)
    length = tl.sqrt(length2)
    scale = norm * tl.where(length != 0, 1.0 / tl.where(length != 0, length, 1.0), 0.0)
    CODE_BYTES: tl.constexpr = G * BITS // 8
    out = out_ptr + row * stride_o + gi[:, None] * CODE_BYTES
    if BITS == 4:  # value c: byte c % (G/2), the high nibble for the second half
        halves = tl.permute(tl.reshape(codes, [N, 2, G // 2]), [0, 2, 1])
        packed = tl.sum(halves << (4 * tl.arange(0, 2))[None, None, :], axis=2)
        tl.store(out + tl.arange(0, G // 2)[None, :], packed.to(tl.uint8))
    else:  # 2-bit planes (value c: byte c % (G/4), bits 2 (c // (G/4))), then a bit plane (byte c % (G/8))
        low = tl.permute(tl.reshape(codes & 3, [N, 4, G // 4]), [0, 2, 1])
        tl.store(out + tl.arange(0, G // 4)[None, :],
                 tl.sum(low << (2 * tl.arange(0, 4))[None, None, :], axis=2).to(tl.uint8))
        high = tl.permute(tl.reshape(codes >> 2, [N, 8, G // 8]), [0, 2, 1])
        tl.store(out + G // 4 + tl.arange(0, G // 8)[None, :],
                 tl.sum(high << tl.arange(0, 8)[None, None, :], axis=2).to(tl.uint8))
    _store_half(out_ptr + row * stride_o + N * CODE_BYTES + 2 * gi, scale)


@torch.library.custom_op("flashdraft::quantize_rotated_rows", mutates_args=())
def quantize_rotated_rows(x: Tensor, bits: int, shift: Tensor | None = None) -> Tensor:
    """Rows [..., D] -> stored turbo rows [..., row bytes] in one kernel (shift: as quantize_rows): the norms, the
    rotation (float32 sums in another order than torch's, so a coordinate on a level midpoint may take
    the other code, and two scales that fit a group equally well the other one), the codes, the scales and the
    packing."""
    d = x.shape[-1]
    g = rotation_group(d)
    flat = x.reshape(-1, d)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows = flat.shape[0]
    out = torch.empty(rows, KVFormat(f"turbo{bits}", x.dtype).row_size(d), device=x.device, dtype=torch.uint8)
    search = table("search", 0, x.device)
    if rows:
        _rotated_kernel[(rows,)](flat, out if shift is None else shift, rotation_signs(g, x.device),
                                 table("midpoints", bits, x.device), table("levels", bits, x.device), search, out,
                                 flat.stride(0), out.stride(0), x.shape[-2] if shift is not None else 1, N=d // g, G=g,
                                 BITS=bits, SEARCH=search.numel(), SHIFT=shift is not None,
                                 **pdl.launch(x))
    return out.reshape(*x.shape[:-1], -1)


@quantize_rows.register_fake
def _(x: Tensor, name: str, rotated: bool = False, shift: Tensor | None = None) -> Tensor:
    return x.new_empty(*x.shape[:-1], KVFormat(name, x.dtype).row_size(x.shape[-1]), dtype=torch.uint8)


@quantize_rotated_rows.register_fake
def _(x: Tensor, bits: int, shift: Tensor | None = None) -> Tensor:
    return x.new_empty(*x.shape[:-1], KVFormat(f"turbo{bits}", x.dtype).row_size(x.shape[-1]), dtype=torch.uint8)


@torch.library.custom_op("flashdraft::write_kv_rows", mutates_args=("k_cache", "v_cache"))
def write_kv_rows(k_cache: Tensor, v_cache: Tensor, positions: Tensor, k: Tensor, v: Tensor, k_type: str,
                  v_type: str, k_rotated: bool, v_rotated: bool, shift: Tensor | None) -> None:
    """New rows k/v [T, heads, D] (last axis contiguous) quantized into one slot's stored rows k_cache/v_cache
    [heads, rows, row bytes] at positions [T], in one launch; the block types of KERNEL_QUANTIZED, as quantize_rows
    writes them (shift: subtracted from the keys first)."""
    t, heads, d = k.shape
    if t == 0:
        return
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    rotated = k_rotated or v_rotated
    g = rotation_group(d) if rotated else 0
    _write_kernel[(t * heads, 2)](k, v, positions, k_cache if shift is None else shift,
                                  rotation_signs(g, k.device) if rotated else k_cache, k_cache, v_cache, k.stride(0),
                                  k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
                                  v_cache.stride(0), v_cache.stride(1), heads, K_TYPE=TYPE_IDS[k_type],
                                  V_TYPE=TYPE_IDS[v_type], D=d, K_G=g if k_rotated else 0, V_G=g if v_rotated else 0,
                                  SHIFT=shift is not None,
                                  **pdl.launch(k))


@write_kv_rows.register_fake
def _(k_cache, v_cache, positions, k, v, k_type, v_type, k_rotated, v_rotated, shift) -> None:
    return None
