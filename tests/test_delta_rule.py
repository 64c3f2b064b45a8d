"""kernels/delta_rule.py, the Gated DeltaNet recurrence of a decode or verify step in one Triton kernel, against
layers/gated_deltanet.recurrent_delta_rule (plain PyTorch): outputs and the states it writes into ring rows, from
a ring row or from zeros, after every token or the last, key and value sizes that are not powers of two and value
heads wider than a program's tile; a token's bits the same alone and inside a block. Under Triton's interpreter
on the CPU (a process of its own), and on a GPU. Then Qwen3.5's tests through the kernel (the interpreter)."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# (batch, value heads, tokens, key dim, value dim)
CASES = [(1, 2, 1, 16, 8), (2, 3, 5, 24, 40), (3, 2, 16, 32, 64), (1, 1, 7, 128, 128)]


def inputs(B: int, H: int, T: int, DK: int, DV: int, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, DK, generator=gen) * DK ** -0.5
    k = torch.nn.functional.normalize(torch.randn(B, H, T, DK, generator=gen), dim=-1)
    v = torch.randn(B, H, T, DV, generator=gen)
    g = -torch.rand(B, H, T, generator=gen) * 2
    beta = torch.rand(B, H, T, generator=gen)
    state = torch.randn(B, H, DK, DV, generator=gen)
    return [x.to(device) for x in (q, k, v, g, beta, state)]


def check(device: str) -> None:
    import flashdraft.kernels.delta_rule  # noqa: F401
    from flashdraft.layers.gated_deltanet import recurrent_delta_rule
    op = torch.ops.flashdraft.recurrent_delta_rule
    for B, H, T, DK, DV in CASES:
        q, k, v, g, beta, state = inputs(B, H, T, DK, DV, device)
        rows = T + 2  # a ring of rows per sequence, as layers.kv_cache.RecurrentCache's
        base = torch.arange(B, device=device) * rows
        for fresh in (False, True):
            start = torch.zeros_like(state) if fresh else state
            want_out, want_states = recurrent_delta_rule(q, k, v, g, beta, start, every=True)
            for every in (True, False):
                ring = torch.full((B * rows, H, DK, DV), float("nan"), device=device)
                ring[base] = state
                dst = base[:, None] + 1 + (torch.arange(T, device=device) if every else torch.tensor([T - 1],
                                                                                                   device=device))
                out = op(q, k, v, g, beta, ring, base, dst, fresh)
                torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
                kept = want_states if every else want_states[:, -1:]
                torch.testing.assert_close(ring[dst], kept, rtol=1e-5, atol=1e-5)
                untouched = torch.ones(B * rows, dtype=torch.bool, device=device)
                untouched[dst.flatten()] = False
                untouched[base] = False
                assert ring[untouched].isnan().all()  # no other row written
        # one row per sequence, read and written in place; then token by token against the block: the same bits
        ring = state.clone()
        own = torch.arange(B, device=device)
        block = op(q, k, v, g, beta, ring, own, own[:, None], False)
        one_by_one = state.clone()
        alone = [op(*(x[:, :, t:t + 1] for x in (q, k, v, g, beta)), one_by_one, own, own[:, None], False)
                 for t in range(T)]
        assert torch.equal(block, torch.cat(alone, 2)) and torch.equal(ring, one_by_one)


def run_interpreted(args: list[str], timeout: int) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_recurrent_kernel_interpreted_matches_the_reference():
    run_interpreted([__file__, "cpu"], 600)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_qwen35_through_the_recurrent_kernel_interpreted():
    """Under the interpreter every step of up to 16 tokens and every verify block runs the kernel: logits as
    transformers', a verify block rolled back to its accepted prefix, greedy speculative decoding as plain."""
    run_interpreted(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_qwen3_5.py", "-k",
                     "logits_match or rolls_back or lookup_drafter"], 900)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="needs a GPU and triton")
def test_recurrent_kernel_on_gpu_matches_the_reference():
    check("cuda")


if __name__ == "__main__":
    check(sys.argv[1] if len(sys.argv) > 1 else "cpu")
