"""Attention with what a family varies made explicit (`AttentionSpec`: scale, softcap, window, causality), and
the dispatch between kernels: few query tokens (decode, verify and draft steps) over a cache, one slot's or a
batch of slots', take the split-K kernel of kernels/split_attention.py on a GPU with Triton, or two batched
matrix products elsewhere (CPU, head sizes that are not a power of two, FLASHDRAFT_ATTENTION=matmul); longer chunks
take SDPA."""
import importlib.util
import os
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SMALL_QUERY = 64  # up to this many query tokens a step takes the few-query path instead of SDPA
MAX_SPLIT_HEAD = 512  # Gemma's widest (its full layers); the kernel takes fewer keys per tile for heads past 128
KERNEL = os.environ.get("FLASHDRAFT_ATTENTION", "split")  # "split" or "matmul"; benchmarks switch it
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter runs the kernel on CPU tensors (tests)


# SDPA's kernels for prompts, cuDNN's left out: it builds and compiles a plan for every new sequence length (hundreds
# of ms each). A first start on an H100 ran each new prompt length at 34-152 tok/s and a repeated one at 600-1400
# (2026-12-06, docs/PERF.md, lease 5)
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa(q: Tensor, k: Tensor, v: Tensor, **kw) -> Tensor:
    """F.scaled_dot_product_attention over SDPA_BACKENDS (inside a compiled graph, as the compiler picks)."""
    if torch.compiler.is_compiling():
        return F.scaled_dot_product_attention(q, k, v, **kw)
    with sdpa_kernel(SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, **kw)


@dataclass(frozen=True)
class AttentionSpec:
    """What one attention layer computes: softmax(softcap(scale * q k^T) + mask) v. `window`: keys less than
    this many positions before the query (and after it, where the layer is not causal)."""
    scale: float
    softcap: float | None = None
    window: int | None = None
    causal: bool = True


def position_mask(query_pos: Tensor, key_pos: Tensor, is_causal: bool = True,
                  sliding_window: int | None = None) -> Tensor:
    """[..., Q, K] bool (True = attend) from absolute positions (leading dims broadcast): a causal layer sees keys
    at or before the query; a sliding window keeps keys less than `sliding_window` away (on both sides when the
    layer is not causal)."""
    offset = query_pos[..., :, None] - key_pos[..., None, :]
    mask = offset >= 0 if is_causal else torch.ones_like(offset, dtype=torch.bool)
    if sliding_window is not None:
        mask = mask & (offset < sliding_window)
        if not is_causal:
            mask = mask & (offset > -sliding_window)
    return mask


def spec_mask(spec: AttentionSpec, query_pos: Tensor, key_pos: Tensor) -> Tensor:
    return position_mask(query_pos, key_pos, spec.causal, spec.window)


def _softcap(scores: Tensor, softcap: float | None) -> Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def grouped_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float,
                      softcap: float | None = None) -> Tensor:
    """Attention reading each K/V row once: the query heads that share a KV head are stacked into one matrix
    product (no K/V repetition for GQA). q: [T, H, D]; keys/values: [KV, L, D]; mask: [T, L] bool. Returns [T, H*D]."""
    T, H, D = q.shape
    KV, L = keys.shape[0], keys.shape[1]
    G = H // KV
    qg = (q * scale).view(T, KV, G, D).permute(1, 2, 0, 3).reshape(KV, G * T, D)
    scores = _softcap(torch.bmm(qg, keys.transpose(1, 2)).view(KV, G, T, L).float(), softcap)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(values.dtype)
    out = torch.bmm(probs.view(KV, G * T, L), values)
    return out.view(KV, G, T, D).permute(2, 0, 1, 3).reshape(T, H * D)


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
                     softcap: float | None = None) -> Tensor:
    """Heads-first attention with an explicit mask: q [..., Hq, Q, D], k/v [..., Hkv, K, D], mask bool [..., Q, K]
    -> [..., Q, Hq * D]. GQA by folding each KV head's query group into the query length, so K/V are never
    repeated and any SDPA kernel that takes a mask can run it."""
    num_heads, q_len, head_dim = q.shape[-3:]
    num_kv_heads, k_len = k.shape[-3], k.shape[-2]
    groups = num_heads // num_kv_heads
    unbatched = q.dim() == 3
    if unbatched:  # the fused CUDA kernels only take 4-D inputs; 3-D falls back to the math path
        q, k, v = q[None], k[None], v[None]
        mask = None if mask is None else mask[None]
    q = q.unflatten(-3, (num_kv_heads, groups)).flatten(-3, -2)
    if mask is not None:
        mask = mask.unsqueeze(-3).expand(*mask.shape[:-2], groups, q_len, k_len).flatten(-3, -2).unsqueeze(-3)
    if softcap is None:
        out = sdpa(q, k, v, attn_mask=mask, scale=scale)
    else:
        scores = _softcap((q @ k.transpose(-1, -2)).float() * scale, softcap)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = scores.softmax(-1).to(v.dtype) @ v
    out = out.unflatten(-2, (groups, q_len)).flatten(-4, -3)  # [..., Hq, Q, D]
    out = out.transpose(-3, -2).flatten(-2)
    return out[0] if unbatched else out


def _load_split_kernel() -> bool:
    """Import the Triton kernel once, at import time (not inside a torch.compile trace)."""
    runnable = torch.cuda.is_available() or INTERPRETED
    if KERNEL != "split" or not runnable or importlib.util.find_spec("triton") is None:
        return False
    try:
        import flashdraft.kernels.split_attention  # noqa: F401  (registers torch.ops.flashdraft.split_attention)
    except Exception:
        return False
    return True


SPLIT_KERNEL_LOADED = _load_split_kernel()


def uses_split_kernel(q: Tensor) -> bool:
    """q: [T, H, D]."""
    return q.shape[0] <= SMALL_QUERY and split_kernel_takes(q.shape[-1], q.is_cuda)


def split_kernel_takes(head_dim: int, cuda: bool) -> bool:
    return (SPLIT_KERNEL_LOADED and KERNEL == "split" and (cuda or INTERPRETED) and 16 <= head_dim <= MAX_SPLIT_HEAD
            and head_dim & (head_dim - 1) == 0)


def reads_by_position(cache, cuda: bool) -> bool:
    """Whether a step's attention over this cache (layers.kv_cache.KVCache, not a window ring) takes the split
    kernel as attend_cache calls it, with the queries' positions: the kernel then splits the keys by the last
    position's bucket and reads none past it, so one launch over the whole cache serves every length."""
    return split_kernel_takes(cache.head_dim, cuda) and kernel_reads(cache.codecs, cache.head_dim, cuda)


def few_query_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float,
                        softcap: float | None = None) -> Tensor:
    """q: [T, H, D] (T <= SMALL_QUERY); keys/values: [KV, L, D]; mask: [T, L] bool (True = attend). Returns [T, H*D]."""
    if uses_split_kernel(q):
        return torch.ops.flashdraft.split_attention(q, keys, values, mask, scale, softcap or 0.0)
    return grouped_attention(q, keys, values, mask, scale, softcap)


def kernel_reads(codecs, head_dim: int, cuda: bool) -> bool:
    """Whether the split kernel reads this (K, V) storage directly. On the GPU (Triton 3.6) its V sums came out
    wrong for V in a 32-value nibble type (q4_0, q4_1, q5_0, q5_1, iq4_nl) at head sizes under 128 (right under
    the interpreter and at 128): such caches are expanded first there. The record of 2026-12-04 (H200,
    docs/perf-history.md) saw it only beside a K read in one plane (a float type or q8_0); until a GPU confirms
    that nibble K with nibble V reads right since the kernel's rewrites, both are expanded (the parametrized xfail
    GPU test in tests/test_split_attention.py tells the cases apart: after an XPASS, this rule may let that case
    through)."""
    v_codec = codecs[1]
    return not (cuda and head_dim < 128 and v_codec.qtype is not None and v_codec.name != "q8_0")


def attend_cache(q: Tensor, cache, length: int, mask: Tensor | None, spec: AttentionSpec,
                 positions: Tensor | None = None) -> Tensor:
    """q [B, T, H, D] over the first `length` rows of a cache view (layers.kv_cache.KVSlots); mask [B, T, length];
    positions [B, T]: the queries' positions (the last the largest) where row j of the cache holds position j and
    the mask hides every later key (the split kernel then reads no row past each batch row's last one, whatever the
    bucket). Given positions and no mask (a cache by position), the positions decide: a query attends the keys at or
    before it (spec.window: the last `window` of them). The split kernel reads the rows as stored (quantized types
    included: a rotated type's keys meet q in the rotated domain, and the output is rotated back), one slot's, or
    every batch row's slot in one launch; elsewhere the rows are expanded first."""
    kernel = split_kernel_reads(q, cache)
    if mask is None and positions is not None:
        if cache.window:
            raise ValueError("a window ring's rows are not positions: attending over it takes a mask")
        if cache.single or not kernel or not spec.causal:
            mask = spec_mask(spec, positions, torch.arange(length, device=q.device))
    if kernel and (mask is not None or positions is not None):
        from flashdraft.kernels.split_attention import ROW_TYPES
        keys, values = cache.stored(length)
        k_codec, v_codec = cache.codecs
        head = q.shape[-1]  # the kernel rotates q and the output itself
        stored = (ROW_TYPES.get(k_codec.name, 0), ROW_TYPES.get(v_codec.name, 0), v_codec.rotates(head),
                  k_codec.rotates(head))
        if cache.single:
            pos = None if positions is None else positions[0].contiguous()
            out = torch.ops.flashdraft.split_attention(q[0], keys, values, mask[0], spec.scale, spec.softcap or 0.0,
                                                       *stored, pos)
            return out[None]
        return torch.ops.flashdraft.split_attention_batch(q, keys, values, cache.index, mask, positions, spec.scale,
                                                          spec.softcap or 0.0, *stored, spec.window or 0)
    keys, values = cache.read(length, q.dtype)
    return attend(q, keys, values, mask, spec)


def split_kernel_reads(q: Tensor, cache) -> bool:
    """Whether attend_cache's q [B, T, H, D] over this cache view takes the split kernel: few query tokens, a head
    it takes, a V storage it reads, and one batch row per slot view (a batch over a range or a tensor of slots)."""
    return ((q.shape[0] == 1 or not cache.single) and q.shape[1] <= SMALL_QUERY and uses_split_kernel(q[0])
            and kernel_reads(cache.codecs, q.shape[-1], q.is_cuda))


def attend(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, spec: AttentionSpec) -> Tensor:
    """q [B, T, H, D] over keys/values [B, KV, L, D]; mask [B, T, L] bool, or None for plain causal attention over
    a chunk's own keys (L == T, a fresh prefill: flash kernels). Returns [B, T, H*D]."""
    B, T, H, _ = q.shape
    if mask is not None and T <= SMALL_QUERY and B == 1:
        return few_query_attention(q[0], keys[0], values[0], mask[0], spec.scale, spec.softcap)[None]
    if mask is None and spec.softcap is None:
        out = sdpa(q.transpose(1, 2), keys, values, is_causal=True, scale=spec.scale, enable_gqa=H != keys.shape[1])
        return out.transpose(1, 2).reshape(B, T, -1)
    if mask is None:
        positions = torch.arange(T, device=q.device)
        mask = position_mask(positions, positions)[None]
    return masked_attention(q.transpose(1, 2), keys, values, mask, spec.scale, spec.softcap)
