"""Target models against HF transformers on random small configs of every architecture."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashdraft.models.llama import LlamaConfig
from tiny import decode_tokens, forward1, greedy_continuation, loaded_from_hf
from flashdraft.layers.rope import rope_inv_freq
from flashdraft.models.llama import Llama

transformers = pytest.importorskip("transformers")
TESTS = Path(__file__).parent

BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)

CONFIGS = {
    "llama": dict(model_type="llama", rope_theta=10000.0, tie_word_embeddings=True),
    "llama3-rope": dict(model_type="llama", rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)),
    "qwen2": dict(model_type="qwen2", rope_theta=1e6),
    "qwen2-yarn": dict(model_type="qwen2", rope_theta=1e6, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=128)),
    "qwen3": dict(model_type="qwen3", rope_theta=1e6, head_dim=24),
    "mistral": dict(model_type="mistral", rope_theta=1e4, sliding_window=7),
}


def hf_model(name: str):
    cfg = dict(BASE, **CONFIGS[name])
    hf_cfg = transformers.AutoConfig.for_model(**cfg)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model, hf_cfg.to_dict()


def ours_from(hf, cfg_dict: dict, max_len: int = 256) -> Llama:
    return loaded_from_hf(Llama, LlamaConfig, hf, cfg_dict, max_len, "rotary")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_hf(name):
    hf, cfg = hf_model(name)
    ours = ours_from(hf, cfg)
    ids = torch.randint(0, BASE["vocab_size"], (40,))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        got, _ = forward1(ours, ours.state, ids, torch.arange(40))
        # the same sequence fed in pieces through the cache
        a, _ = forward1(ours, ours.state, ids[:25], torch.arange(25))
        b, _ = forward1(ours, ours.state, ids[25:], torch.arange(25, 40))
    scale = ref.abs().max()
    assert (got - ref).abs().max() / scale < 1e-4
    assert (torch.cat([a, b]) - ref).abs().max() / scale < 1e-4


@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral"])
def test_greedy_continuation_matches_hf(name):
    hf, cfg = hf_model(name)
    ours = ours_from(hf, cfg)
    prompt = torch.randint(0, BASE["vocab_size"], (12,))
    with torch.no_grad():
        ref = hf.generate(prompt[None], max_new_tokens=64, do_sample=False, min_new_tokens=64)[0, 12:]
        out = greedy_continuation(ours, ours.state, prompt, 64)
    assert out == ref.tolist()


def test_captured_features_are_layer_outputs():
    hf, cfg = hf_model("qwen3")
    ours = ours_from(hf, cfg)
    ids = torch.randint(0, BASE["vocab_size"], (10,))
    with torch.no_grad():
        hidden = hf(ids[None], output_hidden_states=True).hidden_states
        _, feats = forward1(ours, ours.state, ids, torch.arange(10), capture=[1, 0])
    # HF's last hidden state is normed, so compare inner layers only (DFlash never taps the last)
    ref = torch.cat([hidden[2][0], hidden[1][0]], dim=-1)
    assert torch.allclose(feats, ref, atol=1e-5, rtol=1e-4)


YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096)


@pytest.mark.parametrize("extra", [{}, dict(mscale=0.707, mscale_all_dim=1.0), dict(attention_factor=1.5),
                                   dict(beta_fast=16, beta_slow=2, truncate=False)])
def test_yarn_frequencies_match_hf(extra):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf_cfg = transformers.LlamaConfig(**dict(BASE, hidden_size=512, max_position_embeddings=16384, rope_theta=1e6,
                                             rope_scaling=dict(YARN, **extra)))
    inv_freq, attention_factor = rope_inv_freq(LlamaConfig.from_hf(hf_cfg.to_dict()))
    ref_inv_freq, ref_attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, None)
    assert inv_freq.shape == (64,) and torch.equal(inv_freq, ref_inv_freq)
    assert attention_factor == ref_attention_factor


def test_unknown_architecture_is_named():
    from flashdraft.models.registry import read_config
    with pytest.raises(ValueError, match="gpt_neox.*supported: llama"):
        read_config(dict(BASE, model_type="gpt_neox"))


def check_compiled_layers(tmp_path: Path) -> None:
    """torch.compile'd decode/verify layers (the GPU fast path's fusion) give the eager logits and tokens."""
    from tiny import make_draft, make_target

    from flashdraft.engine.sampling import SamplingParams
    from flashdraft.formats.loader import load_target
    target, _, _ = load_target(str(make_target(tmp_path / "t", layers=4)))
    target.state = target.new_state(1, 128)
    prompt = torch.arange(3, 40)
    eager = decode_tokens(target, target.state, prompt, SamplingParams(max_tokens=12))
    block = torch.arange(50, 58)
    ref, _ = forward1(target, target.state, block, torch.arange(37, 45), attn_len=64)
    target.compile_layers((1, 8))
    out, _ = forward1(target, target.state, block, torch.arange(37, 45), attn_len=64)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert decode_tokens(target, target.state, prompt, SamplingParams(max_tokens=12)) == eager

    from flashdraft.formats.loader import load_draft
    draft = load_draft(str(make_draft(tmp_path / "d", tmp_path / "t", layers=2, block_size=8)), target)
    draft.setup_cache(64)
    _, feats = forward1(target, target.state, torch.arange(3, 40), torch.arange(37), capture=draft.cfg.target_layer_ids)
    draft.append_context(feats, torch.arange(37))
    noise = target.embed(torch.arange(60, 68))
    hidden = draft(noise, torch.arange(37, 45))
    draft.compile_layers()
    torch.testing.assert_close(draft(noise, torch.arange(37, 45)), hidden, rtol=1e-5, atol=1e-5)


def test_compiled_layers_trace_once_for_every_bucket(tmp_path):
    """Decode steps over every attended length (the CUDA graphs' buckets) share their compiled layer graphs: the
    first bucket's and one more, where static shapes traced one per bucket (each costing start-up time)."""
    import torch._dynamo
    from tiny import make_target

    from flashdraft.formats.loader import load_target
    from flashdraft.layers.compile import compile_layer_forward
    target, _, _ = load_target(str(make_target(tmp_path / "t", layers=2)))
    state = target.new_state(1, 4096)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    target.compiled_layer = compile_layer_forward(type(target.model.layers[0]).forward, backend=backend)
    target.compiled_widths = {1}
    with torch.inference_mode():
        for attn_len in (256, 512, 1024, 2048, 4096):
            target(torch.tensor([[5]]), torch.tensor([[100]]), state, 0, attn_len=attn_len)
    assert len(graphs) == 2, len(graphs)


@pytest.mark.slow
def test_compiled_layers_match_eager(tmp_path):
    check_compiled_layers(tmp_path)


@pytest.mark.slow
def test_compiled_layers_with_split_kernel_match_eager(tmp_path):
    """The same with the GPU's attention kernel in the compiled layers (a custom op), run by Triton's interpreter."""
    from test_split_attention import INTERPRETER
    if INTERPRETER is not None:
        pytest.skip(INTERPRETER)
    code = ("import pathlib, sys; from flashdraft.layers import attention; assert attention.SPLIT_KERNEL_LOADED; "
            f"sys.path.insert(0, {str(TESTS)!r}); import test_models; "
            f"test_models.check_compiled_layers(pathlib.Path({str(tmp_path)!r}))")
    env = dict(os.environ, TRITON_INTERPRET="1", FLASHDRAFT_ATTENTION="split")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("rows", [1, 2, 3, 15, 16, 64, 65])
def test_linear_few_row_cpu_path_matches_f_linear(rows):
    from flashdraft.layers.linear import Linear
    torch.manual_seed(rows)
    layer = Linear(48, 40, bias=True)
    x = torch.randn(rows, 48)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    torch.testing.assert_close(layer(x[None]), torch.nn.functional.linear(x[None], layer.weight, layer.bias))
    assert layer(x).is_contiguous() and layer(x).shape == (rows, 40)
