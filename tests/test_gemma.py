"""Gemma 3 and Gemma 4 dense targets against transformers' own modeling on random small configs: logits of a whole
sequence, the same sequence through the cache in pieces (long chunks, single steps and a rejected verify block
over the sliding layers' window rings), greedy continuations, and speculative = plain decoding."""
import pytest
import torch
from test_engine import oracle_proposals, random_draft
from tiny import decode_tokens, forward1, greedy_continuation, loaded_from_hf

from flashdraft.engine.generate import SpecStats
from flashdraft.engine.sampling import SamplingParams
from flashdraft.models.gemma import Gemma, GemmaConfig

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6)
CONFIGS = {
    "gemma3": dict(model_type="gemma3_text", sliding_window=8, query_pre_attn_scalar=24),
    "gemma3-softcap": dict(model_type="gemma3_text", sliding_window=5, attn_logit_softcapping=20.0,
                           final_logit_softcapping=15.0, rope_parameters=dict(
                               full_attention=dict(rope_type="linear", factor=4.0, rope_theta=1e6),
                               sliding_attention=dict(rope_type="default", rope_theta=1e4))),
    "gemma4": dict(model_type="gemma4_text", sliding_window=8, global_head_dim=32, num_global_key_value_heads=1,
                   attention_k_eq_v=True, final_logit_softcapping=30.0, hidden_size_per_layer_input=0),
    "gemma4-separate-v": dict(model_type="gemma4_text", sliding_window=6, global_head_dim=32,
                              attention_k_eq_v=False, hidden_size_per_layer_input=0,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                           "sliding_attention", "sliding_attention", "full_attention"]),
}


def hf_model(name: str, std: float = 0.3):
    hf_cfg = transformers.AutoConfig.for_model(**BASE, **CONFIGS[name])
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    return model, hf_cfg.to_dict()


def ours_from(hf, cfg: dict, max_len: int = 512) -> Gemma:
    return loaded_from_hf(Gemma, GemmaConfig, hf, cfg, max_len)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers_whole_and_through_the_cache(name):
    hf, cfg = hf_model(name)
    ours = ours_from(hf, cfg)
    n = 160
    ids = torch.randint(0, BASE["vocab_size"], (n,))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        whole, _ = forward1(ours, ours.state, ids, torch.arange(n), fresh=True)
        pieces = [forward1(ours, ours.state, ids[:30], torch.arange(30), fresh=True)[0],
                  forward1(ours, ours.state, ids[30:110], torch.arange(30, 110))[0]]  # longer than a ring step
        # a verify block whose last 5 rows are rejected: its K/V stay in the rings, then decoding goes on
        forward1(ours, ours.state, torch.randint(0, 300, (8,)), torch.arange(113, 121))
        pieces.append(forward1(ours, ours.state, ids[110:113], torch.arange(110, 113))[0])
        pieces += [forward1(ours, ours.state, ids[p:p + 1], torch.tensor([p]))[0] for p in range(113, 130)]
        pieces.append(forward1(ours, ours.state, ids[130:], torch.arange(130, n))[0])
    scale = ref.abs().max()
    assert (whole - ref).abs().max() / scale < 1e-4
    assert (torch.cat(pieces) - ref).abs().max() / scale < 1e-4
    assert all(c.rows == cfg["sliding_window"] + Gemma.WINDOW_STEP for c, t in
               zip(ours.state.layers, ours.cfg.layer_types) if t == "sliding_attention")  # windows, not the context


def test_a_prompt_reuses_a_window_ring_only_where_it_continues_all_the_slot_held():
    """A new prompt sharing a prefix with what a slot held, whose last step may have left a rejected verify block
    of `extra` rows past it: the sliding layers' rings (window + 64 rows) then no longer hold the window before a
    shorter prefix (reusing 37 of 100 after a 16-row block changed the logits by 0.09), so only a prompt that
    continues everything held reuses it, with the fresh logits."""
    from flashdraft.engine.generate import prefill
    hf, cfg = hf_model("gemma4")
    ours, fresh = ours_from(hf, cfg), ours_from(hf, cfg)
    held = torch.randint(0, BASE["vocab_size"], (100,))
    with torch.no_grad():
        for shared, extra, want in ((30, 0, 0), (37, 16, 0), (99, 15, 0), (100, 15, 100), (100, 0, 100)):
            prompt = torch.cat([held[:shared], torch.randint(0, BASE["vocab_size"], (12,))])
            prefill(ours, ours.state, held, 0)
            if extra:  # a verify block from the last held position, its rows past it rejected
                forward1(ours, ours.state, torch.randint(0, 300, (extra + 1,)), torch.arange(99, 100 + extra))
                forward1(ours, ours.state, held[99:], torch.tensor([99]))  # the accepted anchor, written again
            keep = ours.state.reusable(0, len(held), shared)
            assert keep == want, (shared, extra)
            logits = prefill(ours, ours.state, prompt, 0, cached=keep)
            ref = prefill(fresh, fresh.state, prompt, 0)
            assert (logits - ref).abs().max() < 1e-4, (shared, extra)


@pytest.mark.parametrize("name", ["gemma3", "gemma4"])
def test_greedy_continuation_matches_transformers(name):
    hf, cfg = hf_model(name, std=0.2)
    ours = ours_from(hf, cfg)
    prompt = torch.randint(0, BASE["vocab_size"], (12,))
    with torch.no_grad():
        ref = hf.generate(prompt[None], max_new_tokens=64, do_sample=False, min_new_tokens=64)[0, 12:]
        out = greedy_continuation(ours, ours.state, prompt, 64, fresh=True)
    assert out == ref.tolist()


def test_captured_features_are_after_the_layer_scalar():
    hf, cfg = hf_model("gemma4")
    ours = ours_from(hf, cfg)
    ids = torch.randint(0, BASE["vocab_size"], (10,))
    with torch.no_grad():
        hidden = hf(ids[None], output_hidden_states=True).hidden_states
        _, feats = forward1(ours, ours.state, ids, torch.arange(10), capture=[1, 3], fresh=True)
    assert torch.allclose(feats, torch.cat([hidden[2][0], hidden[4][0]], dim=-1), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("block_size", [4, 8])
def test_speculative_equals_plain_on_gemma4(monkeypatch, block_size):
    hf, cfg = hf_model("gemma4", std=0.2)
    target = ours_from(hf, cfg)
    prompt = torch.randint(0, BASE["vocab_size"], (20,))
    params = SamplingParams(max_tokens=60)
    plain = decode_tokens(target, target.state, prompt, params)
    draft = random_draft(target, block_size=block_size)
    draft.setup_cache(target.state.max_len)
    oracle_proposals(monkeypatch, draft, plain, len(prompt), 3)
    stats = SpecStats()
    assert decode_tokens(target, target.state, prompt, params, draft=draft, stats=stats) == plain
    assert max(stats.acceptance_lengths) > 2


@pytest.mark.parametrize("key,value,words", [("hidden_size_per_layer_input", 16, "per-layer embeddings"),
                                             ("enable_moe_block", True, "mixture of experts"),
                                             ("num_kv_shared_layers", 2, "shared KV layers")])
def test_gemma4_features_not_supported_yet_are_named(key, value, words):
    cfg = transformers.AutoConfig.for_model(**BASE, **CONFIGS["gemma4"]).to_dict()
    with pytest.raises(ValueError, match=words):
        GemmaConfig.from_hf({**cfg, key: value})


@pytest.mark.parametrize("scale", [1.0, 64 ** 0.5])
def test_draft_input_is_the_stored_embedding_times_its_scale(scale):
    """z-lab's reference feeds the draft F.embedding(ids, target embedding weight) * input_embedding_scale: the
    raw rows, not Gemma's scaled input (the scale is the draft's, e.g. --spec-draft-embed-scale)."""
    from flashdraft.engine.steps import speculative_step
    hf, cfg = hf_model("gemma4", std=0.2)
    target = ours_from(hf, cfg)
    draft = random_draft(target, block_size=4, input_embedding_scale=scale)
    draft.setup_cache(target.state.max_len)
    seen = []
    forward = draft.forward
    draft.forward = lambda noise, *a, **k: seen.append(noise) or forward(noise, *a, **k)
    speculative_step(target, target.state, draft, torch.tensor([5]), torch.arange(10, 14), 0, 14)
    block = torch.tensor([5] + [draft.cfg.mask_token_id] * 3)  # the anchor and masks
    assert torch.equal(seen[0], hf.model.embed_tokens.weight[block] * scale)
    assert not torch.allclose(target.embed(block), target.token_embedding(block))  # Gemma scales its own input
