"""The sampler against its definition: an independent float64 reference of the filtered distribution (softmax,
top-k, top-p by sorted cumulative mass, min-p, then the temperature), a chi-square test of `sample` against it,
seeded determinism, ties, banned tokens, and fixed shapes (no host synchronisation). Its counter-based noise:
Philox against Random123's known answers, a token a function of (seed, position, logits) alone, the issue's guide
settings through the device sampler (penalties, logit_bias) by chi-square, the window counts of a verify block, and
the Triton kernel under the interpreter (its noise, its tokens, its chi-square) and compiled for sm_90."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from flashdraft.engine.sampling import SamplingParams, filtered_probs, sample

VOCAB = 4096
GUIDE = SamplingParams(temperature=0.7, top_k=64, top_p=0.95, min_p=0.0)
CASES = {
    "guide": GUIDE,
    "top_k": SamplingParams(temperature=0.8, top_k=40),
    "top_p": SamplingParams(temperature=1.2, top_p=0.9),
    "min_p": SamplingParams(temperature=0.9, min_p=0.05),
    "top_k_min_p": SamplingParams(temperature=1.5, top_k=64, min_p=0.1),
    "all": SamplingParams(temperature=0.6, top_k=50, top_p=0.8, min_p=0.1),
}


def reference_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The filtered distribution of one row, written from the definition (llama.cpp's order) in float64."""
    x = logits.astype(np.float64)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    keep = np.ones(len(x), dtype=bool)
    if 0 < p.top_k < len(x):
        keep[:] = False
        keep[np.argsort(-x, kind="stable")[:p.top_k]] = True
    if p.top_p < 1.0:
        q = np.where(keep, probs, 0.0)
        q /= q.sum()
        order = np.argsort(-q, kind="stable")
        before = np.cumsum(q[order]) - q[order]
        nucleus = np.zeros_like(keep)
        nucleus[order[before < p.top_p]] = True
        keep &= nucleus
    if p.min_p > 0:
        q = np.where(keep, probs, 0.0)
        q /= q.sum()
        keep &= q >= p.min_p * q.max()
    out = np.where(keep, np.exp((x - x.max()) / p.temperature), 0.0)
    return out / out.sum()


def random_logits(seed: int, vocab: int = VOCAB, scale: float = 2.5) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale


def draw(row: torch.Tensor, p: SamplingParams, samples: int, seed: int, batch: int = 4000) -> np.ndarray:
    """Counts per token of `samples` draws of `sample` on copies of one row."""
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros(row.shape[-1], dtype=np.int64)
    for start in range(0, samples, batch):
        tokens = sample(row.expand(min(batch, samples - start), -1), p, gen)
        counts += np.bincount(tokens.numpy(), minlength=row.shape[-1])
    return counts


def chi_square_pvalue(counts: np.ndarray, expected: np.ndarray) -> float:
    """Tokens expected at least 5 times are their own bin, the rest share one; a token of probability 0 that was
    drawn fails outright."""
    from scipy.stats import chisquare
    assert counts[expected == 0].sum() == 0, "drew a token the filters remove"
    total = counts.sum()
    big = expected * total >= 5
    obs = list(counts[big]) + ([counts[~big].sum()] if (~big & (expected > 0)).any() else [])
    exp = list(expected[big] * total) + ([expected[~big].sum() * total] if len(obs) > big.sum() else [])
    exp = np.array(exp) * (total / np.sum(exp))
    return float(chisquare(obs, exp).pvalue)


@pytest.mark.parametrize("name", list(CASES))
def test_filtered_probs_matches_the_definition(name):
    p = CASES[name]
    for seed in range(3):
        row = random_logits(seed)
        ref = reference_probs(row.numpy(), p)
        ours = filtered_probs(row[None], p)[0].double().numpy()
        assert ((ours > 0) == (ref > 0)).all()
        np.testing.assert_allclose(ours, ref, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("name", list(CASES))
def test_sample_follows_the_reference_distribution(name):
    pytest.importorskip("scipy")
    p = CASES[name]
    row = random_logits(7)
    expected = reference_probs(row.numpy(), p)
    full = reference_probs(row.numpy(), SamplingParams(temperature=p.temperature))
    assert (expected > 0).sum() < (full > 0).sum()  # the filters bite on this row
    counts = draw(row, p, 40000, seed=11)
    assert chi_square_pvalue(counts, expected) > 1e-3


def test_chi_square_catches_temperature_before_top_p():
    """The same test on draws from the wrong order (temperature applied before top-p) fails."""
    pytest.importorskip("scipy")
    row = random_logits(7)
    expected = reference_probs(row.numpy(), GUIDE)
    wrong = reference_probs((row / GUIDE.temperature).numpy(), SamplingParams(**{**GUIDE.__dict__, "temperature": 1.0}))
    assert not np.allclose(wrong, expected)
    logits = torch.from_numpy(np.where(wrong > 0, np.log(np.maximum(wrong, 1e-300)), -np.inf)).float()
    counts = draw(logits, SamplingParams(temperature=1.0), 40000, seed=11)  # (-inf: no noise for what never wins)
    assert chi_square_pvalue(counts, expected) < 1e-6


@pytest.mark.parametrize("name", list(CASES))
def test_seeded_sampling_is_deterministic(name):
    p = CASES[name]
    rows = torch.stack([random_logits(s) for s in range(8)])
    first = sample(rows, p, torch.Generator().manual_seed(3))
    again = sample(rows, p, torch.Generator().manual_seed(3))
    assert torch.equal(first, again)
    others = torch.stack([sample(rows, p, torch.Generator().manual_seed(s)) for s in range(4, 12)])
    assert (others != first).any()


def test_ties_at_the_kth_logit_keep_exactly_k():
    """top-k keeps exactly k tokens (llama.cpp truncates at k too); sample draws only what filtered_probs keeps."""
    logits = torch.tensor([[5.0, 3.0, 4.0, 3.0, 3.0, 1.0, 3.0]])
    p = SamplingParams(temperature=1.0, top_k=3)
    probs = filtered_probs(logits, p)
    assert (probs > 0).sum() == 3 and probs[0, 0] > 0 and probs[0, 2] > 0
    drawn = sample(logits.expand(2000, -1), p, torch.Generator().manual_seed(0))
    assert set(drawn.tolist()) == set((probs[0] > 0).nonzero()[:, 0].tolist())


@pytest.mark.parametrize("name", list(CASES))
def test_banned_tokens_are_never_drawn(name):
    """Fewer finite logits than top-k (logit_bias or a grammar bans the rest): only those can come out."""
    p = CASES[name]
    logits = torch.full((1, 300), float("-inf"))
    allowed = [17, 150, 299]
    logits[0, allowed] = torch.tensor([0.5, 0.0, -0.3])
    probs = filtered_probs(logits, p)
    assert set((probs[0] > 0).nonzero()[:, 0].tolist()) <= set(allowed)
    drawn = sample(logits.expand(3000, -1), p, torch.Generator().manual_seed(1))
    assert set(drawn.tolist()) <= set(allowed)


def test_greedy_is_argmax_and_one_hot():
    rows = torch.stack([random_logits(s) for s in range(4)])
    for p in (SamplingParams(), SamplingParams(temperature=0.8, top_k=1)):
        assert torch.equal(sample(rows, p, None), rows.argmax(-1))
        assert torch.equal(filtered_probs(rows, p), torch.nn.functional.one_hot(rows.argmax(-1), VOCAB).float())


@pytest.mark.parametrize("name", list(CASES))
def test_sampling_has_fixed_shapes(name):
    """On the meta device nothing can be read back: the sampler never synchronises with the host nor makes a
    shape from data, so it can run inside a captured CUDA graph."""
    p = CASES[name]
    tokens = sample(torch.empty(5, VOCAB, device="meta"), p, None)
    assert tokens.shape == (5,) and tokens.dtype == torch.long
    assert filtered_probs(torch.empty(5, VOCAB, device="meta"), p).shape == (5, VOCAB)


# ---- counter-based noise: Philox, the race kernel, the device sampler ----

# Random123's known answers for Philox4x32-10: (counter, key (low word, high word), output words)
PHILOX_KAT = [((0, 0, 0, 0), (0, 0), (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
              ((2 ** 32 - 1,) * 4, (2 ** 32 - 1, 2 ** 32 - 1), (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
              ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
               (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1))]
ISSUE_GUIDE = SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05)  # issue 44's sampled settings
ADJUSTMENTS = {"none": {}, "repeat": {"repeat_penalty": 1.3, "repeat_last_n": 64},
               "bias_and_penalties": {"logit_bias": {0: 1.5, 1: float("-inf")}, "repeat_penalty": 1.1,
                                      "frequency_penalty": 0.3, "presence_penalty": 0.2, "repeat_last_n": -1}}
EDGE_ROWS = {"nan": (7, float("nan")), "+inf": (3, float("inf")), "-inf": (None, float("-inf"))}


def key_as_int64(lo: int, hi: int) -> torch.Tensor:
    """The 64-bit key (hi, lo) as the int64 a seed tensor holds (its bits)."""
    key = hi << 32 | lo
    return torch.tensor(key - (1 << 64) if key >= 1 << 63 else key)


@pytest.mark.parametrize("impl", ["numpy", "torch"])
def test_philox_matches_random123_known_answers(impl):
    """The CPU's Philox (NumPy) and the torch one (other devices) give Random123's own test vectors."""
    from flashdraft.engine.sampling import _philox_torch, philox
    for counter, (lo, hi), want in PHILOX_KAT:
        c = [torch.tensor(v) for v in counter]
        got = philox(key_as_int64(lo, hi), *c) if impl == "numpy" else _philox_torch(key_as_int64(lo, hi), *c, 10)
        assert [int(w) for w in got] == list(want)


def random_setup(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=gen) * 2.5, torch.randint(0, 5000, (rows,), generator=gen)


@pytest.mark.parametrize("name", list(CASES) + ["issue_guide", "temperature"])
def test_a_token_depends_on_seed_position_and_logits_only(name):
    """The same (seed, position, logits) gives the same token alone and inside a 16-row block, in any row of it;
    another position or another seed gives other tokens."""
    p = {"issue_guide": ISSUE_GUIDE, "temperature": SamplingParams(temperature=1.0)}.get(name) or CASES.get(name)
    logits, positions = random_setup(16)
    block = sample(logits, p, seed=5, positions=positions)
    alone = torch.cat([sample(logits[i:i + 1], p, seed=5, positions=positions[i:i + 1]) for i in range(16)])
    assert torch.equal(block, alone)
    order = torch.randperm(16, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sample(logits[order], p, seed=5, positions=positions[order]), block[order])
    assert not torch.equal(sample(logits, p, seed=5, positions=positions + 1), block)
    assert not torch.equal(sample(logits, p, seed=6, positions=positions), block)
    assert (block >= 0).all()


def test_rows_with_nothing_to_draw_are_flagged_in_every_path():
    """A NaN, a +inf, or every token at -inf: -1, whether the noise is computed for the kept candidates only
    (the CPU) or for all of them (fixed shapes)."""
    from flashdraft.engine.sampling import candidates, race_reference, settings_of
    for p in (ISSUE_GUIDE, CASES["top_p"], CASES["min_p"], SamplingParams(temperature=1.0)):
        logits, positions = edge_rows()
        tokens = sample(logits, p, seed=1, positions=positions)
        assert tokens[:3].tolist() == [-1, -1, -1] and (tokens[3:] >= 0).all(), (p, tokens)
        values, ids = candidates(logits, p)
        dense = race_reference(values, ids, settings_of(p, "cpu"), torch.tensor([1]), positions,
                               sorted_=ids is not None, top_p=p.top_p < 1, min_p=p.min_p > 0, vocab=VOCAB,
                               compact=False)
        assert torch.equal(dense, tokens)


def edge_rows() -> tuple[torch.Tensor, torch.Tensor]:
    """Rows 0-2: a NaN, a +inf, all -inf (nothing to draw); rows 3-5 ordinary."""
    logits, positions = random_setup(6, seed=3)
    for row, (at, value) in enumerate(EDGE_ROWS.values()):
        if at is None:
            logits[row] = value
        else:
            logits[row, at] = value
    return logits, positions


def guide_history(row: torch.Tensor) -> torch.Tensor:
    """A prompt that repeats the row's likeliest tokens, so that the penalties move its distribution."""
    top = row.topk(6).indices
    return torch.cat([top, top[:3], top[:1], torch.arange(20, 30)])


def guide_draws(adjustment: str, samples: int, seeds: int = 4) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """(counts of `samples` draws of the issue's guide settings with `adjustment` on one row, at as many positions
    under `seeds` seeds, by the device sampler's own path; the definition's probabilities of its adjusted row, that
    row). The adjusted row is adjust_logits' bit for bit."""
    from flashdraft.engine.sampling import DeviceSampler, adjust_logits, draw, logit_bias_row
    p = SamplingParams(**{**ISSUE_GUIDE.__dict__, **ADJUSTMENTS[adjustment]})
    row = random_logits(7)
    history = guide_history(row)
    sampler = DeviceSampler(VOCAB, 256, "cpu")
    counts = np.zeros(VOCAB, dtype=np.int64)
    for s in range(seeds):
        sampler.begin(p, 1000 + s, history)
        key = sampler.key(0, 1, commit=False)
        adjusted = sampler.adjust(key, row[None], torch.tensor([len(history) - 1]))
        assert torch.equal(adjusted, adjust_logits(row[None], p, logit_bias_row(p, VOCAB, "cpu"), history.tolist()))
        positions = torch.arange(samples // seeds) + len(history) - 1 + 7919 * s
        tokens = draw(adjusted.expand(len(positions), -1), key.top_k, key.top_p, key.min_p, sampler.settings,
                      sampler.seed, positions, position_offset=1)
        counts += np.bincount(tokens.numpy(), minlength=VOCAB)
    return counts, reference_probs(adjusted[0].numpy(), p), adjusted[0]


@pytest.mark.parametrize("adjustment", list(ADJUSTMENTS))
def test_issue_guide_settings_follow_the_definition(adjustment):
    """Chi-square of the device sampler's draws (one seed a request, a position a draw) for the guide's settings,
    with and without penalties and a logit_bias, against the definition's distribution of the adjusted row."""
    pytest.importorskip("scipy")
    counts, expected, adjusted = guide_draws(adjustment, 20000)
    plain = reference_probs(random_logits(7).numpy(), ISSUE_GUIDE)
    if adjustment != "none":
        assert np.abs(expected - plain).sum() > 0.1  # the adjustments moved the distribution
    assert (expected > 0).sum() >= 5
    assert chi_square_pvalue(counts, expected) > 1e-3


def test_device_sampler_counts_follow_each_verify_row():
    """The device's window counts for a verify block (drafted tokens entering, the oldest leaving, a window
    shorter than the block included) equal penalty_counts from the host's list, after one-row calls (whose tokens
    the next call counts, however often the call that drew them ran) and committed verify tokens."""
    from flashdraft.engine.sampling import DeviceSampler, penalty_counts
    gen = torch.Generator().manual_seed(4)
    for window in (3, 8, -1):
        p = SamplingParams(temperature=0.8, repeat_penalty=1.2, repeat_last_n=window)
        sampler = DeviceSampler(50, 128, "cpu")
        history = torch.randint(0, 50, (11,), generator=gen).tolist()
        sampler.begin(p, 3, torch.tensor(history))
        for step in range(6):
            at = torch.tensor([len(history) - 1])
            for rows in (1, 4, 9):
                drafted = torch.randint(0, 50, (rows - 1,), generator=gen)
                got = sampler.window_counts(rows, at, drafted)
                assert torch.equal(got, penalty_counts(history, drafted, rows, p, 50)), (window, step, rows)
            if step % 3 == 2:  # a verify step's tokens
                new = torch.randint(0, 50, (3,), generator=gen).tolist()
                sampler.commit(new, len(history))
                history += new
                continue
            key = sampler.key(0, 1, commit=True)
            logits = torch.randn(1, 50, generator=gen)
            token = sampler(key, logits, at)
            assert torch.equal(sampler(key, logits, at), token)  # the same call again (a graph's warm-up, then replay)
            history += token.tolist()


def test_sampler_kernel_interpreted():
    """The Triton kernel under the interpreter: its noise is the torch noise, its tokens the reference's, a row's
    token the same alone or in a block, and the guide settings' chi-square (see `check_kernel`)."""
    from test_split_attention import INTERPRETER
    if INTERPRETER is not None:
        pytest.skip(INTERPRETER)
    pytest.importorskip("scipy")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, "interpret"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def kernel_launches() -> list:
    """(kernel, bound arguments, num_warps) of every launch `race` makes over its variants."""
    import inspect

    from flashdraft.kernels import sampling as K
    launches = []

    class Recorded:  # stands in for kernel[grid](...)
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))

    kernels = K._race_sorted_kernel, K._race_chunks_kernel
    K._race_sorted_kernel, K._race_chunks_kernel = map(Recorded, kernels)
    try:
        settings, seeds, positions = torch.zeros(6), torch.zeros(1, dtype=torch.long), torch.zeros(4, dtype=torch.long)
        for c, ids in ((40, True), (3000, True), (3000, False)):
            for top_p in (False, True):
                for min_p in (False, True):
                    K.race(torch.zeros(4, c), torch.zeros(4, c, dtype=torch.long) if ids else None, settings, seeds,
                           positions, sorted_=True, top_p=top_p, min_p=min_p)
        for min_p in (False, True):
            K.race(torch.zeros(4, 3000), None, settings, seeds, positions, sorted_=False, top_p=False, min_p=min_p)
    finally:
        K._race_sorted_kernel, K._race_chunks_kernel = kernels
    out = []
    for kernel, args, kwargs in launches:
        num_warps = kwargs.pop("num_warps")
        out.append((kernel, inspect.signature(kernel.fn).bind(*args, **kwargs).arguments, num_warps))
    return out


def test_sampler_kernels_compile_for_sm90():
    """Every variant the race launches compiles for sm_90, ptxas included (the interpreter accepts code that the
    compiler would not)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    codes = {torch.int64: "*i64", torch.int32: "*i32", torch.float32: "*fp32"}
    for kernel, bound, num_warps in kernel_launches():
        constexprs = {p.name for p in kernel.params if p.is_constexpr}
        signature = {n: "constexpr" if n in constexprs else codes[v.dtype] if isinstance(v, torch.Tensor) else "i32"
                     for n, v in bound.items()}
        source = ASTSource(fn=kernel, signature=signature,
                           constexprs={(list(signature).index(n),): bound[n] for n in constexprs})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
        assert compiled.asm["cubin"], kernel.fn.__name__


def check_kernel() -> None:
    """Run under TRITON_INTERPRET=1 (the kernels take CPU tensors there), with the probes below."""
    from flashdraft.engine import sampling as S
    assert S.INTERPRETED

    for counter, (lo, hi), want in PHILOX_KAT:  # Triton's own Philox gives the known answers: the same generator
        out = torch.zeros(4, 4, dtype=torch.long)
        philox_probe[(1,)](key_as_int64(lo, hi)[None], torch.tensor(counter), out)
        assert [int(w) & 0xFFFFFFFF for w in out[:, 0]] == list(want)

    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        seed, position = torch.randint(0, 2 ** 62, (1,), generator=gen), torch.randint(0, 2 ** 31, (1,), generator=gen)
        ids = torch.randint(0, 2 ** 30, (256,), generator=gen)
        each, run = torch.zeros(256), torch.zeros(256)
        noise_probe[(1,)](seed, position, ids, each, run, BLOCK=256)
        torch.testing.assert_close(each, S.gumbel_noise(seed, ids, position), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(run, S.gumbel_rows(seed[:, None], position[:, None], 64 + 256)[0, 64:],
                                   rtol=1e-6, atol=1e-6)

    # the kernels' tokens are the torch reference's, and a row's token is the same alone or in a block
    cases = {**CASES, "issue_guide": ISSUE_GUIDE, "temperature": SamplingParams(temperature=1.0)}
    for name, p in cases.items():
        for seed in range(3):
            logits, positions = random_setup(16, seed)
            logits[:6], positions[:6] = edge_rows()
            values, ids = S.candidates(logits, p)
            args = (values, ids, S.settings_of(p, "cpu"), torch.tensor([seed]), positions)
            flags = dict(sorted_=ids is not None, top_p=p.top_p < 1, min_p=p.min_p > 0, position_offset=1)
            kernel = K.race(*args, **flags)
            reference = S.race_reference(*args, **flags, vocab=VOCAB)
            assert (kernel != reference).sum() <= 1 and kernel[:3].tolist() == [-1] * 3, (name, kernel, reference)
            alone = torch.cat([K.race(values[i:i + 1], None if ids is None else ids[i:i + 1], args[2], args[3],
                                      positions[i:i + 1], **flags) for i in (6, 11)])
            assert torch.equal(alone, kernel[[6, 11]]), name

    # the guide's settings through the kernel: chi-square against the definition
    for adjustment in ("none", "bias_and_penalties"):
        counts, expected, _ = guide_draws(adjustment, 1000, seeds=2)
        assert chi_square_pvalue(counts, expected) > 1e-3, adjustment


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_sampler_on_gpu():
    """On CUDA: the kernel's tokens are the torch reference's (the same operations on the GPU, up to a rare flip
    of a near-tie by the logarithm's rounding), the guide's chi-square, and the sampler's captured graphs (one per
    key, inputs through shared buffers, as Steps.sample runs them, each key replayed on new inputs) equal the same
    calls run eagerly, the penalties' counts included (a graph's warm-up counts nothing twice)."""
    pytest.importorskip("scipy")
    from types import SimpleNamespace

    from flashdraft.engine import sampling as S
    from flashdraft.engine.graphs import GraphCache
    from flashdraft.engine.steps import Steps
    from flashdraft.layers.kv_cache import KVState
    cases = {**CASES, "issue_guide": ISSUE_GUIDE, "temperature": SamplingParams(temperature=1.0)}
    for name, p in cases.items():
        logits, positions = (t.cuda() for t in random_setup(512))
        values, ids = S.candidates(logits, p)
        args = (values, ids, S.settings_of(p, "cuda"), torch.tensor([9], device="cuda"), positions)
        flags = dict(sorted_=ids is not None, top_p=p.top_p < 1, min_p=p.min_p > 0)
        kernel, reference = S.race(*args, **flags), S.race_reference(*args, **flags, vocab=VOCAB)
        assert kernel.is_cuda and (kernel != reference).sum() <= 2, name
    row = random_logits(7).cuda()
    expected = reference_probs(row.cpu().numpy(), ISSUE_GUIDE)
    tokens = sample(row.expand(40000, -1), ISSUE_GUIDE, seed=3, positions=torch.arange(40000, device="cuda"))
    assert chi_square_pvalue(np.bincount(tokens.cpu().numpy(), minlength=VOCAB), expected) > 1e-3

    vocab = 49152
    prompt = torch.randint(0, vocab, (40,), generator=torch.Generator().manual_seed(2)).cuda()
    for extra in ({}, ADJUSTMENTS["bias_and_penalties"], {"repeat_penalty": 1.2, "repeat_last_n": 4}):
        for base in (ISSUE_GUIDE, SamplingParams(temperature=0.9), SamplingParams(temperature=0.9, top_p=0.9),
                     SamplingParams()):
            p = SamplingParams(**{**base.__dict__, **extra})
            runs = []
            for graphs in (False, True):
                state = KVState([], max_len=512)  # no target: only the sampler's part of Steps
                steps = Steps(None, state, SimpleNamespace(block_size=16, target_layers=()), "cuda")
                if not graphs:
                    steps.graphs = GraphCache("cpu")  # the same calls on CUDA tensors, run eagerly
                sampler = steps.sampler(0, vocab)
                sampler.begin(p, 11, prompt)
                out, at = [], len(prompt) - 1  # `at`: the last committed token's position
                g = torch.Generator().manual_seed(5)
                for step in range(8):  # plain steps and verify blocks (3 tokens committed), as decode takes them
                    rows = 1 if step % 3 else 16
                    logits = (torch.randn(rows, vocab, generator=g) * 3).cuda()
                    positions = torch.arange(at, at + rows, device="cuda")
                    drafted = torch.randint(0, vocab, (rows - 1,), generator=g).cuda() if rows > 1 else None
                    out.append(steps.sample(0, logits, positions, drafted, commit=rows == 1).clone())
                    if rows > 1:
                        sampler.commit(out[-1][:3].tolist(), at + 1)
                    at += 1 if rows == 1 else 3
                runs.append((out, None if sampler.counts is None else sampler.counts.clone()))
            (eager, eager_counts), (graphed, graph_counts) = runs
            assert all(torch.equal(a, b) for a, b in zip(eager, graphed)), p
            if eager_counts is not None:
                assert torch.equal(eager_counts, graph_counts), p

if __name__ == "__main__":
    import triton
    import triton.language as tl

    from flashdraft.kernels import sampling as K

    @triton.jit
    def philox_probe(key_ptr, counter_ptr, out_ptr):
        zero = tl.zeros([4], tl.uint32)
        c0, c1 = zero + tl.load(counter_ptr).to(tl.uint32), zero + tl.load(counter_ptr + 1).to(tl.uint32)
        c2, c3 = zero + tl.load(counter_ptr + 2).to(tl.uint32), zero + tl.load(counter_ptr + 3).to(tl.uint32)
        w0, w1, w2, w3 = tl.philox(tl.load(key_ptr), c0, c1, c2, c3)
        at = tl.arange(0, 4)
        tl.store(out_ptr + at, w0.to(tl.int64))
        tl.store(out_ptr + 4 + at, w1.to(tl.int64))
        tl.store(out_ptr + 8 + at, w2.to(tl.int64))
        tl.store(out_ptr + 12 + at, w3.to(tl.int64))

    @triton.jit
    def noise_probe(seed_ptr, position_ptr, ids_ptr, each_ptr, run_ptr, BLOCK: tl.constexpr):
        seed, position = tl.load(seed_ptr), tl.load(position_ptr)
        at = tl.arange(0, BLOCK)
        tl.store(each_ptr + at, K.gumbel_noise(seed, tl.load(ids_ptr + at), position))
        tl.store(run_ptr + at, K.gumbel_run(seed, 64, position, BLOCK))

    if sys.argv[1:] == ["interpret"]:
        check_kernel()
        print("the sampler kernel matches under the interpreter")
