"""Synthetic acceptance (--spec-synth-len / --spec-synth-rates, engine/synthetic.py): the rates resolve as llama.cpp
resolves them (common/speculative.cpp: geometric rates p, ..., p^n whose sum is the length less one, checked here
against numpy's polynomial roots), its checks and error texts, the observed mean acceptance length against the
requested one within sampling error, and every answer made under it saying so (timings, /props)."""
import math

import httpx
import numpy as np
import pytest

from flashdraft import cli
from flashdraft.engine import synthetic
from flashdraft.engine.engine import Engine, EngineConfig, Request
from flashdraft.engine.sampling import SamplingParams
from flashdraft.server.app import create_app
from flashdraft.server.main import load_engine, parse_settings
from test_server import DEVICE, models, serving  # noqa: F401  (models: a fixture shared by the run)


def geometric_p(length: float, n_max: int) -> float:
    """The p in [0, 1] with p + p^2 + ... + p^n_max = length - 1: the real root of that polynomial there."""
    coefficients = [1.0] * n_max + [-(length - 1.0)]  # p^n + ... + p - (L - 1), highest power first
    roots = [r.real for r in np.roots(coefficients) if abs(r.imag) < 1e-9 and -1e-12 <= r.real <= 1 + 1e-12]
    assert len(roots) == 1
    return roots[0]


@pytest.mark.parametrize("n_max", [15, 7, 1])
@pytest.mark.parametrize("length", [1.0, 1.5, 3.0, 5.0, 6.5, 6.7, 8.0, 16.0])
def test_a_length_resolves_into_geometric_rates(length, n_max):
    if length > n_max + 1:
        with pytest.raises(ValueError, match=rf"^synthetic acceptance length must be finite and within \[1, "
                                             rf"{n_max + 1}\]$"):
            synthetic.resolve_rates(length, None, n_max)
        return
    rates = synthetic.resolve_rates(length, None, n_max)
    p = 1.0 if length == n_max + 1 else 0.0 if length == 1.0 else geometric_p(length, n_max)
    assert len(rates) == n_max
    assert rates == pytest.approx([p ** (i + 1) for i in range(n_max)], abs=1e-9)
    assert synthetic.mean_length(rates) == pytest.approx(length, abs=1e-8)
    probs = synthetic.conditional(rates)
    assert probs == pytest.approx([p] * n_max if p > 0 else [0.0] * n_max, abs=1e-9)


def test_given_rates_are_checked_and_kept():
    assert synthetic.resolve_rates(None, [0.9, 0.8, 0.8, 0.1], 4) == [0.9, 0.8, 0.8, 0.1]
    assert synthetic.conditional([0.9, 0.72, 0.0, 0.0]) == pytest.approx([0.9, 0.8, 0.0, 0.0])
    assert synthetic.resolve_rates(None, None, 4) == [] and synthetic.resolve_rates(None, [], 4) == []


@pytest.mark.parametrize("length, rates, n_max, message", [
    (3.0, [0.5, 0.2], 2, "synthetic acceptance length and rates are mutually exclusive"),
    (3.0, None, 0, "synthetic acceptance requires at least one speculative token"),
    (None, [0.5, 0.2], 3, "synthetic acceptance rates must contain 3 values, got 2"),
    (None, [0.5, 1.2], 2, "synthetic acceptance rates must be finite and within [0, 1]"),
    (None, [0.5, math.nan], 2, "synthetic acceptance rates must be finite and within [0, 1]"),
    (None, [0.5, 0.6], 2, "synthetic acceptance rates must be monotonically non-increasing"),
    (0.5, None, 4, "synthetic acceptance length must be finite and within [1, 5]"),
    (math.inf, None, 4, "synthetic acceptance length must be finite and within [1, 5]"),
])
def test_mistakes_get_llama_cpps_messages(length, rates, n_max, message):
    with pytest.raises(ValueError) as e:
        synthetic.resolve_rates(length, rates, n_max)
    assert str(e.value) == message


def acceptance_moments(rates: list[float]) -> tuple[float, float]:
    """Mean and variance of one step's acceptance length (1 + accepted) when every drafted position is verified:
    P(1 + k) = rates[k-1] - rates[k] (rates[-1] = 1 before the first, 0 after the last)."""
    r = [1.0] + rates + [0.0]
    probs = [r[k] - r[k + 1] for k in range(len(rates) + 1)]
    mean = sum((1 + k) * q for k, q in enumerate(probs))
    return mean, sum((1 + k - mean) ** 2 * q for k, q in enumerate(probs))


@pytest.mark.parametrize("flags", [dict(synth_len=3.0), dict(synth_rates=[0.9, 0.8, 0.7, 0.5, 0.5, 0.3, 0.0])])
def test_the_observed_acceptance_is_the_requested_one(models, flags):
    """The tiny random draft accepts next to nothing by itself; under synthetic acceptance a full-width run's
    mean acceptance length is the requested one within four standard errors, the answer says it is synthetic,
    and a seeded request repeats its acceptance decisions."""
    target, draft = models
    engine = Engine.load(EngineConfig(str(target), str(draft), device=DEVICE, ctx_size=2048, block_size=8,
                                      adaptive=False, **flags))
    rates = engine.synth_rates
    assert len(rates) == 7
    params = SamplingParams(max_tokens=1500, ignore_eos=True, seed=4)
    done = engine.generate(Request(list(range(3, 20)), params))
    lengths = done.spec.acceptance_lengths[:-1]  # the last step may be cut short by the budget
    drafted = [t for step in done.spec.draft_steps for t in step]
    assert not set(drafted) & set(engine.tokenizer.eos_ids)  # a drafted end token is never accepted, so none here
    mean, var = acceptance_moments(rates)
    assert abs(sum(lengths) / len(lengths) - mean) < 4 * math.sqrt(var / len(lengths))
    assert done.timings.to_dict()["synthetic_acceptance"] is True
    assert done.timings.draft_n_accepted == sum(length - 1 for length in done.spec.acceptance_lengths)
    again = engine.generate(Request(list(range(3, 20)), params))
    assert again.spec.acceptance_lengths == done.spec.acceptance_lengths
    plain = engine.generate(Request(list(range(3, 20)), SamplingParams(max_tokens=8), speculative=False))
    assert "synthetic_acceptance" not in plain.timings.to_dict()


def test_the_server_says_its_answers_are_synthetic(models):
    target, draft = models
    s, _ = parse_settings(["-m", str(target), "-md", str(draft), "--device", DEVICE, "-c", "512", "--temp", "0",
                           "-a", "tiny", "--spec-synth-len", "2.5"])
    engine = load_engine(s)
    with serving(create_app(engine, s)) as url:
        props = httpx.get(url + "/props", timeout=30).json()["speculative"]["synthetic_acceptance"]
        r = httpx.post(url + "/completion", json={"prompt": "hello", "n_predict": 24}, timeout=60).json()
    assert props["mean_length"] == pytest.approx(2.5) and len(props["rates"]) == engine.draft_block - 1
    assert r["timings"]["synthetic_acceptance"] is True and r["timings"]["draft_n"] > 0


@pytest.mark.parametrize("flags, words, before_loading", [
    (["--spec-synth-len", "3"], ["need speculative decoding"], True),
    (["-md", "DRAFT", "--spec-synth-len", "3", "--spec-synth-rates", "0.5"], ["mutually exclusive"], True),
    (["-md", "DRAFT", "--spec-synth-rates", "0.5,0.7"], ["monotonically non-increasing"], True),
    (["-md", "DRAFT", "--spec-synth-rates", "0.5,x"], ["--spec-synth-rates", "comma-separated"], True),
    # the draft's block tells what is too long: known once it is read
    (["-md", "DRAFT", "--spec-synth-len", "40"], ["synthetic acceptance length must be finite and within [1, 8]"],
     False),
])
def test_flag_mistakes_are_one_line(models, capsys, flags, words, before_loading):
    """A mistake the flags show is one line before anything loads (argparse's own usage line aside); one that
    needs the draft's block size stops the command (serve: the load in the background) with the same text."""
    target, draft = models
    flags = [str(draft) if f == "DRAFT" else f for f in flags]
    for command in ("generate", "serve"):
        rest = ["--prompt", "hi"] if command == "generate" else ["--port", "0"]
        try:
            code = cli.main([command, "-m", str(target), "--device", DEVICE, *rest, *flags])
        except SystemExit as e:  # argparse's own errors: exit 2, as every other flag's
            code = e.code
        lines = capsys.readouterr().err.strip().splitlines()
        assert code in (1, 2) and any(all(w in line for w in words) for line in lines), lines
        if before_loading:  # the last line, and no line of loading (argparse's usage lines may come before)
            assert all(w in lines[-1] for w in words) and not any("load" in line for line in lines), lines

