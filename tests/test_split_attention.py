"""The split-K Triton attention kernel against the matmul reference, on the CPU through Triton's interpreter
(float32: the interpreter's bf16 matrix product is not exact) and, where a GPU is present, natively in bf16.
Also runnable as a script: `python tests/test_split_attention.py cuda`."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

# (query tokens, query heads, KV heads, head size, keys): GQA groups of 1-4, one-token decode to 16-token verify,
# key counts off the 64-key block, and enough blocks that a split walks several
CASES = [(1, 8, 2, 16, 37), (5, 9, 3, 64, 300), (16, 8, 8, 32, 1000), (16, 32, 8, 128, 200), (1, 4, 1, 64, 3000),
         (16, 4, 4, 16, 4200)]


def check(device: str, dtype: torch.dtype, tol: float) -> None:
    from flashdraft.models.attention import grouped_attention
    from flashdraft.models.split_attention import split_attention
    gen = torch.Generator().manual_seed(0)
    for T, H, KV, D, L in CASES:
        qkv = torch.randn(T, H + 2 * KV, D, generator=gen).to(device, dtype)
        q = qkv[:, :H]  # a strided view, as the fused QKV projection hands it over
        k_cache = torch.randn(KV, L + 50, D, generator=gen).to(device, dtype)
        v_cache = torch.randn(KV, L + 50, D, generator=gen).to(device, dtype)
        k, v = k_cache[:, :L], v_cache[:, :L]
        positions = torch.arange(L - T, L)
        mask = (torch.arange(L)[None, :] <= positions[:, None]) & (torch.rand(T, L, generator=gen) > 0.3)
        mask[:, L - T:] |= torch.eye(T, dtype=torch.bool)
        if L > 1000:  # only the last keys: most splits see no key at all
            mask[:, : L - 100] = False
        mask = mask.to(device)
        out = split_attention(q, k, v, mask)
        ref = grouped_attention(q.float(), k.float(), v.float(), mask)
        assert out.shape == (T, H * D) and out.dtype == dtype
        err = (out.float() - ref).abs().max().item()
        assert err < tol, f"case {(T, H, KV, D, L)}: max error {err}"
        # the draft's layout: heads-first queries, transposed to [T, H, D]
        out_t = split_attention(q.transpose(0, 1).contiguous().transpose(0, 1), k, v, mask)
        assert torch.equal(out_t, out)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_split_attention_interpreted_matches_matmul_attention():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, "cpu"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="needs a GPU and triton")
def test_split_attention_on_gpu_matches_matmul_attention():
    check("cuda", torch.bfloat16, 0.05)




def check_row_invariance(device: str, dtype: torch.dtype) -> None:
    """A query row's output does not depend on how many other query tokens share the call, nor on masked keys
    past the end (a longer context bucket): a plain step and a verify step agree bit for bit."""
    from flashdraft.models.split_attention import split_attention
    gen = torch.Generator().manual_seed(1)
    H, KV, D, L = 32, 8, 128, 1000
    q = torch.randn(16, H, D, generator=gen).to(device, dtype)
    k = torch.randn(KV, 2048, D, generator=gen).to(device, dtype)
    v = torch.randn(KV, 2048, D, generator=gen).to(device, dtype)
    positions = torch.arange(L - 16, L)
    mask = (torch.arange(2048)[None, :] <= positions[:, None]).to(device)
    verify = split_attention(q, k[:, :1024], v[:, :1024], mask[:, :1024])
    for i in (0, 7, 15):
        for keys in (1024, 2048):
            one = split_attention(q[i:i + 1], k[:, :keys], v[:, :keys], mask[i:i + 1, :keys])
            assert torch.equal(one[0], verify[i]), (i, keys)


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="needs a GPU and triton")
def test_split_attention_rows_are_invariant_on_gpu():
    check_row_invariance("cuda", torch.bfloat16)


if __name__ == "__main__":
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    if device == "cpu":
        check("cpu", torch.float32, 1e-5)
    else:
        check(device, torch.bfloat16, 0.05)
        check_row_invariance(device, torch.bfloat16)
    print(f"split attention matches on {device}")
