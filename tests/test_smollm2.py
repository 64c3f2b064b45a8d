"""The real SmolLM2-135M-Instruct GGUF: logits and greedy text against transformers, and lossless
speculation with a random draft."""
import pytest
import torch
from tiny import forward1

from flashdraft.draft import DFlashDraft, DraftConfig
from flashdraft.engine.engine import EngineConfig, Engine, Request
from flashdraft.engine.sampling import SamplingParams
from flashdraft.formats.chat import chat_ids

PROMPT = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]


@pytest.fixture(scope="module")
def engine(smollm2_gguf):
    return Engine.load(EngineConfig(str(smollm2_gguf), device="cpu", dtype="float32", ctx_size=512))


def random_draft_for(engine, block_size=8) -> DFlashDraft:
    t = engine.target.cfg
    hf = dict(architectures=["DFlashDraftModel"], hidden_size=t.hidden_size, intermediate_size=256,
              num_hidden_layers=1, num_attention_heads=t.num_heads, num_key_value_heads=t.num_kv_heads,
              head_dim=t.head_dim, vocab_size=t.vocab_size, num_target_layers=t.num_layers, block_size=block_size,
              rope_theta=t.rope_theta, dflash_config=dict(mask_token_id=16, target_layer_ids=[2, 14, 27]))
    torch.manual_seed(0)
    return DFlashDraft(DraftConfig.from_hf(hf)).eval()


def test_speculative_greedy_identical_with_random_draft(engine):
    ids = chat_ids(engine.tokenizer, PROMPT)
    plain = engine.generate(Request(prompt_ids=ids, params=SamplingParams(max_tokens=40), speculative=False))
    for block, window in [(4, None), (3, 16)]:
        spec_engine = Engine(engine.target, engine.tokenizer, random_draft_for(engine),
                             EngineConfig(device="cpu", ctx_size=512, block_size=block, draft_window=window))
        spec = spec_engine.generate(Request(prompt_ids=ids, params=SamplingParams(max_tokens=40)))
        assert spec.token_ids == plain.token_ids
        assert spec.spec.draft_steps


@pytest.mark.slow
def test_logits_and_greedy_match_transformers(engine, smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                           torch_dtype=torch.float32).eval()
    ids = chat_ids(engine.tokenizer, PROMPT)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        ours, _ = forward1(engine.target, engine.state, torch.tensor(ids), torch.arange(len(ids)))
        assert (ours - ref).abs().max() / ref.abs().max() < 1e-4
        greedy = hf.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False)[0, len(ids):]
    ours_greedy = engine.generate(Request(prompt_ids=ids, params=SamplingParams(max_tokens=64, ignore_eos=True)))
    assert ours_greedy.token_ids == greedy.tolist()
