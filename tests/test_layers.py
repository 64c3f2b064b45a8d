"""The shared layers against transformers' own modules (the variants Gemma and Qwen3.5 need), the per-layer
caches, and a family added through the registry alone."""
import json

import pytest
import torch

from flashdraft.layers.attention import AttentionSpec, attend, position_mask
from flashdraft.layers.kv_cache import KVCache
from flashdraft.layers.mlp import GatedMLP
from flashdraft.layers.norm import RMSNorm
from flashdraft.layers.rope import apply_rope, rope_cos_sin, rope_inv_freq, rotary_dim

transformers = pytest.importorskip("transformers")


def randomized(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_variants_match_hf(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    x = torch.randn(3, 5, 64).to(dtype) * 3
    cases = [(RMSNorm(64, 1e-6), LlamaRMSNorm(64, 1e-6)),
             (RMSNorm(64, 1e-6, offset=1.0), Gemma3RMSNorm(64, 1e-6)),  # HF checkpoints store w of (1 + w)
             (RMSNorm(64, 1e-6, fp32_weight=True), Gemma4RMSNorm(64, 1e-6)),
             (RMSNorm(64, 1e-6, weight=False), Gemma4RMSNorm(64, 1e-6, with_scale=False))]
    for ours, ref in cases:
        ref = randomized(ref).to(dtype)
        ours.load_state_dict(ref.state_dict())
        ours = ours.to(dtype)
        assert torch.equal(ours(x), ref(x)), (ours, ref)  # bit for bit: the multiply order matters in bf16


def test_gelu_tanh_mlp_matches_gemma():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP
    cfg = transformers.Gemma3TextConfig(hidden_size=32, intermediate_size=48, hidden_activation="gelu_pytorch_tanh")
    ref = randomized(Gemma3MLP(cfg))
    ours = GatedMLP(32, 48, act="gelu_tanh")
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(4, 32)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-4, atol=1e-5)
    silu = GatedMLP(32, 48, act="silu")
    silu.load_state_dict(ref.state_dict())
    assert (silu(x) - ref(x)).abs().max() > 1e-2  # the activation is really switched
    with pytest.raises(ValueError, match="gelu_tanh"):
        GatedMLP(32, 48, act="relu6")


class Rope:
    def __init__(self, head_dim, theta, scaling):
        self.head_dim, self.rope_theta, self.rope_scaling, self.max_position_embeddings = head_dim, theta, scaling, 4096


def test_proportional_rope_matches_hf():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    params = dict(rope_type="proportional", rope_theta=1e6, partial_rotary_factor=0.25, factor=1.0)
    hf_cfg = transformers.LlamaConfig(hidden_size=1024, num_attention_heads=2, head_dim=512, rope_parameters=params)
    ref, _ = ROPE_INIT_FUNCTIONS["proportional"](hf_cfg, None)
    ours, scale = rope_inv_freq(Rope(512, 1e6, params))
    assert torch.equal(ours, ref) and scale == 1.0 and rotary_dim(Rope(512, 1e6, params)) == 512
    assert (ours[64:] == 0).all() and (ours[:64] > 0).all()
    # zero frequencies leave those dims unrotated
    x = torch.randn(3, 512)
    y = apply_rope(x, rope_cos_sin(ours, torch.tensor([5, 17, 900]), 1.0))
    still = torch.cat([torch.arange(64, 256), torch.arange(320, 512)])
    assert torch.equal(y[:, still], x[:, still]) and not torch.allclose(y[:, :64], x[:, :64])


def test_partial_rope_matches_hf():
    from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb
    params = dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.25)
    hf_cfg = transformers.Qwen3NextConfig(hidden_size=256, num_attention_heads=2, head_dim=128,
                                          rope_parameters=params)
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding
    rotary = Qwen3NextRotaryEmbedding(hf_cfg)
    cfg = Rope(128, 1e4, params)
    ours_inv, _ = rope_inv_freq(cfg)
    assert rotary_dim(cfg) == 32 and torch.equal(ours_inv, rotary.inv_freq)
    positions = torch.tensor([[0, 3, 77]])
    q, k = torch.randn(1, 2, 3, 128), torch.randn(1, 2, 3, 128)
    cos, sin = rotary(q, positions)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin)
    cos_sin = rope_cos_sin(ours_inv, positions[0], 1.0)  # [T, 2, 32] for heads-first x [B, H, T, D]
    torch.testing.assert_close(apply_rope(q, cos_sin), ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_rope(k, cos_sin), ref_k, rtol=1e-5, atol=1e-5)


def reference_attention(q, k, v, mask, scale, softcap):
    """q [B, T, H, D], k/v [B, KV, L, D], mask [B, T, L] -> [B, T, H*D], K/V repeated per group, float64."""
    B, T, H, D = q.shape
    G = H // k.shape[1]
    k, v = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = torch.einsum("bthd,bhld->bhtl", q.double(), k) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("bhtl,bhld->bthd", s.softmax(-1), v).reshape(B, T, H * D)


@pytest.mark.parametrize("spec", [AttentionSpec(scale=0.25), AttentionSpec(scale=1.0, softcap=4.0),
                                  AttentionSpec(scale=0.125, window=5), AttentionSpec(scale=0.3, causal=False)])
@pytest.mark.parametrize("B,T", [(1, 1), (1, 7), (2, 3), (2, 80)])
def test_attend_matches_reference(spec, B, T):
    gen = torch.Generator().manual_seed(T)
    L = T + 20
    q = torch.randn(B, T, 4, 16, generator=gen)
    k, v = torch.randn(B, 2, L, 16, generator=gen), torch.randn(B, 2, L, 16, generator=gen)
    positions = torch.arange(20, L).expand(B, T)
    mask = position_mask(positions, torch.arange(L), spec.causal, spec.window)
    got = attend(q, k, v, mask, spec)
    torch.testing.assert_close(got.double(), reference_attention(q, k, v, mask, spec.scale, spec.softcap),
                               rtol=1e-4, atol=1e-5)
    if spec.causal and spec.window is None:  # mask None: causal over the chunk's own keys
        own = torch.arange(T).expand(B, T)
        got = attend(q, k[:, :, :T], v[:, :, :T], None, spec)
        want = reference_attention(q, k[:, :, :T], v[:, :, :T], position_mask(own, torch.arange(T)), spec.scale,
                                   spec.softcap)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_kv_cache_writes_and_reads_by_slot():
    cache = KVCache(n_slots=3, kv_heads=2, rows=10, head_dim=4, dtype=torch.float32, device="cpu")
    k, v = torch.randn(1, 3, 2, 4), torch.randn(1, 3, 2, 4)
    cache.write(1, torch.tensor([[4, 5, 6]]), k, v)  # one slot: a view written in place
    keys, values = cache.read(1, 7)
    assert keys.shape == (1, 2, 7, 4) and torch.equal(keys[0, :, 4:7], k[0].transpose(0, 1))
    assert torch.equal(values[0, :, 4:7], v[0].transpose(0, 1)) and not cache.k[[0, 2]].any()
    rows_k = torch.randn(2, 1, 2, 4)
    cache.write(torch.tensor([2, 0]), torch.tensor([[1], [8]]), rows_k, rows_k)  # one row per slot
    assert torch.equal(cache.k[2, :, 1], rows_k[0, 0]) and torch.equal(cache.k[0, :, 8], rows_k[1, 0])
    everything, _ = cache.read(slice(None), 10)
    assert everything.shape == (3, 2, 10, 4) and everything.data_ptr() == cache.k.data_ptr()  # a view
    assert cache.bytes_per_token == 2 * 2 * 4 * 4 * 3


def test_a_family_added_through_the_registry_alone_runs_in_the_engine(tmp_path, monkeypatch):
    """A toy family (llama's block, embeddings scaled by 2) is a class and a registry entry: an HF folder of its
    model_type loads, and the engine decodes it, speculatively too, with no other change."""
    from tiny import make_draft, make_target

    from flashdraft.engine.engine import Engine, EngineConfig, Request
    from flashdraft.engine.sampling import SamplingParams
    from flashdraft.models import registry
    from flashdraft.models.llama import Llama, LlamaConfig

    class Toy(Llama):
        def embed(self, ids):
            return super().embed(ids) * 2.0

    toy = registry.Family(name="toy", model_class=Toy, read_config=LlamaConfig.from_hf,
                          hf_classes={"toy": "LlamaForCausalLM"})
    monkeypatch.setattr(registry, "FAMILIES", [*registry.FAMILIES])
    registry.register(toy)
    folder = make_target(tmp_path / "toy", layers=3)
    draft = make_draft(tmp_path / "draft", folder)
    llama = Engine.load(EngineConfig(model=str(folder), draft=str(draft), ctx_size=256))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, model_type="toy")))
    engine = Engine.load(EngineConfig(model=str(folder), draft=str(draft), ctx_size=256))
    assert type(engine.target) is Toy
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = engine.generate(Request([5, 6, 7, 8], params, speculative=False))
    spec = engine.generate(Request([5, 6, 7, 8], params))
    assert spec.token_ids == plain.token_ids and spec.spec.draft_steps
    assert plain.token_ids != llama.generate(Request([5, 6, 7, 8], params, speculative=False)).token_ids
