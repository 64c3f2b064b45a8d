"""Attention for a few query tokens (decode, verify and draft steps) over cached keys and values.

On a GPU with Triton it runs the split-K kernel of models/split_attention.py; elsewhere (CPU, odd head sizes, or
FLASHDRAFT_ATTENTION=matmul) two batched matrix products with the softmax between them.
"""
import importlib.util
import os

import torch
from torch import Tensor

SMALL_QUERY = 64  # up to this many query tokens a step takes this path instead of SDPA
KERNEL = os.environ.get("FLASHDRAFT_ATTENTION", "split")  # "split" or "matmul"; benchmarks switch it
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter runs the kernel on CPU tensors (tests)


def grouped_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """Attention reading each K/V row once: the query heads that share a KV head are stacked into one matrix
    product (no K/V repetition for GQA). q: [T, H, D]; keys/values: [KV, L, D]; mask: [T, L] bool. Returns [T, H*D]."""
    T, H, D = q.shape
    KV, L = keys.shape[0], keys.shape[1]
    G = H // KV
    qg = (q * D ** -0.5).view(T, KV, G, D).permute(1, 2, 0, 3).reshape(KV, G * T, D)
    scores = torch.bmm(qg, keys.transpose(1, 2)).view(KV, G, T, L).float()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(values.dtype)
    out = torch.bmm(probs.view(KV, G * T, L), values)
    return out.view(KV, G, T, D).permute(2, 0, 1, 3).reshape(T, H * D)


def _load_split_kernel() -> bool:
    """Import the Triton kernel once, at import time (not inside a torch.compile trace)."""
    runnable = torch.cuda.is_available() or INTERPRETED
    if KERNEL != "split" or not runnable or importlib.util.find_spec("triton") is None:
        return False
    try:
        import flashdraft.models.split_attention  # noqa: F401  (registers torch.ops.flashdraft.split_attention)
    except Exception:
        return False
    return True


SPLIT_KERNEL_LOADED = _load_split_kernel()


def uses_split_kernel(q: Tensor) -> bool:
    D = q.shape[-1]
    return (SPLIT_KERNEL_LOADED and KERNEL == "split" and (q.is_cuda or INTERPRETED) and q.shape[0] <= SMALL_QUERY
            and D >= 16 and D & (D - 1) == 0)


def few_query_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """q: [T, H, D] (T <= SMALL_QUERY); keys/values: [KV, L, D]; mask: [T, L] bool (True = attend). Returns [T, H*D]."""
    if uses_split_kernel(q):
        return torch.ops.flashdraft.split_attention(q, keys, values, mask)
    return grouped_attention(q, keys, values, mask)
