"""Quantized KV cache types (llama.cpp's q8_0/q5_0/q5_1/q4_0/q4_1/iq4_nl and the rotated turbo3/turbo4): bit-equal
to the gguf package's quantizers (iq4_nl: to a port of llama.cpp's CUDA copy kernel, decoded by the gguf package),
within each type's error bound, the rotated types' inverse exact up to their codebook, attention over the stored
cache equal to attention over its expansion, and greedy speculative decoding equal to plain decoding with every
type pair."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q, quants
from test_engine import oracle_proposals, random_draft
from tiny import decode_tokens

from flashdraft.engine.config import KV_CACHE_TYPES as CONFIG_TYPES
from flashdraft.engine.generate import SpecStats
from flashdraft.engine.sampling import SamplingParams
from flashdraft.layers import kv_quant
from flashdraft.layers.kv_cache import KVCache, window_cache
from flashdraft.layers.kv_quant import KVCodec, kv_codecs
from flashdraft.models.llama import Llama, LlamaConfig
from flashdraft.quant import kv_types
from flashdraft.quant.iq4 import IQ4_NL_VALUES
from flashdraft.quant.kv_types import BLOCK_KV_TYPES, KV_CACHE_TYPES, lloyd_max_codebook, rotation

# the largest |error| of a block in units of its largest |value| (q8_0, q5_0, q4_0) or half its range (q5_1,
# q4_1): half a grid step, except the symmetric types' top value, which the grid (-n..n-1 steps) clips by a step;
# plus the fp16 rounding of scale and min
BOUNDS = {"q8_0": 0.5 / 127 + 1e-3, "q5_0": 1 / 16 + 1e-3, "q5_1": 1 / 31 + 1e-3, "q4_0": 1 / 8 + 1e-3,
          "q4_1": 1 / 15 + 1e-3}


def test_the_command_lines_and_the_codecs_name_the_same_types():
    assert CONFIG_TYPES == KV_CACHE_TYPES


@pytest.mark.parametrize("rotated", [True, False])
@pytest.mark.parametrize("name", [name for name in BLOCK_KV_TYPES if name != "iq4_nl"])
def test_quantize_equals_gguf_reference_and_round_trip_within_bound(name, rotated, monkeypatch):
    """Block types store the gguf package's blocks of each head row, rotated first (as llama.cpp's attn_rot) unless
    LLAMA_ATTN_ROT_DISABLE; decoding rotates back."""
    monkeypatch.setattr(kv_types, "ROTATE_BLOCKS", rotated)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((96, 128)) * rng.uniform(1e-3, 30, (96, 1))).astype(np.float32)
    x[0], x[1, :32] = 0, 2.5  # an all-zero block and a constant one
    qtype = BLOCK_KV_TYPES[name]
    codec = KVCodec(name, torch.float32)
    assert codec.rotates(128) == rotated
    y = kv_quant.rotate(torch.from_numpy(x)).numpy() if rotated else x  # what is quantized
    stored = codec.encode(torch.from_numpy(x))
    assert stored.dtype == torch.uint8 and stored.shape == (96, codec.row_size(128))
    blocks = codec.to_blocks(stored).reshape(96, -1).numpy()
    assert np.array_equal(blocks, quants.quantize(y, qtype))
    values = quants.dequantize(blocks, qtype)
    back = codec.decode(stored)
    want = kv_quant.rotate(torch.from_numpy(values), inverse=True) if rotated else torch.from_numpy(values)
    assert torch.allclose(back, want, rtol=0, atol=1e-5) if rotated else torch.equal(back, want)
    blocks, err = y.reshape(-1, 32), (values - y).reshape(-1, 32)
    scale = np.abs(blocks).max(-1) if name in ("q8_0", "q5_0", "q4_0") else np.ptp(blocks, -1) / 2
    assert (np.abs(err).max(-1) <= BOUNDS[name] * scale + 1e-6).all()


def test_rotation_spreads_an_outlier_channel(monkeypatch):
    """Keys with a few large channels (Qwen2's key bias): the rotated q8_0 cache's error is less than half
    than the plain blocks', whose outliers set the scale of every block they sit in."""
    monkeypatch.setattr(kv_types, "ROTATE_BLOCKS", True)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((256, 64)).astype(np.float32)
    k[:, [29, 31, 62]] += np.array([120.0, -130.0, 140.0], dtype=np.float32)
    codec, x = KVCodec("q8_0", torch.float32), torch.from_numpy(k)
    plain = torch.from_numpy(quants.dequantize(quants.quantize(k, Q.Q8_0), Q.Q8_0))
    rotated = codec.decode(codec.encode(x))
    assert (rotated - x).norm() * 2 < (plain - x).norm()


def iq4_nl_reference(block: np.ndarray) -> bytes:
    """llama.cpp's quantize_f32_iq4_nl_block (ggml-cuda/cpy-utils.cuh) with best_index_int8, line by line."""
    values = IQ4_NL_VALUES
    amax = vmax = 0.0
    for v in block:
        if amax < abs(v):
            amax, vmax = abs(v), v
    d = np.float32(vmax) / np.float32(values[0])
    inv = np.float32(1) / d if d else np.float32(0)

    def best_index(x):
        if x <= values[0]:
            return 0
        if x >= values[15]:
            return 15
        lo, hi = 0, 15
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if x < values[mid]:
                hi = mid
            else:
                lo = mid
        return hi - 1 if x - values[hi - 1] < values[hi] - x else hi

    qs, sumqx, sumq2 = [], np.float32(0), np.float32(0)
    for j in range(16):
        i0, i1 = best_index(block[j] * inv), best_index(block[16 + j] * inv)
        qs.append(i0 | (i1 << 4))
        for i, x in ((i0, block[j]), (i1, block[16 + j])):
            sumqx += x * x * values[i] * x
            sumq2 += x * x * values[i] * values[i]
    d = sumqx / sumq2 if sumq2 > 0 else d
    return np.float16(d).tobytes() + bytes(qs)


def test_iq4_nl_equals_llama_cpp_and_decodes_as_gguf(monkeypatch):
    monkeypatch.setattr(kv_types, "ROTATE_BLOCKS", False)  # the block quantizer itself
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((40, 64)) * rng.uniform(1e-2, 10, (40, 1))).astype(np.float32)
    x[0] = 0
    codec = KVCodec("iq4_nl", torch.float32)
    stored = codec.to_blocks(codec.encode(torch.from_numpy(x))).reshape(40, -1).numpy()
    want = np.frombuffer(b"".join(iq4_nl_reference(b) for b in x.reshape(-1, 32)), np.uint8).reshape(stored.shape)
    # the least-squares scale sums in another order than the C loop: allow its last fp16 bit
    scales = stored.reshape(-1, 18)[:, :2].copy().view(np.float16).astype(np.float32)
    want_scales = want.reshape(-1, 18)[:, :2].copy().view(np.float16).astype(np.float32)
    assert np.array_equal(stored.reshape(-1, 18)[:, 2:], want.reshape(-1, 18)[:, 2:])
    assert np.allclose(scales, want_scales, rtol=1e-3, atol=0)
    back = codec.decode(codec.encode(torch.from_numpy(x))).numpy()
    assert np.array_equal(back, quants.dequantize(stored, BLOCK_KV_TYPES["iq4_nl"]))
    blocks, err = x.reshape(-1, 32), (back - x).reshape(-1, 32)
    assert (np.abs(err).max(-1) <= 0.13 * np.abs(blocks).max(-1) + 1e-6).all()  # half the widest level gap


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_rotated_type_is_exact_up_to_its_codebook(bits, head_dim):
    """Read back independently (numpy): each group stores, for the scale of SCALE_SEARCH whose nearest levels to
    sqrt(g) R x / |x| / scale (R orthogonal) point closest to that vector's direction, those levels' indices, and a
    scale |x| / |levels|; decoding is exactly R^T (levels x scale), so the decoded group keeps the norm, and random
    vectors lose less than the Lloyd-Max distortion of a Gaussian (the fixed scale's)."""
    group = min(head_dim, 128)
    r = rotation(group).double().numpy()
    assert np.allclose(r @ r.T, np.eye(group), atol=1e-6)
    levels = np.array(lloyd_max_codebook(bits))
    x = torch.randn(200, head_dim, generator=torch.Generator().manual_seed(bits)) * 3
    x[0, :group] = 0
    x[1, :group] = torch.arange(group) % 2 * 2.0 - 1  # a row of +-1: after the rotation, not Gaussian-shaped
    codec = KVCodec(f"turbo{bits}", torch.float32)
    n = head_dim // group
    stored = codec.encode(x).numpy()
    assert stored.shape == (200, n * (2 + group * bits // 8))
    packed = stored[:, :n * group * bits // 8].reshape(200, n, -1).astype(np.int64)  # each group's code bytes
    scale = stored[:, n * group * bits // 8:].copy().view(np.float16).astype(np.float64)[..., None]  # [200, n, 1]
    c = np.arange(group)
    if bits == 4:  # value c: byte c % (g/2), the high nibble for the second half
        codes = (packed[..., c % (group // 2)] >> (4 * (c // (group // 2)))) & 15
    else:  # 2-bit planes: byte c % (g/4), bits 2 (c // (g/4)); then a bit plane: byte c % (g/8), bit c // (g/8)
        low = (packed[..., c % (group // 4)] >> (2 * (c // (group // 4)))) & 3
        high = (packed[..., group // 4 + c % (group // 8)] >> (c // (group // 8))) & 1
        codes = low | (high << 2)
    groups = x.double().numpy().reshape(200, head_dim // group, group)
    norms = np.linalg.norm(groups, axis=-1, keepdims=True)
    unit = np.divide(groups, norms, out=np.zeros_like(groups), where=norms > 0) @ r.T * np.sqrt(group)
    fits, trials = [], []
    for s in kv_types.SCALE_SEARCH:
        trial = np.abs(unit[..., None] / s - levels).argmin(-1)
        dot = (unit * levels[trial]).sum(-1)
        fits.append(dot * np.abs(dot) / (levels[trial] ** 2).sum(-1))
        trials.append(trial)
    fits, trials = np.stack(fits), np.stack(trials)  # [scales, 200, n], [scales, 200, n, g]
    chosen = np.take_along_axis(trials, fits.argmax(0)[None, ..., None], 0)[0]
    dot = (unit * levels[codes]).sum(-1)
    fit = dot * np.abs(dot) / (levels[codes] ** 2).sum(-1)  # the stored codes' (in float32 a coordinate within
    # rounding of a midpoint may take the other code, and the best scale's fit drop by ~1e-4)
    assert (fit >= fits.max(0) * (1 - 2e-4)).all()
    assert (codes == chosen).all(-1).mean() > 0.95
    assert np.allclose(scale[..., 0], np.linalg.norm(groups, axis=-1) / np.linalg.norm(levels[codes], axis=-1),
                       rtol=1e-3)
    want = (levels[codes] * scale) @ r
    back = codec.decode(codec.encode(x)).double().numpy().reshape(want.shape)
    assert np.allclose(back, want, atol=1e-5)
    assert np.allclose(np.linalg.norm(back, axis=-1), np.linalg.norm(groups, axis=-1), rtol=1e-3)
    errors = ((back - groups) ** 2).sum(-1)[2:] / (groups ** 2).sum(-1)[2:]
    lloyd_max = {3: 0.03455, 4: 0.009497}[bits]  # Lloyd-Max mean squared error for a unit Gaussian
    assert 0.6 * lloyd_max < errors.mean() < 0.97 * lloyd_max, errors.mean()
    def norm_kept_error(codes):
        kept = levels[codes] * (np.linalg.norm(groups, axis=-1) / np.linalg.norm(levels[codes], axis=-1))[..., None]
        return ((kept @ r - groups) ** 2).sum(-1)
    fixed = norm_kept_error(np.abs(unit[..., None] - levels).argmin(-1))  # the codes at the Gaussian's scale alone
    assert (norm_kept_error(codes) <= fixed * (1 + 1e-6)).all()


def test_bytes_per_token_are_the_layouts():
    for name, per_block in (("q8_0", 34), ("q5_0", 22), ("q5_1", 24), ("q4_0", 18), ("q4_1", 20), ("iq4_nl", 18),
                            ("turbo3", 50 / 4), ("turbo4", 66 / 4), ("f16", 64), ("bf16", 64), ("f32", 128)):
        cache = KVCache(1, 2, 16, 128, torch.float32, "cpu", kv_codecs((name, "q4_1"), torch.float32))
        assert cache.bytes_per_token == 2 * (4 * per_block + 4 * 20), name  # 2 heads x (K + V), 128 = 4 blocks


@pytest.mark.parametrize("types", [("q8_0", "q8_0"), ("q5_0", "q4_1"), ("q4_0", "q5_1"), ("iq4_nl", "turbo3"),
                                   ("turbo4", "f16")])
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


def test_quantized_keys_are_stored_minus_the_key_shift_and_read_back_whole():
    """A cache with a key shift stores the quantization of k - shift and reads back k (within q8_0's bound of
    the shifted rows, far inside the bound of the rows with the shift in them)."""
    torch.manual_seed(0)
    codecs = kv_codecs(("q8_0", "q4_1"), torch.float32)
    cache = KVCache(1, 2, 64, 32, torch.float32, "cpu", codecs)
    cache.key_shift = 50 * torch.randn(2, 32)
    k, v = torch.randn(1, 40, 2, 32) + cache.key_shift, torch.randn(1, 40, 2, 32)
    view = cache.view(0)
    view.write(torch.arange(40)[None], k, v)
    assert torch.equal(cache.k[0, :, :40], codecs[0].encode((k[0] - cache.key_shift).transpose(0, 1)))
    keys, _ = view.read(40)
    err = (keys[0].transpose(0, 1) - k[0]).abs().max()
    assert err < 0.05, err  # q8_0 of the rows with the shift in them: up to ~0.7
    unshifted = KVCache(1, 2, 64, 32, torch.float32, "cpu", codecs).view(0)
    unshifted.write(torch.arange(40)[None], k, v)
    assert (unshifted.read(40)[0][0].transpose(0, 1) - k[0]).abs().max() > 4 * err


def random_llama(head_dim: int = 32) -> Llama:
    cfg = LlamaConfig(arch="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=2,
                      num_kv_heads=1, head_dim=head_dim, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = Llama(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * 0.2)
    return model.eval()


def greedy_speculative_against_plain(monkeypatch, types, device: str = "cpu", head_dim: int = 32) -> Llama:
    """Rollback over quantized rows (stale rows of rejected tokens, rewritten positions) keeps the tokens, through
    the engine's decode loop on `device` (CUDA: graphs, the split kernel over the stored rows, the write kernels).
    On a real model a verify step's batched K/V projection can differ from a plain step's in the last bits, and a
    value on a rounding boundary then quantizes a step apart (docs/PERF.md): this small model has no such case on
    the CPU, and on CUDA its projections are computed a row at a time (cuBLAS may round a row of 8 apart from the
    same row alone; the kernels under test do not)."""
    from flashdraft.layers import linear as linear_module
    if device != "cpu":
        dense = linear_module.linear
        monkeypatch.setattr(linear_module, "linear", lambda x, w, b=None: torch.cat(
            [dense(row, w, b) for row in x.split(1, dim=-2)], dim=-2))
    target = random_llama(head_dim).to(device)
    target.state = target.new_state(1, 256, types)
    prompt = torch.randint(0, 90, (20,), device=device)
    params = SamplingParams(max_tokens=50)
    plain = decode_tokens(target, target.state, prompt, params, device=device)
    draft = random_draft(target, block_size=8).to(device)
    draft.setup_cache(256)
    oracle_proposals(monkeypatch, draft, plain, len(prompt), 3)
    stats = SpecStats()
    assert decode_tokens(target, target.state, prompt, params, draft=draft, device=device, stats=stats) == plain, types
    assert max(stats.acceptance_lengths) > 2
    return target


@pytest.mark.parametrize("types", [("q8_0", "q8_0"), ("q5_0", "q4_1"), ("q4_0", "q4_0"), ("q5_1", "f16"),
                                   ("bf16", "q8_0"), ("iq4_nl", "iq4_nl"), ("turbo4", "turbo3")])
def test_greedy_speculative_equals_plain_with_each_cache_type(monkeypatch, types):
    target = greedy_speculative_against_plain(monkeypatch, types)
    assert target.state.layers[0].k.dtype == (torch.bfloat16 if types[0] == "bf16" else torch.uint8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("types", [("f16", "f16"), ("q8_0", "q8_0"), ("q5_0", "q4_1"), ("q4_1", "q4_1"),
                                   ("iq4_nl", "iq4_nl"), ("turbo4", "turbo4"), ("turbo3", "q8_0")])
def test_greedy_speculative_equals_plain_on_gpu(monkeypatch, types):
    greedy_speculative_against_plain(monkeypatch, types, "cuda", head_dim=128)


def test_a_biased_models_quantized_keys_are_shifted_by_its_mean_key(monkeypatch):
    """A model whose keys carry a large bias on slowly turning channels (Qwen2's): a quantized K cache stores them
    minus the model's mean key, and its logits come out closer to the float cache's than without the shift; a float
    cache has none."""
    from flashdraft.models import decoder
    cfg = LlamaConfig(arch="qwen2", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, qkv_bias=True)
    torch.manual_seed(0)
    target = Llama(cfg).eval()
    with torch.no_grad():
        for name, p in target.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * 0.2)
        bias = target.model.layers[0].self_attn.qkv_proj.bias
        low_frequency = torch.cat([torch.arange(24, 32), torch.arange(56, 64)])  # (NEOX pairs: i, i + 32)
        for head in range(2):  # the keys' bias, on channels RoPE turns slowly, as Qwen2's
            bias[256 + 64 * head + low_frequency] += 30 * torch.randn(16)
    ids = torch.randint(0, 96, (1, 120))
    positions = torch.arange(120)[None]

    def logits(types):
        state = target.new_state(1, 128, types)
        with torch.inference_mode():
            return target(ids, positions, state, attn_len=120)[0][0].float(), state

    reference, state = logits(("f16", "f16"))
    assert all(cache.key_shift is None for cache in state.layers)
    shifted, state = logits(("q4_0", "f16"))
    assert all(cache.key_shift is not None and cache.key_shift.shape == (2, 64) for cache in state.layers)
    monkeypatch.setattr(decoder, "SHIFT_KEYS", False)
    plain, state = logits(("q4_0", "f16"))
    assert all(cache.key_shift is None for cache in state.layers)
    err_shifted, err_plain = (shifted - reference).abs().mean(), (plain - reference).abs().mean()
    assert err_shifted * 3 < err_plain, (err_shifted, err_plain)


@pytest.mark.parametrize("head_dim", [64, 192, 256])
def test_block_rows_of_any_head_size_round_trip(head_dim, monkeypatch):
    """Heads the rotation's groups divide (64, 256) are stored rotated; a 192-value head, a multiple of 64 that the
    128-value groups do not divide, is stored as plain blocks (it was refused)."""
    monkeypatch.setattr(kv_types, "ROTATE_BLOCKS", True)
    codec = KVCodec("q8_0", torch.float32)
    x = torch.randn(5, 2, head_dim, generator=torch.Generator().manual_seed(0))
    back = codec.decode(codec.encode(x))
    assert codec.rotates(head_dim) == (head_dim != 192)
    assert (back - x).norm() < 0.01 * x.norm()


def test_a_head_size_the_blocks_do_not_divide_is_named():
    with pytest.raises(ValueError, match="head size divisible by 32, got 16"):
        random_llama(head_dim=16).new_state(1, 64, ("q8_0", "f16"))


def test_the_draft_ring_keeps_its_own_types(tmp_path):
    """--spec-draft-type-k/-v reach the draft's rings through the command line's config; the target's answer is
    unchanged (the draft only proposes) and the draft still proposes what it did with its own dtype."""
    from tiny import make_draft, make_target

    from flashdraft.args import add_engine_args, engine_config
    from flashdraft.engine.engine import Engine, Request
    import argparse
    folder = make_target(tmp_path / "t", layers=3)
    draft = make_draft(tmp_path / "d", folder)
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    runs = {}
    for flags in ([], ["--spec-draft-type-k", "f16", "-ctvd", "bf16"]):
        args = ap.parse_args(["-m", str(folder), *flags])
        engine = Engine.load(engine_config(args, str(draft), "cpu", ctx_size=256, adaptive=False))
        ring = engine.draft.caches[0]
        assert (ring.k.dtype, ring.v.dtype) == ((torch.float16, torch.bfloat16) if flags else (torch.float32,) * 2)
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        plain = engine.generate(Request([5, 6, 7, 8], params, speculative=False))
        spec = engine.generate(Request([5, 6, 7, 8], params))
        assert spec.token_ids == plain.token_ids
        runs[bool(flags)] = spec.spec.acceptance_lengths
    assert runs[True] == runs[False]


def check_quantize_kernel(device: str) -> None:
    """kernels/kv_quantize.py (the CUDA write path) bit for bit against the torch quantizers above, with an
    all-zero block, a constant one, a tie in magnitude (the first value of largest magnitude sets the scale) and
    values halfway between two iq4_nl levels. (The rotation before it is rotate's, tested on its own.)"""
    from flashdraft.kernels.kv_quantize import TYPE_IDS, quantize_rotated_rows, quantize_rows
    gen = torch.Generator().manual_seed(0)
    rotate_blocks, kv_types.ROTATE_BLOCKS = kv_types.ROTATE_BLOCKS, False  # the block quantizers themselves
    try:
        for name in TYPE_IDS:
            for head_dim in (64, 128, 256):
                x = torch.randn(7, 3, head_dim, generator=gen) * torch.rand(7, 3, 1, generator=gen) * 10
                x[0, 0], x[1, 0, :32] = 0, 2.5
                x[2, 0, 5], x[2, 0, 9] = -x[2, 0].abs().max(), x[2, 0].abs().max()
                x[3, 0, :32] = torch.tensor([-127.0, 7.0, -115.5, 95.5] * 8)  # iq4_nl: d = 1, halfway between levels
                codec = KVCodec(name, torch.float32)
                want = codec.encode(x)
                got = quantize_rows(x.to(device), name).cpu()
                if name == "iq4_nl":  # the same levels; the refit scale's sum may round an fp16 ulp apart
                    levels, scales = got[..., :head_dim // 2], got[..., head_dim // 2:].contiguous().view(torch.int16)
                    assert torch.equal(levels, want[..., :head_dim // 2]), (name, head_dim)
                    ulps = (scales.int() - want[..., head_dim // 2:].contiguous().view(torch.int16).int()).abs()
                    assert ulps.max() <= 1, (name, head_dim, int(ulps.max()))
                    continue
                assert torch.equal(got, want), (name, head_dim, int((got != want).sum()))
                shift = 20 * torch.randn(3, head_dim, generator=gen)  # per head, subtracted first
                got = quantize_rows((x + shift).to(device), name, shift=shift.to(device)).cpu()
                want = codec.encode(x + shift, shift)
                assert torch.equal(got, want), (name, head_dim, "shifted", (got != want).nonzero()[:8].tolist(),
                                                got[got != want][:8].tolist(), want[got != want][:8].tolist())
        kv_types.ROTATE_BLOCKS = True  # rotated first: the rotation's float32 sums may move a value across a level
        for name in TYPE_IDS:
            for head_dim in (64, 128, 256):
                x = torch.randn(5, 3, head_dim, generator=gen) * torch.rand(5, 3, 1, generator=gen) * 10
                x[..., 7] += 50  # an outlier channel
                shift = torch.randn(3, head_dim, generator=gen) if head_dim == 128 else None
                want = KVCodec(name, torch.float32).encode(x, shift)
                got = quantize_rows(x.to(device), name, rotated=True,
                                    shift=None if shift is None else shift.to(device)).cpu()
                same = (got == want).float().mean().item()
                assert same > 0.99, (name, head_dim, same)
    finally:
        kv_types.ROTATE_BLOCKS = rotate_blocks
    # the rotated types: the kernel rotates in float32 summed in its own order, so a coordinate within rounding of a
    # level midpoint may take the other code, and a group that two scales fit equally well the other scale's codes:
    # nearly every group's code bytes equal and its scale within 0.2%, and no group decoded worse
    for bits in (3, 4):
        for head_dim in (64, 128, 256):
            x = torch.randn(7, 3, head_dim, generator=gen) * torch.rand(7, 3, 1, generator=gen) * 10
            x[0, 0] = 0
            shift = 3 * torch.randn(3, head_dim, generator=gen) if head_dim == 128 else None
            if shift is not None:
                x[0, 1] = shift[1]  # zero once shifted
            codec = KVCodec(f"turbo{bits}", torch.float32)
            want = codec.encode(x, shift)
            got = quantize_rotated_rows(x.to(device), bits, None if shift is None else shift.to(device)).cpu()
            n = max(1, head_dim // 128)
            cut = want.shape[-1] - 2 * n
            agree = (got[..., :cut] == want[..., :cut]).unflatten(-1, (n, -1)).float().mean(-1)  # per group
            same = agree > 0.9
            assert same.float().mean() > 0.9 and agree.mean() > 0.98, (bits, head_dim, agree.mean())
            scales = [r[..., cut:].contiguous().view(torch.float16).float() for r in (got, want)]
            assert torch.allclose(scales[0][same], scales[1][same], rtol=2e-3, atol=0), (bits, head_dim)
            target = (x if shift is None else x - shift).unflatten(-1, (n, -1))
            errors = [(codec.decode(r).unflatten(-1, (n, -1)) - target).pow(2).sum(-1) for r in (got, want)]
            assert (errors[0] <= errors[1] * 1.001 + 1e-6 * target.pow(2).sum(-1)).all(), (bits, head_dim)
    from flashdraft.kernels.kv_quantize import write_kv_rows
    for (k_type, v_type), head_dim in zip([("q5_0", "q4_1"), ("q8_0", "iq4_nl"), ("q4_0", "q5_1")], (128, 64, 256)):
        for k_rotated, v_rotated, shifted in ((True, True, True), (False, True, False), (False, False, True)):
            k = torch.randn(5, 3, 2 * head_dim, generator=gen)[:, :, :head_dim] * 4  # strided heads, as a fused qkv
            v = torch.randn(5, 3, head_dim, generator=gen)
            shift = 3 * torch.randn(3, head_dim, generator=gen) if shifted else None
            positions = torch.tensor([9, 2, 3, 17, 4])
            codecs = KVCodec(k_type, torch.float32), KVCodec(v_type, torch.float32)
            caches = [torch.zeros(3, 20, c.row_size(head_dim), dtype=torch.uint8, device=device) for c in codecs]
            write_kv_rows(*caches, positions.to(device), k.to(device), v.to(device), k_type, v_type, k_rotated,
                          v_rotated, None if shift is None else shift.to(device))
            want_k = quantize_rows(k.to(device), k_type, k_rotated, None if shift is None else shift.to(device))
            want_v = quantize_rows(v.to(device), v_type, v_rotated)
            for cache, want in zip(caches, (want_k, want_v)):
                assert torch.equal(cache[:, positions].cpu(), want.transpose(0, 1).cpu()), (k_type, v_type)
                others = torch.ones(20, dtype=torch.bool)
                others[positions] = False
                assert not cache[:, others].any()
    # custom ops with shapes torch.compile can trace (a raw launch's PDL assembly made it take every input as written)
    x, shift = torch.randn(3, 2, 128, generator=gen).to(device), torch.randn(2, 128, generator=gen).to(device)
    caches = [torch.zeros(2, 10, size, dtype=torch.uint8, device=device) for size in (80, 72)]
    checks = (("rotate_rows", (x, True)), ("quantize_rows", (x, "q4_1", True, shift)),
              ("quantize_rotated_rows", (x, 4, shift)),
              ("write_kv_rows", (*caches, torch.tensor([1, 5, 7], device=device), x, x, "q4_1", "q4_0", True, False,
                                 shift)))
    for name, args in checks:
        result = torch.library.opcheck(getattr(torch.ops.flashdraft, name).default, args,
                                       test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
        assert set(result.values()) == {"SUCCESS"}, (name, result)
    from flashdraft.kernels.rotation import rotate_rows
    from flashdraft.layers.kv_quant import rotate
    for head_dim in (64, 128, 256):  # a query into the rotated domain and an output back, strided heads
        x = torch.randn(3, 4, 2 * head_dim, generator=gen)[:, :, :head_dim]
        for inverse in (False, True):
            got = rotate_rows(x.to(device), inverse).cpu()
            assert torch.allclose(got, rotate(x, inverse), rtol=1e-5, atol=1e-5), (head_dim, inverse)


def test_quantize_kernel_interpreted_equals_the_torch_quantizers():
    pytest.importorskip("triton")
    from test_split_attention import INTERPRETER
    if INTERPRETER is not None:
        pytest.skip(INTERPRETER)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, "cpu"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_quantize_kernel_on_gpu_equals_the_torch_quantizers():
    check_quantize_kernel("cuda")


if __name__ == "__main__":
    check_quantize_kernel(sys.argv[1] if len(sys.argv) > 1 else "cpu")
    print("the quantize kernel matches")
