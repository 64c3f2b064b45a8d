"""Speculative decoding is lossless: greedy token-identical, sampling identical in distribution (on a dense
target and on a hybrid one, whose recurrent layers roll back), and the draft's proposals are exactly z-lab's
reference loop's."""
import itertools
import time

import pytest
import torch

from flashdraft.draft import DFlashDraft, DraftConfig
from flashdraft.engine.generate import SpecStats, accept_matching_samples
from tiny import decode_tokens, forward1
from flashdraft.engine.sampling import SamplingParams, chunked_argmax, filtered_probs
from flashdraft.models.llama import LlamaConfig
from flashdraft.models.llama import Llama
from flashdraft.models.qwen3_5 import Qwen35, Qwen35Config


def random_target(vocab=96, layers=4, hidden=64, seed=0, std=0.2, max_len=512) -> Llama:
    cfg = LlamaConfig(arch="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=hidden // 4, rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    model = Llama(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * std)
    model.state = model.new_state(1, max_len)
    return model.eval()


def random_hybrid_target(vocab=96, layers=3, hidden=16, seed=0, std=0.2, max_len=512) -> Qwen35:
    """A Qwen3.5-shaped target: Gated DeltaNet layers around a gated attention layer (their recurrent state rolls
    back to a verify block's accepted prefix)."""
    cfg = Qwen35Config.from_hf(dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=3,
        layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]))
    torch.manual_seed(seed)
    model = Qwen35(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * std)
    model.state = model.new_state(1, max_len)
    return model.eval()


def random_draft(target: Llama, block_size=8, seed=1, std=0.2, **extra) -> DFlashDraft:
    t = target.cfg
    hf = dict(architectures=["DFlashDraftModel"], hidden_size=t.hidden_size, intermediate_size=96,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=t.vocab_size, num_target_layers=t.num_layers, block_size=block_size,
              dflash_config=dict(mask_token_id=t.vocab_size - 1, target_layer_ids=[1, t.num_layers - 2]), **extra)
    torch.manual_seed(seed)
    draft = DFlashDraft(DraftConfig.from_hf(hf))
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * std)
    return draft.eval()


def run(target, prompt, params, draft=None, **kw) -> list[int]:
    return decode_tokens(target, target.state, prompt, params, draft=draft, **kw)


def oracle_proposals(monkeypatch, draft, truth: list[int], prompt_len: int, corrupt_every: int):
    """Make the draft propose the true continuation, corrupted at some positions, so that verify steps
    accept varying numbers of tokens and the rollback path is exercised. Tensor ops only (on the draft's device),
    so CUDA graphs can capture the draft step."""
    vocab = draft.cfg.vocab_size
    known = torch.tensor(truth + [0], device=next(draft.parameters()).device)  # 0 past the truth's end

    def forward(noise, positions, slot=0, live=None, context_rows=None):
        return positions.float()[:, None].expand(-1, 4)

    def compute_logits(hidden, lm_head):
        p = hidden[:, 0].long()  # position of each drafted token
        ids = known[(p - prompt_len).clamp(0, len(truth))]
        ids = torch.where((p * 2654435761 >> 7) % corrupt_every == 0, (ids + 1) % vocab, ids)
        return torch.zeros(len(p), vocab, device=hidden.device).scatter_(1, ids[:, None], 1.0)

    monkeypatch.setattr(draft, "forward", forward)
    monkeypatch.setattr(draft, "compute_logits", compute_logits)


@pytest.mark.parametrize("window", [None, 16])
def test_prompt_features_reach_the_draft_chunk_by_chunk(monkeypatch, window):
    """A prompt prefilled in chunks hands each chunk's features to the draft as it ends: the draft's ring (wrapping
    when its window is shorter than the prompt) holds what one hand-over of the whole prompt writes, and the
    speculative answer is still the plain one."""
    from flashdraft.engine import generate
    target = random_target()
    draft = random_draft(target, block_size=8)
    draft.setup_cache(window or target.state.max_len)
    prompt = torch.randint(0, 90, (50,), generator=torch.Generator().manual_seed(5))
    rings = {}
    for chunk in (1024, 7):
        monkeypatch.setattr(generate, "PREFILL_CHUNK", chunk)
        run(target, prompt, SamplingParams(max_tokens=1), draft=draft)
        rings[chunk] = [(c.k.clone(), c.v.clone()) for c in draft.caches], draft.state.row_positions.clone()
    assert torch.equal(rings[7][1], rings[1024][1]) and (rings[7][1] >= 0).sum() == min(50, window or 50)
    for (k7, v7), (k, v) in zip(rings[7][0], rings[1024][0]):  # (products over 7 rows or 50: float32 rounding)
        torch.testing.assert_close(k7, k, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v7, v, atol=1e-4, rtol=1e-4)
    params = SamplingParams(max_tokens=40)
    assert run(target, prompt, params, draft=draft, block_size=8) == run(target, prompt, params)


@pytest.mark.parametrize("block_size,window", [(2, None), (4, 5), (8, None), (8, 16), (16, 3)])
def test_greedy_speculative_is_token_identical(block_size, window):
    target = random_target()
    draft = random_draft(target, block_size=16)
    draft.setup_cache(window or target.state.max_len)
    prompt = torch.randint(0, 90, (20,))
    params = SamplingParams(max_tokens=80)
    plain = run(target, prompt, params)
    stats = SpecStats()
    spec = run(target, prompt, params, draft=draft, block_size=block_size, stats=stats)
    assert spec == plain
    assert stats.draft_steps and all(len(d) <= block_size - 1 for d in stats.draft_steps)


@pytest.mark.parametrize("corrupt_every", [3, 5, 11])
def test_greedy_rollback_with_partial_acceptance(monkeypatch, corrupt_every):
    target = random_target()
    draft = random_draft(target)
    draft.setup_cache(target.state.max_len)
    prompt = torch.randint(0, 90, (12,))
    params = SamplingParams(max_tokens=70)
    plain = run(target, prompt, params)
    oracle_proposals(monkeypatch, draft, plain, len(prompt), corrupt_every)
    stats = SpecStats()
    spec = run(target, prompt, params, draft=draft, stats=stats)
    assert spec == plain
    lengths = set(stats.acceptance_lengths)
    assert len(lengths) > 2 and max(lengths) > 2, lengths  # acceptance really varied


PENALTY_CASES = [SamplingParams(max_tokens=70, repeat_penalty=1.5, repeat_last_n=8),
                 SamplingParams(max_tokens=70, frequency_penalty=0.7, presence_penalty=0.5, repeat_last_n=-1),
                 SamplingParams(max_tokens=70, logit_bias={3: 2.0, 7: float("-inf")}, repeat_penalty=1.2)]


@pytest.mark.parametrize("params", PENALTY_CASES)
def test_greedy_penalties_follow_each_position_and_stay_lossless(monkeypatch, params):
    """Greedy with logit_bias and penalties: plain decoding equals a step-by-step oracle applying llama.cpp's
    samplers to the full-prefix logits, and speculative decoding (partial acceptance) equals plain."""
    target = random_target()
    prompt = torch.randint(0, 90, (12,))
    plain = run(target, prompt, params)
    ids = prompt.tolist()
    for _ in range(params.max_tokens):
        with torch.no_grad():
            logits, _ = forward1(target, target.state, torch.tensor(ids), torch.arange(len(ids)))
        ids.append(int(llama_cpp_penalties(logits[-1], ids, params).argmax()))
    assert plain == ids[len(prompt):]
    assert plain != run(target, prompt, SamplingParams(max_tokens=70))  # the adjustments changed the output
    draft = random_draft(target)
    draft.setup_cache(target.state.max_len)
    oracle_proposals(monkeypatch, draft, plain, len(prompt), 4)
    stats = SpecStats()
    assert run(target, prompt, params, draft=draft, stats=stats) == plain
    assert max(stats.acceptance_lengths) > 2


SEEDED_CASES = {"issue_guide": SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05),
                "temperature": SamplingParams(temperature=1.0),
                "top_p_min_p": SamplingParams(temperature=0.9, top_p=0.9, min_p=0.02),
                "penalties_bias": SamplingParams(temperature=0.8, top_k=40, repeat_penalty=1.3, frequency_penalty=0.4,
                                                 presence_penalty=0.3, repeat_last_n=6, logit_bias={3: 1.5, 7: -2.0})}


def seeded_spec_equals_plain(monkeypatch, params: SamplingParams, device: str = "cpu", static: bool = False) -> None:
    """A seeded sampled answer, speculative (a random draft: the target's token at every verified row; and the
    plain answer proposed back, corrupted here and there: partial acceptance) equals the seeded plain answer token
    for token, whatever ran before; another seed gives another answer."""
    target = random_target(max_len=256).to(device)
    target.state = target.new_state(1, 256)
    prompt = torch.randint(0, 90, (20,), generator=torch.Generator().manual_seed(2)).to(device)
    p = SamplingParams(**{**params.__dict__, "max_tokens": 48})
    kw = dict(device=device, static=static)
    plain = run(target, prompt, p, seed=1234, **kw)
    assert plain != run(target, prompt, p, seed=1235, **kw)
    draft = random_draft(target, block_size=8).to(device)
    draft.setup_cache(256)
    random_draft_stats = SpecStats()
    assert run(target, prompt, p, draft=draft, seed=1234, stats=random_draft_stats, **kw) == plain
    oracle_proposals(monkeypatch, draft, plain, len(prompt), 4)
    stats = SpecStats()
    assert run(target, prompt, p, draft=draft, seed=1234, stats=stats, **kw) == plain
    assert len(set(stats.acceptance_lengths)) > 2 and max(stats.acceptance_lengths) > 2  # acceptance varied
    assert run(target, prompt, p, seed=1234, **kw) == plain  # after other requests: the same answer


@pytest.mark.parametrize("name", list(SEEDED_CASES))
def test_seeded_sampling_speculative_equals_plain(monkeypatch, one_thread, name):
    seeded_spec_equals_plain(monkeypatch, SEEDED_CASES[name])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", list(SEEDED_CASES))
def test_seeded_sampling_speculative_equals_plain_in_cuda_graphs(monkeypatch, name):
    """The same on the GPU with every step and the sampler captured as CUDA graphs (the sampler's race in its
    Triton kernel)."""
    seeded_spec_equals_plain(monkeypatch, SEEDED_CASES[name], device="cuda", static=True)


def test_logprobs_are_the_models_own_and_equal_under_speculation(monkeypatch):
    target = random_target()
    prompt = torch.randint(0, 90, (12,))
    params = SamplingParams(max_tokens=30, logprobs=3)
    plain_lp: list = []
    plain = run(target, prompt, params, logprobs=plain_lp)
    ids = torch.cat([prompt, torch.tensor(plain)])
    with torch.no_grad():
        logits, _ = forward1(target, target.state, ids, torch.arange(len(ids)))
    ref = logits[len(prompt) - 1:-1].double().log_softmax(-1)
    assert [t for t, _, _ in plain_lp] == plain
    for row, (tok, lp, top) in zip(ref, plain_lp):
        assert abs(lp - float(row[tok])) < 1e-4
        assert [i for i, _ in top] == row.topk(3).indices.tolist()
        assert all(abs(v - float(row[i])) < 1e-4 for i, v in top)
    draft = random_draft(target)
    draft.setup_cache(target.state.max_len)
    oracle_proposals(monkeypatch, draft, plain, len(prompt), 3)
    spec_lp: list = []
    assert run(target, prompt, params, draft=draft, logprobs=spec_lp) == plain
    assert len(spec_lp) == len(plain_lp)
    for (t1, a, top1), (t2, b, top2) in zip(plain_lp, spec_lp):
        assert t1 == t2 and abs(a - b) < 1e-4 and [i for i, _ in top1] == [i for i, _ in top2]


def test_max_tokens_and_context_limits():
    target = random_target(max_len=64)
    draft = random_draft(target)
    draft.setup_cache(64)
    prompt = torch.randint(0, 90, (50,))
    out = run(target, prompt, SamplingParams(max_tokens=1000), draft=draft)
    assert len(out) == 64 - 50
    assert len(run(target, prompt, SamplingParams(max_tokens=5), draft=draft)) == 5
    with pytest.raises(ValueError, match="does not fit the context"):
        run(target, torch.randint(0, 90, (64,)), SamplingParams())


# ---- z-lab's reference loop as the oracle for the draft's proposals ----

def test_proposals_identical_to_zlab_reference(monkeypatch):
    transformers = pytest.importorskip("transformers")
    dflash_model = pytest.importorskip("dflash.model")
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)
    ours_target = random_target(vocab=128, layers=5, std=0.25)
    t = ours_target.cfg
    hf_cfg = transformers.LlamaConfig(vocab_size=t.vocab_size, hidden_size=t.hidden_size,
                                      intermediate_size=t.intermediate_size, num_hidden_layers=t.num_layers,
                                      num_attention_heads=t.num_heads, num_key_value_heads=t.num_kv_heads,
                                      rms_norm_eps=t.rms_norm_eps, max_position_embeddings=512)
    hf_cfg._attn_implementation = "sdpa"
    hf_target = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf_target.load_state_dict(ours_target.state_dict(), strict=False)
    draft = random_draft(ours_target, block_size=8, std=0.3)
    zcfg = transformers.Qwen3Config(**draft.cfg.to_hf())
    zcfg._attn_implementation = "sdpa"
    ref_draft = dflash_model.DFlashDraftModel(zcfg).eval()
    ref_draft.load_state_dict(draft.state_dict())
    proposals = []
    original = ref_draft.compute_logits

    def recording(hidden, head):
        logits = original(hidden, head)
        proposals.append(logits.argmax(-1)[0].tolist())
        return logits

    ref_draft.compute_logits = recording
    prompt = torch.randint(0, 120, (17,))
    ref = dflash_model.dflash_generate(ref_draft, hf_target, prompt[None], max_new_tokens=60, stop_token_ids=None,
                                       return_stats=True)
    draft.setup_cache(ours_target.state.max_len)
    stats = SpecStats()
    ours = run(ours_target, prompt, SamplingParams(max_tokens=60), draft=draft, stats=stats)
    assert ours == ref.output_ids[0, 17:].tolist()
    assert stats.draft_steps == proposals
    assert max(stats.acceptance_lengths) > 1  # the comparison covered accepted drafts too


# ---- sampling: lossless in distribution ----

COINS = torch.Generator().manual_seed(99)


def beellama_rule(drafted, logits, params, posterior):
    """The approximate rule the spec warns about: on mismatch it still accepts the draft with prob p(d)."""
    probs = filtered_probs(logits, params)
    for i, d in enumerate(drafted.tolist()):
        if d == int(posterior[i]):
            continue
        if torch.rand((), generator=COINS) < probs[i, d]:
            continue
        return i, int(posterior[i])
    return len(drafted), int(posterior[-1])


def llama_cpp_penalties(logits: torch.Tensor, ids: list[int], p: SamplingParams) -> torch.Tensor:
    """llama.cpp's logit-bias and penalties samplers for one row, written out token by token (the oracle for the
    engine's batched version): the window is the last repeat_last_n ids."""
    out = logits.clone().float()
    for tok, b in p.logit_bias.items():
        out[tok] += b
    window = ids if p.repeat_last_n < 0 else ids[max(0, len(ids) - p.repeat_last_n):] if p.repeat_last_n else []
    for tok in set(window):
        count = window.count(tok)
        out[tok] = out[tok] * p.repeat_penalty if out[tok] <= 0 else out[tok] / p.repeat_penalty
        out[tok] -= count * p.frequency_penalty + p.presence_penalty
    return out


def exact_first_tokens(target, prompt, params, n) -> dict[tuple, float]:
    """Exact probability of every n-token continuation without speculation (each a fresh forward from position 0:
    a recurrent layer's state does not continue the last one)."""
    out = {}
    for seq in itertools.product(range(target.cfg.vocab_size), repeat=n):
        ids = torch.cat([prompt, torch.tensor(seq[:-1], dtype=torch.long)])
        with torch.no_grad():
            logits, _ = forward1(target, target.state, ids, torch.arange(len(ids)), fresh=True)
        rows = logits[len(prompt) - 1:]
        rows = torch.stack([llama_cpp_penalties(r, ids[:len(prompt) + i].tolist(), params) for i, r in enumerate(rows)])
        probs = filtered_probs(rows, params)
        out[seq] = float(torch.prod(probs[torch.arange(n), torch.tensor(seq)]))
    return out


def chi_square_pvalue(counts: dict, expected: dict, total: int) -> float:
    from scipy.stats import chisquare
    keys = [k for k in expected if expected[k] * total >= 5]
    obs = [counts.get(k, 0) for k in keys]
    exp = [expected[k] * total for k in keys]
    scale = sum(obs) / sum(exp)
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


def sample_first_tokens(target, draft, prompt, params, n, samples, rule) -> dict[tuple, int]:
    counts: dict[tuple, int] = {}
    gen = torch.Generator().manual_seed(1234)
    p = SamplingParams(**{**params.__dict__, "max_tokens": n})
    for _ in range(samples):
        seq = tuple(run(target, prompt, p, draft=draft, generator=gen, accept_rule=rule))
        counts[seq] = counts.get(seq, 0) + 1
    return counts


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def small_vocab_pair(request):
    pytest.importorskip("scipy")
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    make = random_target if request.param == "llama" else random_hybrid_target
    target = make(vocab=3, layers=3, hidden=16, seed=3, std=0.4, max_len=16)
    draft = random_draft(target, block_size=4, seed=4, std=0.6)
    draft.setup_cache(target.state.max_len)
    return target, draft


SAMPLING_CASES = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.5, top_k=2, top_p=0.95, min_p=0.05),
                  SamplingParams(temperature=1.0, repeat_penalty=1.3, frequency_penalty=1.5, presence_penalty=0.5,
                                 repeat_last_n=3, logit_bias={1: 0.8})]  # short window: drafted rows slide it


def check_lossless(pair, params, samples):
    target, draft = pair
    prompt = torch.tensor([0, 1, 2, 1, 1])
    expected = exact_first_tokens(target, prompt, params, 3)
    counts = sample_first_tokens(target, draft, prompt, params, 3, samples, accept_matching_samples)
    assert chi_square_pvalue(counts, expected, samples) > 1e-3


@pytest.mark.parametrize("params", SAMPLING_CASES)
def test_sampling_distribution_is_lossless(small_vocab_pair, params):
    check_lossless(small_vocab_pair, params, 1500)


@pytest.mark.slow
@pytest.mark.parametrize("params", SAMPLING_CASES)
def test_sampling_distribution_is_lossless_many_samples(small_vocab_pair, params):
    check_lossless(small_vocab_pair, params, 30000)


def test_chi_square_catches_a_biased_rule(small_vocab_pair):
    """The same test, run once against a deliberately biased acceptance rule, fails."""
    target, draft = small_vocab_pair
    prompt = torch.tensor([0, 1, 2, 1, 1])
    params = SamplingParams(temperature=1.0)
    expected = exact_first_tokens(target, prompt, params, 3)
    counts = sample_first_tokens(target, draft, prompt, params, 3, 1500, beellama_rule)
    assert chi_square_pvalue(counts, expected, 1500) < 1e-6


def test_filtered_probs_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    p = filtered_probs(logits, SamplingParams(temperature=1.0, min_p=0.3))
    assert (p[0] > 0).tolist() == [True, True, False, False, False]
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert (p[0] > 0).tolist() == [True, False, False, False, False]


def test_static_shape_graph_path_matches_eager():
    from flashdraft.engine.graphs import GraphCache
    target = random_target(max_len=600)
    draft = random_draft(target)
    draft.setup_cache(600)
    prompt = torch.randint(0, 90, (240,))  # crosses the first bucket boundary (256) while decoding
    params = SamplingParams(max_tokens=40)
    eager = run(target, prompt, params, draft=draft)
    static = run(target, prompt, params, draft=draft, static=True)
    plain_static = run(target, prompt, params, static=True)
    assert eager == static == plain_static


def test_chunked_argmax_is_torch_argmax():
    """The GPU's chunked argmax picks the same index as torch.argmax, the first one on ties (within a chunk, across
    chunks, and a whole row of equal values)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64 * 70, generator=gen).to(torch.bfloat16)
    x[1, 5] = x[1, 3000] = 10.0  # tie across chunks
    x[2, 100] = x[2, 101] = 10.0  # tie inside a chunk
    x[3] = 1.0  # all equal
    x[4, -1] = 10.0  # the last column
    assert torch.equal(chunked_argmax(x), x.argmax(-1))
    assert chunked_argmax(x)[1] == 5 and chunked_argmax(x)[2] == 100 and chunked_argmax(x)[3] == 0


def test_warmup_also_runs_the_servers_default_sampling(tmp_path):
    """Warm-up generates greedily and with the command line's default sampling (EngineConfig.warmup_sampling), so
    the first request finds its sampler's graph captured; a greedy default adds nothing."""
    from tiny import make_target

    from flashdraft.engine.engine import Engine, EngineConfig
    folder = make_target(tmp_path / "t", layers=1)
    for sampling, greedy in ((dict(temperature=0.7, top_k=64, top_p=0.95), [True, False]),
                             (dict(temperature=0.0), [True])):
        engine = Engine.load(EngineConfig(model=str(folder), ctx_size=64, warmup_sampling=sampling))
        seen, generate = [], engine.generate
        engine.generate = lambda req: seen.append(req.params) or generate(req)
        engine.warmup(max_tokens=2)
        assert [p.greedy for p in seen] == greedy, seen
        assert seen[-1].top_k == (64 if len(greedy) == 2 else 0)


def test_warmup_readies_every_slots_sampler(tmp_path, monkeypatch):
    """With captured steps, warm-up also runs every slot's sampler for the greedy and the default sampling (a slot's
    sampler graphs are its own: a first request in a slot no request had used captured them while other streams
    waited); the requests after it answer as before it."""
    from tiny import make_target

    from flashdraft.engine.engine import Engine, EngineConfig, Request
    from flashdraft.engine.sampling import SamplingParams
    engine = Engine.load(EngineConfig(model=str(make_target(tmp_path / "t", layers=1)), ctx_size=64, n_slots=3,
                                      warmup_sampling=dict(temperature=0.7, top_k=64)))
    requests = [Request([3, 4, 5], SamplingParams(max_tokens=6, temperature=0.8, seed=1)),
                Request([3, 4, 5], SamplingParams(max_tokens=6, temperature=0.8, seed=2, repeat_penalty=1.3))]
    before = [engine.generate(r).token_ids for r in requests]
    engine.steps.samplers.clear()
    with monkeypatch.context() as m:  # the CUDA path's warm-up, its graph captures and generations left out
        m.setattr(engine.steps, "static", True)
        m.setattr(engine.steps, "warmup_keys", lambda *a: [])
        m.setattr(engine, "generate", lambda req: None)
        m.setattr(engine, "_warm_prompt_slices", lambda: None)
        engine.warmup(max_tokens=2)
    assert sorted(engine.steps.samplers) == [0, 1, 2]
    assert [engine.generate(r).token_ids for r in requests] == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_graph_outputs_survive_replays_of_other_pools():
    """engine/graphs.GraphCache: a step graph's outputs, captured after a sampler-like graph whose freed
    intermediates it could reuse in a shared pool, keep their values when that graph replays in its own pool (the
    decode loop reads a step's outputs after sampling: drafted tokens and features came back overwritten)."""
    from flashdraft.engine.graphs import GraphCache
    graphs = GraphCache("cuda")
    x = torch.randn(1 << 20, device="cuda")

    def sampler_like(v):
        wide = torch.cat([v * 2, v + 1])  # freed at the end of the capture: pool memory for later graphs
        return (wide.sum(),)

    def step(v):
        return (v * 3, v - 1)

    graphs.run("sample", sampler_like, [x], pool="sampler")
    outputs = graphs.run("step", step, [x])
    want = [o.clone() for o in outputs]
    for _ in range(3):
        graphs.run("sample", sampler_like, [torch.randn_like(x)], pool="sampler")
    torch.cuda.synchronize()
    assert all(torch.equal(o, w) for o, w in zip(outputs, want))


def test_prompt_slices_run_eager_layers_and_steps_the_compiled_ones():
    """The compiled layers serve the steps' shapes (widths CUDA graphs capture, bucketed attended lengths); a prompt's
    slice of the same width attends an arbitrary length, which would compile anew while running streams wait on it
    (1.4-3 s on the Gemma 4 31B shape, 2026-12-07 H100): slices run the layers eagerly."""
    from flashdraft.engine.generate import prefill
    target = random_target()
    calls = []

    def compiled(layer, *args):
        calls.append(args[0].shape[1])
        return layer(*args)
    target.compiled_layer, target.compiled_widths = compiled, {16}
    prompt = torch.randint(0, 90, (48,))
    prefill(target, target.state, prompt, 0, 0, None, 16, 16)  # a fresh first slice
    prefill(target, target.state, prompt, 0, 16, None, 32, 16)  # a slice over the cache, a compiled width
    assert calls == []
    positions = torch.arange(32, 48)[None]
    target(prompt[None, 32:], positions, target.state, 0, attn_len=256)  # a verify-shaped step
    assert calls == [16] * len(target.model.layers)
