"""The sampler against its definition: an independent float64 reference of the filtered distribution (softmax,
top-k, top-p by sorted cumulative mass, min-p, then the temperature), a chi-square test of `sample` against it,
seeded determinism, ties, banned tokens, and fixed shapes (no host synchronisation)."""
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
    counts = draw(torch.from_numpy(np.log(np.maximum(wrong, 1e-300))).float(), SamplingParams(temperature=1.0),
                  40000, seed=11)
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
