"""kernels/delta_rule.py, the Gated DeltaNet recurrence of a decode or verify step in one Triton kernel, against
layers/gated_deltanet.recurrent_delta_rule (plain PyTorch): outputs and the state it writes back in place (at the
step's start or its end), from the kept state or from zeros, key and value sizes that are not powers of two and value
heads wider than a program's tile; a step continuing from the kept state after replaying the kept inputs of the
last step's accepted tokens; a token's bits the same alone, inside a block, and replayed. Under Triton's interpreter
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


def kept_inputs(k, v, g, beta, R: int):
    """A step's inputs [B, H, T, ...] as a RecurrentCache keeps them for slots 0..B-1 from position 0: row t % R."""
    B, H, T, _ = k.shape
    out = [torch.zeros(B, R, H, *x.shape[3:], device=k.device) for x in (k, v, g, beta)]
    for kept, x in zip(out, (k, v, g, beta)):
        kept[:, torch.arange(T) % R] = x.transpose(1, 2)
    return out


def check(device: str) -> None:
    import flashdraft.kernels.delta_rule  # noqa: F401
    from flashdraft.layers.gated_deltanet import recurrent_delta_rule
    op = torch.ops.flashdraft.recurrent_delta_rule
    for B, H, T, DK, DV in CASES:
        q, k, v, g, beta, state = inputs(B, H, T, DK, DV, device)
        slots = torch.arange(B, device=device).flip(0)  # row b continues slot B - 1 - b
        zero = torch.zeros(B, dtype=torch.long, device=device)
        for fresh in (False, True):
            start_state = torch.zeros_like(state) if fresh else state
            want_out, want_end = recurrent_delta_rule(q, k, v, g, beta, start_state)
            for keep_start in (False, True):
                held = state.flip(0).clone()  # slot B - 1 - b holds row b's state
                out = op(q, k, v, g, beta, held, slots, zero, zero, *kept_inputs(k, v, g, beta, 1)[:4], fresh,
                         keep_start)
                torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(held.flip(0), start_state if keep_start else want_end, rtol=1e-5,
                                           atol=1e-5)
        # a step kept at its start with its inputs; the next step starts after j of its tokens (replayed first):
        # its outputs and state the same bits as the block's, and as token by token from the start
        R = T + 1
        kept = kept_inputs(k, v, g, beta, R)
        block_state = state.clone()
        block = op(q, k, v, g, beta, block_state, zero.new_tensor(range(B)), zero, zero, *kept, False, True)
        assert torch.equal(block_state, state)  # kept at its start
        one_by_one = state.clone()
        alone = [op(*(x[:, :, t:t + 1] for x in (q, k, v, g, beta)), one_by_one, zero.new_tensor(range(B)), zero,
                    zero, *kept, False, False) for t in range(T)]
        assert torch.equal(block, torch.cat(alone, 2))
        for j in range(T):
            held = state.clone()
            out = op(*(x[:, :, j:j + 1] for x in (q, k, v, g, beta)), held, zero.new_tensor(range(B)), zero,
                     zero + j, *kept, False, j == T - 1)
            assert torch.equal(out, block[:, :, j:j + 1]), j
        end = state.clone()  # the last one kept its start: the state after T - 1 tokens, replayed
        op(*(x[:, :, :T - 1] for x in (q, k, v, g, beta)), end, zero.new_tensor(range(B)), zero, zero, *kept, False,
           False)
        assert torch.equal(held, end)


def replay_case(device: str):
    """Four rows continuing slots 3, 0, 5, 1 of six, each slot's state kept after its own base (7, 12, 9: kept rows
    wrapped in a ring of 5), from starts 4, 2, 7 (more than the 5 kept) and 0 tokens past it; the starts a strided
    view of the positions, as a step passes them."""
    B, H, T, DK, DV, R = 4, 2, 3, 16, 40, 5
    q, k, v, g, beta, _ = inputs(B, H, T, DK, DV, device, seed=1)
    slots_n = 6
    gen = torch.Generator().manual_seed(2)
    state = torch.randn(slots_n, H, DK, DV, generator=gen).to(device)
    base = torch.tensor([0, 7, 3, 12, 5, 9], device=device)  # per slot; 7, 12, 9: their rows wrap
    kept = [torch.randn(slots_n, R, H, *shape, generator=gen).to(device) for shape in ((DK,), (DV,), (), ())]
    kept[0] = torch.nn.functional.normalize(kept[0], dim=-1)
    kept[2] = -kept[2].abs()
    kept[3] = kept[3].sigmoid()
    slots = torch.tensor([3, 0, 5, 1], device=device)
    positions = torch.stack([torch.arange(s, s + T) for s in (12 + 4, 0 + 2, 9 + 7, 7 + 0)]).to(device)
    start = positions[:, 0]  # strided: stride T; slot 5's start is 7 past its base (R = 5 are kept)
    assert start.stride(0) == T
    return q, k, v, g, beta, state, base, kept, slots, start


def test_pytorch_replay_matches_the_written_out_replay():
    """gated_deltanet.replay's masked loop (the CPU path) against the replay written out token by token."""
    from flashdraft.layers.gated_deltanet import replay
    _, _, _, _, _, state, base, kept, slots, start = replay_case("cpu")
    got = replay(state[slots], base[slots], start, [x[slots] for x in kept])
    assert torch.equal(got, reference_replay(state, base, start, kept, slots))


def check_replay(device: str) -> None:
    """Rows continuing slots of their own (permuted) from starts of their own: each slot's kept state after `base`
    tokens, its kept inputs in a ring of R rows (positions past R: wrapped), replayed up to the row's start (a
    strided view of the positions, as a step passes it; past the kept inputs: as many as are kept), against
    gated_deltanet.replay's PyTorch loop and the reference recurrence."""
    import flashdraft.kernels.delta_rule  # noqa: F401
    from flashdraft.layers import gated_deltanet
    q, k, v, g, beta, state, base, kept, slots, start = replay_case(device)
    slots_n = len(state)
    with torch.no_grad():
        saved = state.clone()
        want_start = reference_replay(state, base, start, kept, slots)
        want_out, want_end = gated_deltanet.recurrent_delta_rule(q, k, v, g, beta, want_start)
        for keep_start in (True, False):
            held = saved.clone()
            out = torch.ops.flashdraft.recurrent_delta_rule(q, k, v, g, beta, held, slots, base, start, *kept, False,
                                                            keep_start)
            torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(held[slots], want_start if keep_start else want_end, rtol=1e-5, atol=1e-5)
            others = torch.ones(slots_n, dtype=torch.bool, device=device)
            others[slots] = False
            assert torch.equal(held[others], saved[others])


def reference_replay(state, base, start, kept, slots):
    """The replay written out token by token: min(start - base, R) kept tokens from base, row p % R."""
    from flashdraft.layers.gated_deltanet import delta_update
    R = kept[0].shape[1]
    out = []
    for b, slot in enumerate(slots.tolist()):
        s = state[slot:slot + 1]
        for i in range(max(0, min(int(start[b] - base[slot]), R))):
            row = (int(base[slot]) + i) % R
            s = delta_update(s, *(x[slot:slot + 1, row] for x in kept))
        out.append(s)
    return torch.cat(out)


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
    transformers', a verify block rolled back to its accepted prefix, greedy speculative decoding as plain (two
    slots in batched steps too), a slot left by a cancelled prompt or past an end token continued right."""
    run_interpreted(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_qwen3_5.py", "-k",
                     "logits_match or rolls_back or lookup_drafter or batched_steps or cancelled or end_token"], 900)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="needs a GPU and triton")
def test_recurrent_kernel_on_gpu_matches_the_reference():
    check("cuda")
    check_replay("cuda")


if __name__ == "__main__":
    check(sys.argv[1] if len(sys.argv) > 1 else "cpu")
    check_replay(sys.argv[1] if len(sys.argv) > 1 else "cpu")
