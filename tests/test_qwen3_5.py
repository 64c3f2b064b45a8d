"""Qwen3.5 dense targets (Gated DeltaNet and gated attention layers) against transformers' own `qwen3_5` on random
small configs: logits of a whole sequence and of the same sequence through the caches in pieces, the two forms of
the delta rule, prefill in chunks against token by token, greedy generation through the engine (its prompt cache
keeping a recurrent state only for a prompt that continues it), speculative decoding (a verify block rolled back to
its accepted prefix in every layer; greedy answers equal to plain ones with a DFlash draft and with a drafter
without a model, over the adaptive width and the static step shapes), an HF Qwen3_5ForConditionalGeneration
checkpoint, and GGUF files written by llama.cpp's own convert_hf_to_gguf.py (sdist fixture of test_gemma_gguf.py).
The MoE variants are refused with their reason."""
import json
import queue
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_gemma_gguf import converter  # noqa: F401  (the llama.cpp converter fixture)
from test_engine import oracle_proposals
from tiny import decode_tokens, forward1, loaded_from_hf, make_draft, write_tokenizer

from flashdraft.engine import generate
from flashdraft.engine.adaptive import WidthController
from flashdraft.engine.config import EngineConfig
from flashdraft.engine.engine import Completion, Engine, Request, Task
from flashdraft.engine.generate import SpecStats
from flashdraft.engine.sampling import SamplingParams
from flashdraft.formats.gguf import gguf_to_hf_config, read_gguf
from flashdraft.formats.loader import load_target
from flashdraft.layers.gated_deltanet import chunked_delta_rule, recurrent_delta_rule
from flashdraft.layers.kv_cache import RecurrentCache
from flashdraft.models.qwen3_5 import Qwen35, Qwen35Config
from flashdraft.models.registry import read_config

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Qwen3_5ForCausalLM"):
    pytest.skip("this transformers has no qwen3_5", allow_module_level=True)

VOCAB = 320
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6, eos_token_id=2)
CONFIGS = {
    # value heads twice the key heads: HF's grouped order here, llama.cpp's tiled one in its GGUF files
    "grouped": dict(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=8),
    "tied-bias": dict(num_hidden_layers=5, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                      linear_value_head_dim=16, linear_conv_kernel_dim=3, tie_word_embeddings=True,
                      attention_bias=True, rope_parameters=dict(rope_type="default", rope_theta=1e6,
                                                                partial_rotary_factor=0.5),
                      layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention",
                                   "linear_attention"]),
}


def hf_model(name: str, std: float = 0.3):
    hf_cfg = transformers.AutoConfig.for_model("qwen3_5_text", **BASE, **CONFIGS[name])
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    model.generation_config.eos_token_id = None  # greedy references run their whole length
    return model, hf_cfg.to_dict()


def ours_from(hf, cfg: dict, max_len: int = 512) -> Qwen35:
    return loaded_from_hf(Qwen35, Qwen35Config, hf, cfg, max_len)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])  # the mask given: from pad_token_id, generate would mask the prompt's zeros
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers_whole_and_through_the_cache(name):
    hf, cfg = hf_model(name)
    ours = ours_from(hf, cfg)
    n = 150  # past a chunk of the chunked form, and not a multiple of it
    ids = torch.randint(0, VOCAB, (n,))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        whole, _ = forward1(ours, ours.state, ids, torch.arange(n), fresh=True)
        stateless, _ = forward1(ours, None, ids, torch.arange(n), fresh=True)
        pieces = [forward1(ours, ours.state, ids[:40], torch.arange(40), fresh=True)[0],  # chunked, from zeros
                  forward1(ours, ours.state, ids[40:45], torch.arange(40, 45))[0]]  # recurrent, from the cache
        pieces += [forward1(ours, ours.state, ids[p:p + 1], torch.tensor([p]))[0] for p in range(45, 60)]
        pieces.append(forward1(ours, ours.state, ids[60:], torch.arange(60, n))[0])  # chunked, from the cache
    assert relative_error(whole, ref) < 1e-4
    assert relative_error(stateless, ref) < 1e-4
    assert relative_error(torch.cat(pieces), ref) < 1e-4


@pytest.mark.parametrize("tokens", [1, 7, 64, 150])
def test_chunked_and_recurrent_delta_rule_agree(tokens):
    g = torch.Generator().manual_seed(tokens)
    B, H, Dk, Dv = 2, 3, 8, 5
    q, k = (torch.nn.functional.normalize(torch.randn(B, H, tokens, Dk, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(B, H, tokens, Dv, generator=g)
    decay = -torch.rand(B, H, tokens, generator=g) * 3  # down to e^-3 a token: whole chunks decay to nothing
    beta = torch.rand(B, H, tokens, generator=g)
    state = torch.randn(B, H, Dk, Dv, generator=g)
    out, last = recurrent_delta_rule(q, k, v, decay, beta, state)
    for chunk in (64, 16):
        chunked, chunked_last = chunked_delta_rule(q, k, v, decay, beta, state, chunk)
        assert torch.allclose(chunked, out, atol=1e-5) and torch.allclose(chunked_last, last, atol=1e-5)


def test_prefill_in_chunks_and_token_by_token_agree():
    hf, cfg = hf_model("grouped")
    ours = ours_from(hf, cfg)
    n = 100
    ids = torch.randint(0, VOCAB, (n,))
    by_token = ours.new_state(1, 128)
    with torch.no_grad():
        whole, _ = forward1(ours, ours.state, ids, torch.arange(n), fresh=True, logits_at="last")
        steps = [forward1(ours, by_token, ids[:1], torch.arange(1), fresh=True)[0]]
        steps += [forward1(ours, by_token, ids[p:p + 1], torch.tensor([p]))[0] for p in range(1, n)]
    assert relative_error(steps[-1], whole) < 1e-5
    recurrent = [(a, b) for a, b in zip(ours.state.layers, by_token.layers) if isinstance(a, RecurrentCache)]
    assert len(recurrent) == 3
    for a, b in recurrent:  # every layer's state and convolution rows after the n tokens: the same after both
        assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(a.at(0, n), b.at(0, n)))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A random HF qwen3_5 folder as a released checkpoint has it: a tokenizer, and an MTP head (mtp.*, one layer)
    beside the model, which loading leaves out."""
    from safetensors.torch import load_file, save_file
    folder = tmp_path_factory.mktemp("qwen3_5") / "hf"
    folder.mkdir()
    write_tokenizer(folder, VOCAB)
    hf, _ = hf_model("grouped", std=0.2)
    hf.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    H = BASE["hidden_size"]
    g = torch.Generator().manual_seed(1)
    mtp = {f"mtp.{name}.weight": torch.randn(H, generator=g)
           for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    mtp["mtp.fc.weight"] = torch.randn(H, 2 * H, generator=g)
    mtp.update({"mtp.layers.0." + k.removeprefix("model.layers.3."): v.clone()
                for k, v in tensors.items() if k.startswith("model.layers.3.")})  # a gated attention layer
    save_file(tensors | mtp, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"mtp_num_hidden_layers": 1}))
    return folder


@pytest.fixture(scope="module")
def hf_reference(folder):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return hf


def test_greedy_through_the_engine_matches_transformers(folder, hf_reference, monkeypatch):
    monkeypatch.setattr(generate, "PREFILL_CHUNK", 16)  # the prompt prefills in chunks, each from the last state
    engine = Engine.load(EngineConfig(model=str(folder), ctx_size=512))
    prompt = torch.randint(0, VOCAB, (40,)).tolist()
    done = engine.generate(Request(prompt, SamplingParams(max_tokens=48, ignore_eos=True)))
    assert done.token_ids == hf_greedy(hf_reference, prompt, 48)
    # bucketed step shapes, as CUDA graphs capture them (run eagerly here)
    tokens = decode_tokens(engine.target, engine.state, torch.tensor(prompt), SamplingParams(max_tokens=48),
                           static=True)
    assert tokens == done.token_ids
    assert engine.memory["kv_cache"] == engine.state.bytes > 0


def test_prompt_cache_keeps_a_recurrent_state_only_for_a_prompt_that_continues_it(folder, hf_reference):
    engine = Engine.load(EngineConfig(model=str(folder), ctx_size=512))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompt = torch.randint(0, VOCAB, (30,)).tolist()
    first = engine.generate(Request(prompt, params))
    held = prompt + first.token_ids[:-1]  # what the slot's caches hold after it
    follow_up = held + [7, 8, 9]
    second = engine.generate(Request(follow_up, params))
    assert second.timings.cache_n == len(held)
    assert second.token_ids == hf_greedy(hf_reference, follow_up, 12)
    # a prompt sharing only part of what the slot holds, short of the last prompt's end: the recurrent state is
    # past it and the saved one (after the last prompt) too, so nothing is reused
    branch = prompt[:20] + [5, 6]
    third = engine.generate(Request(branch, params))
    assert third.timings.cache_n == 0
    assert third.token_ids == hf_greedy(hf_reference, branch, 12)
    # the same prompt again: its last token must run, which a recurrent state cannot take back
    again = engine.generate(Request(branch, params))
    assert again.timings.cache_n == 0 and again.token_ids == third.token_ids


def test_a_conversation_reuses_the_state_saved_after_each_prompt(folder, hf_reference):
    """Three turns where each next prompt keeps the previous prompt but not the answer as generated (a template
    that leaves the reasoning out): the slot's state after each prompt is saved, so the next turn prefills only
    what follows it, and the answers are the ones without a prompt cache."""
    engine, fresh = (Engine.load(EngineConfig(model=str(folder), ctx_size=512)) for _ in range(2))
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    prompt = torch.randint(0, VOCAB, (24,)).tolist()
    for turn in range(3):
        done = engine.generate(Request(prompt, params))
        assert done.timings.cache_n == (0 if turn == 0 else previous)
        assert done.token_ids == hf_greedy(hf_reference, prompt, 10)
        alone = fresh.generate(Request(prompt, params, cache_prompt=False))
        assert alone.timings.cache_n == 0 and alone.token_ids == done.token_ids
        held = len(prompt) + 9  # every state after the turn is the one of a run without the prompt cache
        for ours, theirs in zip(layer_states(engine.state, 0, held), layer_states(fresh.state, 0, held)):
            torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
        previous = len(prompt)
        prompt = prompt + [9, 10] + done.token_ids[2:6] + [11, 12, 13]  # the answer's start left out


def layer_states(state, slot: int, length: int) -> list[torch.Tensor]:
    """What every layer holds for a slot's first `length` tokens: a recurrent layer's state and convolution rows,
    an attention layer's K and V rows."""
    out = []
    for cache in state.layers:
        if isinstance(cache, RecurrentCache):
            out += [t.clone() for t in cache.at(slot, length)]
        else:
            out += [cache.k[slot, :, :length].clone(), cache.v[slot, :, :length].clone()]
    return out


def saved(state):
    """Every tensor of a state, and a function that puts them back."""
    held = [t for c in state.layers
            for t in ((c.state, c.base, c.conv, *c.inputs) if isinstance(c, RecurrentCache) else (c.k, c.v))]
    copies = [t.clone() for t in held]
    return lambda: [t.copy_(c) for t, c in zip(held, copies)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_verify_block_rolls_back_to_its_accepted_prefix(name):
    """After a verify of w tokens with the first a of them accepted, every layer holds for the slot's first
    start + a tokens what a forward of the accepted tokens alone leaves (through a state that keeps no step, so
    no inputs to replay): exactly for a = 0 and a = w, and to float32 rounding between, where it is exactly
    the same whatever the w - a rejected tokens were. (Not bit for bit at every a: the CPU's matrix products and
    vectorised functions round a row by the row count of the forward it is in.)"""
    hf, cfg = hf_model(name)
    model = ours_from(hf, cfg)
    state, alone = model.new_state(1, 64), model.new_state(1, 64)
    state.allow_rollback(8)
    g = torch.Generator().manual_seed(0)
    start = 20
    prompt = torch.randint(0, VOCAB, (start,), generator=g)
    with torch.no_grad():
        for s in (state, alone):
            forward1(model, s, prompt, torch.arange(start), fresh=True)
        restore, restore_alone = saved(state), saved(alone)

        def verify(ids: torch.Tensor, accepted: int) -> list[torch.Tensor]:
            restore()
            forward1(model, state, ids, torch.arange(start, start + len(ids)))
            state.commit(0, start + accepted)
            return layer_states(state, 0, start + accepted)

        for w in (2, 5, 8):
            block = torch.randint(0, VOCAB, (w,), generator=g)
            for a in range(w + 1):
                got = verify(block, a)
                restore_alone()
                if a:
                    forward1(model, alone, block[:a], torch.arange(start, start + a))
                want = layer_states(alone, 0, start + a)
                if a in (0, w):
                    assert all(map(torch.equal, got, want)), (w, a)
                for x, y in zip(got, want):
                    assert relative_error(x, y) < 1e-5, (w, a)
                rejected_otherwise = torch.cat([block[:a], (block[a:] + 1) % VOCAB])
                assert all(map(torch.equal, got, verify(rejected_otherwise, a))), (w, a)


class ReplayDrafter:
    """A drafter with no model and no target layers (the pattern of test_drafters.LookupDrafter) that proposes the
    plain answer's next tokens, one in `corrupt_every` of them changed, so verify steps accept varying numbers."""
    name, target_layers, state = "replay", (), None

    def __init__(self, answer: list[int], start: int, corrupt_every: int, block_size: int = 6):
        self.answer, self.start, self.block_size = torch.tensor(answer + [0] * block_size), start, block_size
        self.corrupt = torch.rand(len(self.answer), generator=torch.Generator().manual_seed(corrupt_every)) < \
            1 / corrupt_every

    def setup_cache(self, window, n_slots=1, cache_dtypes=(None, None)):
        self.state = SimpleNamespace(bytes=0)

    def reset(self, slot=0, keep=0):
        pass

    def observe(self, tokens, features, positions, slots=0):
        assert features is None

    def propose(self, target, anchors, positions, slots, k, live=None, block=None, context_rows=None):
        i = (positions[0] + 1 + torch.arange(k) - self.start).clamp(0, len(self.answer) - 1)  # answer[i]: start + i
        return torch.where(self.corrupt[i], (self.answer[i] + 1) % VOCAB, self.answer[i])[None]

    def compile_layers(self, block_sizes=None):
        pass


@pytest.fixture(scope="module")
def draft_folder(folder, tmp_path_factory) -> Path:
    return make_draft(tmp_path_factory.mktemp("qwen3_5_draft") / "dflash", folder, block_size=8)


def test_greedy_speculative_with_a_dflash_draft_equals_plain(folder, draft_folder, monkeypatch):
    """A DFlash draft made for the hybrid target: speculative answers equal plain ones, with the draft as it is and
    with its proposals replaced by the plain answer corrupted at some positions (every acceptance length)."""
    engine = Engine.load(EngineConfig(model=str(folder), draft=str(draft_folder), ctx_size=512))
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    prompt = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = engine.generate(Request(prompt, params, speculative=False))
    spec = engine.generate(Request(prompt, params))
    assert spec.token_ids == plain.token_ids and spec.spec.draft_steps
    oracle_proposals(monkeypatch, engine.draft, plain.token_ids, len(prompt), corrupt_every=5)
    stats = SpecStats()
    tokens = decode_tokens(engine.target, engine.state, torch.tensor(prompt), params, draft=engine.draft, stats=stats)
    assert tokens == plain.token_ids
    assert len(set(stats.acceptance_lengths)) > 2, stats.acceptance_lengths


def test_greedy_speculative_with_a_lookup_drafter_equals_plain(folder, hf_reference):
    """A drafter without a model or target layers on the hybrid target: answers equal plain ones, at every
    acceptance length, and the prompt cache then continues from the state after exactly the tokens a slot holds."""
    target, tokenizer, _ = load_target(str(folder))
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = torch.randint(0, VOCAB, (25,), generator=torch.Generator().manual_seed(4)).tolist()
    plain = Engine(target, tokenizer, None, EngineConfig(ctx_size=256)).generate(Request(prompt, params))
    for corrupt_every in (3, 5, 11):
        engine = Engine(target, tokenizer, ReplayDrafter(plain.token_ids, len(prompt), corrupt_every),
                        EngineConfig(ctx_size=256))
        spec = engine.generate(Request(prompt, params))
        assert spec.token_ids == plain.token_ids
        assert len(set(spec.spec.acceptance_lengths)) > 2, spec.spec.acceptance_lengths
    # the last step was cut at max_tokens (its bonus token dropped): the slot holds the prompt and every output token
    # but the last, which the step ran
    assert 1 + sum(spec.spec.acceptance_lengths) > len(spec.token_ids)
    held = prompt + spec.token_ids[:-1]
    follow_up = held + [7, 8, 9]
    engine.draft.answer[:12] = torch.tensor(hf_greedy(hf_reference, follow_up, 12))
    engine.draft.start = len(follow_up)
    again = engine.generate(Request(follow_up, SamplingParams(max_tokens=12, ignore_eos=True)))
    assert again.timings.cache_n == len(held) and again.spec.draft_n_accepted > 0
    assert again.token_ids == hf_greedy(hf_reference, follow_up, 12)


def test_adaptive_width_on_a_hybrid_target(folder, hf_reference):
    """The adaptive verify width (plain steps the drafter follows between verify steps) keeps answers plain, and the
    steps that time the widths, which overwrite a slot's recurrent state, run before a request takes its slot
    (the first speculative request, of a fixed width here), so a request continuing it reuses a state it can."""
    target, tokenizer, _ = load_target(str(folder))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompt = torch.randint(0, VOCAB, (25,), generator=torch.Generator().manual_seed(5)).tolist()
    answer = hf_greedy(hf_reference, prompt, 64)
    engine = Engine(target, tokenizer, ReplayDrafter(answer, len(prompt), 3), EngineConfig(ctx_size=256,
                                                                                        adaptive=True))
    fixed = engine.generate(Request(prompt, params, block_size=4))
    assert fixed.token_ids == answer[:12]
    held = prompt + fixed.token_ids[:-1]
    again = engine.generate(Request(held + [7, 8], params))
    assert engine.width_costs is not None and again.timings.cache_n == len(held)
    assert again.token_ids == hf_greedy(hf_reference, held + [7, 8], 12)
    # proposals right, then wrong (the width falls to plain steps), then right again (a probe from plain steps)
    engine.draft.corrupt = (torch.arange(len(answer) + 6) >= 12) & (torch.arange(len(answer) + 6) < 36)
    stats = SpecStats()
    tokens = decode_tokens(engine.target, engine.state, torch.tensor(prompt), SamplingParams(max_tokens=64),
                           draft=engine.draft, stats=stats,
                           controller=WidthController({1: 1.0, 2: 1.15, 4: 1.4, 6: 1.7}))
    assert tokens == answer
    assert sum(stats.acceptance_lengths) < 63 and stats.acceptance_lengths[-1] > 1


def test_static_shape_path_matches_eager_on_a_hybrid_target(folder, draft_folder):
    """Bucketed step shapes, as CUDA graphs capture them (run eagerly here), across a bucket boundary."""
    engine = Engine.load(EngineConfig(model=str(folder), draft=str(draft_folder), ctx_size=600))
    prompt = torch.randint(0, VOCAB, (240,), generator=torch.Generator().manual_seed(6))
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    def run(**kw):
        return decode_tokens(engine.target, engine.state, prompt, params, **kw)

    eager = run(draft=engine.draft)
    assert eager == run(draft=engine.draft, static=True) == run(static=True) == run()


def test_conditional_generation_checkpoint_loads_its_language_model(folder, hf_reference, tmp_path):
    """Qwen3_5ForConditionalGeneration names: model.language_model.*, a vision tower (model.visual.*) and mtp.*."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(folder / "model.safetensors")
    renamed = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in tensors.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3, 2, 2)
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    text = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="qwen3_5", tie_word_embeddings=False,
                                                          architectures=["Qwen3_5ForConditionalGeneration"],
                                                          text_config=text, vision_config={})))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((folder / name).read_text())
    target, _, _ = load_target(str(tmp_path))
    ids = torch.randint(0, VOCAB, (1, 30))
    with torch.no_grad():
        ref = hf_reference(ids).logits[0]
        got, _ = target(ids, torch.arange(30)[None], target.new_state(1, 64), 0, fresh=True)
    assert relative_error(got[0], ref) < 1e-4


def test_greedy_speculative_with_the_mtp_head_equals_plain(folder):
    """`--spec-type mtp`: the checkpoint's own MTP block drafts (read beside the target from the same folder, not
    part of it), and greedy answers equal plain ones; chained proposals of n_max tokens (--spec-draft-n-max)."""
    engine = Engine.load(EngineConfig(model=str(folder), spec_type="mtp", draft_params={"draft_n_max": 2},
                                      ctx_size=512))
    assert engine.draft.name == "mtp" and engine.draft.block_size == 3 and engine.memory["draft_weights"] > 0
    assert engine.memory["weights"] == Engine.load(EngineConfig(model=str(folder), ctx_size=64)).memory["weights"]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    plain = engine.generate(Request(prompt, params, speculative=False))
    spec = engine.generate(Request(prompt, params))
    assert spec.token_ids == plain.token_ids and spec.spec.draft_steps
    assert max(len(d) for d in spec.spec.draft_steps) == 2


def test_two_slots_speculating_in_batched_steps_equal_plain(folder):
    """Two slots' verify steps batched (slots as a tensor, each row continuing its own slot from its own start):
    greedy answers equal plain ones."""
    check_batched_mtp_equals_plain(Engine.load(EngineConfig(model=str(folder), spec_type="mtp", ctx_size=256,
                                                            n_slots=2)), 24)


def check_batched_mtp_equals_plain(engine: Engine, tokens: int) -> None:
    """Each slot's plain answer, then every slot's speculative one at once (batched steps): the same tokens."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    prompts = [torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(7 + i)).tolist()
               for i in range(engine.n_slots)]
    plain = [engine.generate(Request(p, params, speculative=False)).token_ids for p in prompts]
    done: list[queue.Queue] = [queue.Queue() for _ in prompts]
    with engine._wake:  # all queued before the engine admits any: batched steps
        for p, q in zip(prompts, done):
            engine.submit(Request(p, params), lambda e, q=q: isinstance(e, (Completion, Exception)) and q.put(e))
    spec = [q.get(timeout=600) for q in done]
    assert [s.token_ids for s in spec] == plain and all(s.spec.draft_steps for s in spec)


def run_task(engine, events: list, prompt: list[int], n: int, **request) -> Task:
    task = Task(Request(prompt, SamplingParams(max_tokens=n, **request), speculative=False), None, events.append)
    engine._incoming.append(task)
    return task


def last_completion(events: list) -> Completion:
    return [e for e in events if isinstance(e, Completion)][-1]


@pytest.mark.parametrize("spec_type", [None, "mtp"])
def test_a_request_cancelled_mid_prompt_leaves_its_slot_continuable(folder, hf_reference, spec_type):
    """A request cancelled while its prompt is read beside another stream: the slot's recurrent state has moved
    past the tokens it goes back holding; a next prompt continuing those tokens still gets transformers' answer
    (the slot's state is not taken where it cannot be continued from there)."""
    engine = Engine.load(EngineConfig(model=str(folder), ctx_size=1024, n_slots=2, spec_type=spec_type))
    events, g = [], torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB, (30,), generator=g).tolist()
    first = run_task(engine, events, prompt, 4, ignore_eos=True)
    while first.req.slot is None or not first.released.is_set():
        engine.step()
    held = prompt + last_completion(events).token_ids[:-1]
    run_task(engine, events, torch.randint(0, VOCAB, (20,), generator=g).tolist(), 400, ignore_eos=True)
    for _ in range(3):
        engine.step()
    cancelled = run_task(engine, events, held + torch.randint(0, VOCAB, (600,), generator=g).tolist(), 4,
                         ignore_eos=True)
    engine.step()
    engine.step()
    assert cancelled.cached == len(held) and len(held) < cancelled.state.prefilled < len(cancelled.req.prompt_ids)
    cancelled.req.cancel.set()
    engine.step()
    assert cancelled.released.is_set()
    follow = held + [7, 8, 9]
    last = run_task(engine, events, follow, 8, ignore_eos=True)
    while not last.released.is_set():
        engine.step()
    assert last_completion(events).token_ids == hf_greedy(hf_reference, follow, 8)


def test_an_answer_stopped_at_its_end_token_then_continued(folder, hf_reference):
    """A plain answer that stops at an end token: the overlapped step after it ran that token before the host saw
    it, so the slot's state went one token past what it holds; a next prompt continuing the answer reuses it all
    (the state before that token kept) and gets transformers' answer."""
    engine = Engine.load(EngineConfig(model=str(folder), ctx_size=512))
    events, prompt = [], torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = hf_greedy(hf_reference, prompt, 12)
    stop = ref[5]
    assert stop not in ref[:5]
    answer = run_task(engine, events, prompt, 12)
    engine.step()
    answer.out.eos = {stop}
    while not answer.released.is_set():
        engine.step()
    done = last_completion(events)
    assert done.token_ids == ref[:6]
    follow = prompt + done.token_ids[:-1] + [7, 8, 9]
    last = run_task(engine, events, follow, 8, ignore_eos=True)
    while not last.released.is_set():
        engine.step()
    assert last_completion(events).token_ids == hf_greedy(hf_reference, follow, 8)
    assert last_completion(events).timings.cache_n == len(follow) - 3  # the whole answer's state reused


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("n_slots", [1, 2])
def test_mtp_head_in_cuda_graphs_equals_plain(folder, n_slots):
    """The MTP drafter's chained steps captured in the step graphs (slots as tensors), one slot and two at once:
    greedy answers equal plain ones."""
    engine = Engine.load(EngineConfig(model=str(folder), spec_type="mtp", device="cuda", dtype="float32",
                                      ctx_size=256, n_slots=n_slots))
    assert engine.steps.static
    check_batched_mtp_equals_plain(engine, 40)


def test_mtp_needs_a_checkpoint_that_has_one(folder, tmp_path):
    from flashdraft.formats.loader import create_drafter
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in folder.iterdir():
        (bare / f.name).write_bytes(f.read_bytes())
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps(config | {"mtp_num_hidden_layers": 0}))
    target, _, path = load_target(str(bare))
    with pytest.raises(ValueError, match="this checkpoint holds no MTP block"):
        create_drafter("mtp", target, source=path)
    from tiny import make_target
    llama, _, llama_path = load_target(str(make_target(tmp_path / "llama")))
    with pytest.raises(ValueError, match="llama models have no MTP block"):
        create_drafter("draft-mtp", llama, source=llama_path)


@pytest.mark.parametrize("model_type", ["qwen3_5_moe", "qwen3_5_moe_text"])
def test_moe_variants_are_not_supported_yet(model_type):
    with pytest.raises(ValueError, match=f"mixture-of-experts models \\({model_type}\\) are not supported yet"):
        read_config(dict(model_type=model_type))


def convert(root: Path, folder: Path, outtype: str = "f32") -> Path:
    """llama.cpp's convert_hf_to_gguf.py on `folder`. The tiny test vocabulary is no model's that the converter
    knows by its pre-tokenizer hash, so that check answers `qwen35` (what it writes for Qwen3.5's own)."""
    out = folder.with_suffix(".gguf")
    run = ("import runpy, sys; root = sys.argv[1]; sys.path[:0] = [root, root + '/gguf-py']; "
           "import conversion.base as base; base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'qwen35'; "
           "sys.argv = [root + '/convert_hf_to_gguf.py'] + sys.argv[2:]; "
           "runpy.run_path(sys.argv[0], run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", run, str(root), str(folder), "--outfile", str(out), "--outtype",
                        outtype], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_gguf_from_llama_cpp_converter(converter, folder, hf_reference):  # noqa: F811
    gguf = convert(converter, folder)
    g = read_gguf(gguf)
    assert g.architecture == "qwen35" and g.metadata["qwen35.nextn_predict_layers"] == 1
    assert "blk.4.nextn.eh_proj.weight" in g.tensors  # the MTP layer after the model's four, left out
    target, _, _ = load_target(str(gguf))
    assert target.cfg.tiled_value_heads and target.cfg.num_layers == 4
    ids = torch.randint(0, VOCAB, (1, 100))
    with torch.no_grad():
        ref = hf_reference(ids).logits[0]
        got, _ = target(ids, torch.arange(100)[None], target.new_state(1, 128), 0, fresh=True)
    assert relative_error(got[0], ref) < 1e-4  # -exp(A_log), the baked-in (1 + w) and the tiled heads undone
    engine = Engine.load(EngineConfig(model=str(gguf), ctx_size=256))
    prompt = torch.randint(0, VOCAB, (25,)).tolist()
    done = engine.generate(Request(prompt, SamplingParams(max_tokens=32, ignore_eos=True)))
    assert done.token_ids == hf_greedy(hf_reference, prompt, 32)


def test_mtp_head_of_a_gguf_from_llama_cpp_converter(converter, folder):  # noqa: F811
    """The MTP block of llama.cpp's converted file (blk.4.nextn.* and blk.4.attn_*, norms stored as 1 + w) drafts
    as the HF folder's: the same K/V from the same committed positions, the same chained proposals."""
    from flashdraft.formats.loader import create_drafter
    gguf = convert(converter, folder)
    drafters = []
    for source in (folder, gguf):
        target, _, path = load_target(str(source))
        drafter = create_drafter("mtp", target, params={"draft_n_max": 4}, source=path)
        drafter.setup_cache(64)
        ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(6))
        with torch.no_grad():
            _, features = target(ids, torch.arange(20)[None], target.new_state(1, 64), 0,
                                 capture=drafter.target_layers, fresh=True)
            drafter.observe(ids[:, :19], features[:, :19], torch.arange(19)[None], 0)
            proposed = drafter.propose(target, ids[0, 19:], torch.tensor([19]), 0, 4)
        drafters.append((drafter, proposed))
    (hf, hf_proposed), (gg, gg_proposed) = drafters
    assert torch.equal(hf_proposed, gg_proposed)
    assert relative_error(gg.state.cache.k, hf.state.cache.k) < 1e-5
    assert relative_error(gg.state.cache.v, hf.state.cache.v) < 1e-5


def test_moe_gguf_is_not_supported_yet(converter, folder):  # noqa: F811
    g = read_gguf(convert(converter, folder))
    metadata = {k.replace("qwen35.", "qwen35moe."): v for k, v in g.metadata.items()}
    with pytest.raises(ValueError, match=r"\(qwen35moe\) are not supported yet"):
        gguf_to_hf_config({**metadata, "general.architecture": "qwen35moe"}, g.tensors)
