"""Quantized KV cache types (llama.cpp's q8_0/q5_0/q5_1/q4_0/q4_1): bit-equal to the gguf package's quantizers,
within each type's error bound, attention over the stored cache equal to attention over its expansion, and greedy
speculative decoding equal to plain decoding with every type pair."""
import numpy as np
import pytest
import torch
from gguf import quants
from test_engine import oracle_proposals, random_draft
from tiny import decode_tokens

from flashdraft.engine.config import KV_CACHE_TYPES as CONFIG_TYPES
from flashdraft.engine.generate import SpecStats
from flashdraft.engine.sampling import SamplingParams
from flashdraft.layers.kv_cache import KVCache, window_cache
from flashdraft.layers.kv_quant import BLOCK_KV_TYPES, KV_CACHE_TYPES, KVCodec, kv_codecs
from flashdraft.models.llama import Llama, LlamaConfig

# the largest |error| of a block in units of its largest |value| (q8_0, q5_0, q4_0) or half its range (q5_1,
# q4_1): half a grid step, except the symmetric types' top value, which the grid (-n..n-1 steps) clips by a step;
# plus the fp16 rounding of scale and min
BOUNDS = {"q8_0": 0.5 / 127 + 1e-3, "q5_0": 1 / 16 + 1e-3, "q5_1": 1 / 31 + 1e-3, "q4_0": 1 / 8 + 1e-3,
          "q4_1": 1 / 15 + 1e-3}


def test_the_command_lines_and_the_codecs_name_the_same_types():
    assert CONFIG_TYPES == KV_CACHE_TYPES


@pytest.mark.parametrize("name", list(BLOCK_KV_TYPES))
def test_quantize_equals_gguf_reference_and_round_trip_within_bound(name):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((96, 128)) * rng.uniform(1e-3, 30, (96, 1))).astype(np.float32)
    x[0], x[1, :32] = 0, 2.5  # an all-zero block and a constant one
    qtype = BLOCK_KV_TYPES[name]
    codec = KVCodec(name, torch.float32)
    stored = codec.encode(torch.from_numpy(x))
    assert stored.dtype == torch.uint8 and stored.shape == (96, codec.row_size(128))
    assert np.array_equal(stored.numpy(), quants.quantize(x, qtype))
    back = codec.decode(stored)
    assert np.array_equal(back.numpy(), quants.dequantize(stored.numpy(), qtype))
    blocks, err = x.reshape(-1, 32), (back.numpy() - x).reshape(-1, 32)
    scale = np.abs(blocks).max(-1) if name in ("q8_0", "q5_0", "q4_0") else np.ptp(blocks, -1) / 2
    assert (np.abs(err).max(-1) <= BOUNDS[name] * scale + 1e-6).all()


def test_bytes_per_token_are_the_layouts():
    for name, per_block in (("q8_0", 34), ("q5_0", 22), ("q5_1", 24), ("q4_0", 18), ("q4_1", 20), ("f16", 64),
                            ("bf16", 64), ("f32", 128)):
        cache = KVCache(1, 2, 16, 128, torch.float32, "cpu", kv_codecs((name, "q4_1"), torch.float32))
        assert cache.bytes_per_token == 2 * (4 * per_block + 4 * 20), name  # 2 heads x (K + V), 128 = 4 blocks


@pytest.mark.parametrize("types", [("q8_0", "q8_0"), ("q5_0", "q4_1"), ("q4_0", "q5_1")])
@pytest.mark.parametrize("window", [0, 8])
def test_rows_are_stored_quantized_and_read_expanded(types, window):
    """What a write stores is the quantization of the rows (at p, or p % rows in a window ring), and a read
    expands exactly that (attention then runs on the expansion, on the CPU and the GPU alike)."""
    torch.manual_seed(0)
    codecs = kv_codecs(types, torch.float32)
    cache = (window_cache(1, 2, window, 64, 32, torch.float32, "cpu", codecs) if window
             else KVCache(1, 2, 128, 32, torch.float32, "cpu", codecs))
    k, v = torch.randn(1, 100, 2, 32), torch.randn(1, 100, 2, 32)
    view = cache.view(0)
    view.write(torch.arange(100)[None], k, v)
    kept = torch.arange(100 - cache.rows, 100) if window else torch.arange(100)
    rows = kept % cache.rows if window else kept
    for stored, codec, x in ((cache.k, codecs[0], k), (cache.v, codecs[1], v)):
        assert torch.equal(stored[0][:, rows], codec.encode(x[0, kept].transpose(0, 1)))
    keys, values = view.read(100, torch.bfloat16)
    assert keys.dtype == torch.bfloat16 and keys.shape[2] == (cache.rows if window else 100)
    assert torch.equal(keys[0], codecs[0].decode(cache.k[0][:, :keys.shape[2]], torch.bfloat16))
    assert torch.equal(values[0], codecs[1].decode(cache.v[0][:, :keys.shape[2]], torch.bfloat16))


def random_llama(head_dim: int = 32) -> Llama:
    cfg = LlamaConfig(arch="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=2,
                      num_kv_heads=1, head_dim=head_dim, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = Llama(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * 0.2)
    return model.eval()


@pytest.mark.parametrize("types", [("q8_0", "q8_0"), ("q5_0", "q4_1"), ("q4_0", "q4_0"), ("q5_1", "f16"),
                                   ("bf16", "q8_0")])
def test_greedy_speculative_equals_plain_with_each_cache_type(monkeypatch, types):
    """Rollback over quantized rows (stale rows of rejected tokens, rewritten positions) keeps the tokens. On a
    real model a verify step's batched K/V projection can differ from a plain step's in the last bits, and a
    value on a rounding boundary then quantizes a step apart (docs/PERF.md): this small model has no such case."""
    target = random_llama()
    target.state = target.new_state(1, 256, types)
    assert target.state.layers[0].k.dtype == (torch.uint8 if types[0] in BLOCK_KV_TYPES else torch.bfloat16)
    prompt = torch.randint(0, 90, (20,))
    params = SamplingParams(max_tokens=50)
    plain = decode_tokens(target, target.state, prompt, params)
    draft = random_draft(target, block_size=8)
    draft.setup_cache(256)
    oracle_proposals(monkeypatch, draft, plain, len(prompt), 3)
    stats = SpecStats()
    assert decode_tokens(target, target.state, prompt, params, draft=draft, stats=stats) == plain
    assert max(stats.acceptance_lengths) > 2


def test_a_head_size_the_blocks_do_not_divide_is_named():
    with pytest.raises(ValueError, match="head size divisible by 32, got 16"):
        random_llama(head_dim=16).new_state(1, 64, ("q8_0", "f16"))
