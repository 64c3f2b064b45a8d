"""KV codecs: rows [..., head_dim] turned into what the cache stores and back, as quant/kv_types.py lays the stored
rows out; CUDA rows through the kernels (kernels/kv_quantize.py writes them, kernels/rotation.py rotates them)."""
import os

import torch
from gguf import GGML_QUANT_SIZES
from torch import Tensor

from flashdraft.quant import kv_types
from flashdraft.quant.dequant import BLOCK_DEQUANTISERS
from flashdraft.quant.kv_types import (KV_CACHE_TYPES, blocks_to_row, quantize_blocks, quantize_rotated, rotation,
                                       rotation_group)

# Quantized keys are stored minus the model's mean key (layers/kv_cache.py, models/decoder.key_shifts): Qwen2.5-0.5B,
# q8_0 keys, llama-perplexity's protocol: KL 2.07e-3 with the rotation alone (docs/perf-history.md,
# 2026-12-04 CPU). FLASHDRAFT_KV_SHIFT=0 turns it off.
SHIFT_KEYS = os.environ.get("FLASHDRAFT_KV_SHIFT", "1") != "0"


def rotate(x: Tensor, inverse: bool = False) -> Tensor:
    """x [..., D] -> each group of its last dimension times R (into a rotated type's domain) or R^T (back)."""
    if x.is_cuda:  # one kernel (a query or an attention output [T, H, D] as it is)
        from flashdraft.kernels.rotation import rotate_rows
        return rotate_rows(x if x.dim() == 3 else x.reshape(-1, 1, x.shape[-1]), inverse).reshape(x.shape)
    group = rotation_group(x.shape[-1])
    r = rotation(group, x.device)
    groups = x.float().unflatten(-1, (-1, group))
    return (groups @ (r if inverse else r.T)).flatten(-2).to(x.dtype)


class KVCodec(kv_types.KVFormat):
    """A KV type (quant/kv_types.KVFormat) with its conversions: `encode` rows into the stored bytes, `decode` them
    back."""

    def encode(self, x: Tensor, shift: Tensor | None = None) -> Tensor:
        """Rows [..., head_dim] -> stored [..., row_size] (planar rows: quant/kv_types.py). shift [heads, head_dim]
        (a packed type's, float32): subtracted first from rows [..., heads, head_dim] (layers/kv_cache's key
        shift). On CUDA one kernel does it all (kernels/kv_quantize.py) instead of ~30 torch ops."""
        head_dim = x.shape[-1]
        if not self.packed:
            return x.to(self.storage_dtype)
        if x.is_cuda:
            from flashdraft.kernels import kv_quantize
            if self.bits is not None:
                return kv_quantize.quantize_rotated_rows(x, self.bits, shift)
            if self.kernel_writes(head_dim):
                return kv_quantize.quantize_rows(x, self.name, self.rotates(head_dim), shift)
        x = x.float() if shift is None else x.float() - shift
        if self.bits is not None:
            group = rotation_group(head_dim)
            codes, scales = quantize_rotated(x.reshape(-1, group), self.bits)
            n = head_dim // group
            rows = torch.cat([codes.reshape(-1, n * codes.shape[-1]), scales.reshape(-1, 2 * n)], -1)
            return rows.reshape(*x.shape[:-1], -1)
        if self.rotates(head_dim):
            x = rotate(x)  # (in float32: a bf16 copy would round as coarsely as q8_0 does)
        block, _ = GGML_QUANT_SIZES[self.qtype]
        raw = quantize_blocks(x.reshape(-1, block), self.qtype)
        return blocks_to_row(raw.reshape(-1, head_dim // block, raw.shape[-1]), self.qtype).reshape(
            *x.shape[:-1], -1)

    def decode(self, stored: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """Stored [..., row_size] -> rows [..., head_dim] in `dtype` (default: the stored float type)."""
        if self.bits is not None:
            return rotate(self.decode_rotated(stored), inverse=True).to(dtype or self.dtype)
        if self.qtype is None:
            return stored if dtype is None else stored.to(dtype)
        _, size = GGML_QUANT_SIZES[self.qtype]
        values = BLOCK_DEQUANTISERS[self.qtype](self.to_blocks(stored).reshape(-1, size))
        values = values.reshape(*stored.shape[:-1], -1)
        if self.rotates(values.shape[-1]):
            values = rotate(values.float(), inverse=True)
        return values.to(dtype or self.dtype)


def kv_codecs(cache_types: tuple[str, str] | None, dtype: torch.dtype) -> tuple[KVCodec, KVCodec]:
    """(K codec, V codec); None or "auto": the model's dtype."""
    names = cache_types or ("auto", "auto")
    for name in names:
        if name != "auto" and name not in KV_CACHE_TYPES:
            raise ValueError(f"unknown KV cache type {name!r} (supported: {', '.join(KV_CACHE_TYPES)})")
    return KVCodec(names[0], dtype), KVCodec(names[1], dtype)
