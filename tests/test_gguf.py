import math

import numpy as np
import pytest
from tiny import finish_gguf
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter, quants
from gguf import GGMLQuantizationType as Q

from flashdraft.formats.gguf import gguf_to_hf_config, llama3_rope_factors, load_gguf_state_dict, read_gguf
from flashdraft.quant.dequant import SUPPORTED_TYPES, dequantize

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
QUANTISABLE = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]  # gguf.quants can write these
# types gguf.quants can only read: random bytes with finite fp16 super-block scales at these byte offsets
# fp16 fields of the types the gguf package cannot quantise (random bytes elsewhere are valid blocks)
SCALE_OFFSETS = {Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.IQ4_NL: [0],
                 Q.IQ4_XS: [0]}
LEGACY_SCALE_OFFSETS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0]}


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random stored bytes [rows, bytes per row]: every quant bit pattern, with finite, moderate fp16 scales."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    for offset in (SCALE_OFFSETS | LEGACY_SCALE_OFFSETS)[qtype]:
        scales = rng.uniform(-0.1, 0.1, (rows, cols // block_size, 1)).astype(np.float16)
        raw[..., offset:offset + 2] = scales.view(np.uint8)
    return raw.reshape(rows, -1)


def as_bytes(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).copy())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda q: q.name)
def test_dequantize_matches_gguf_reference(qtype, device):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 48, 512
    if qtype in SCALE_OFFSETS:
        raw = random_blocks(qtype, rows, cols, rng)
    else:
        raw = quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qtype)
        if qtype == Q.BF16:  # quantize returns the bf16 bits as uint8
            raw = raw.view(np.uint8)
    reference = torch.from_numpy(quants.dequantize(raw, qtype).astype(np.float32))
    out = dequantize(as_bytes(raw), qtype, (rows, cols), torch.float32, device)
    assert out.shape == (rows, cols) and out.dtype == torch.float32 and out.device.type == device
    assert torch.equal(out.cpu(), reference)
    half = dequantize(as_bytes(raw), qtype, (4, rows // 4, cols), torch.bfloat16, device)
    assert torch.equal(half.cpu(), reference.reshape(4, rows // 4, cols).to(torch.bfloat16))


def test_dequantize_in_chunks(monkeypatch):
    import flashdraft.quant.dequant as g
    rng = np.random.default_rng(0)
    raw = random_blocks(Q.Q4_K, 8, 1024, rng)
    whole = dequantize(as_bytes(raw), Q.Q4_K, (8, 1024))
    monkeypatch.setattr(g, "CHUNK_ELEMENTS", 3 * 256)  # 3 blocks per step, so the last step is partial
    assert torch.equal(dequantize(as_bytes(raw), Q.Q4_K, (8, 1024)), whole)


def test_unsupported_type_is_named():
    with pytest.raises(ValueError, match="IQ2_XXS"):
        dequantize(torch.zeros(66, dtype=torch.uint8), Q.IQ2_XXS, (256,))
    with pytest.raises(ValueError, match="Q8_0"):
        dequantize(torch.zeros(33, dtype=torch.uint8), Q.Q8_0, (32,))


# ----------------------------------------------------------------------------------- tiny GGUF files

GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_hf_state(arch: str, layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=96,
                  tied=True, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    sd = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": w(hidden)}
    if not tied:
        sd["lm_head.weight"] = w(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        sd |= {p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
               p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
               p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
               p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
               p + "mlp.gate_proj.weight": w(ffn, hidden), p + "mlp.up_proj.weight": w(ffn, hidden),
               p + "mlp.down_proj.weight": w(hidden, ffn),
               p + "input_layernorm.weight": w(hidden), p + "post_attention_layernorm.weight": w(hidden)}
        if arch == "qwen2":
            sd |= {p + f"self_attn.{x}_proj.bias": w(n * head_dim) for x, n in (("q", heads), ("k", kv_heads),
                                                                                ("v", kv_heads))}
        if arch == "qwen3":
            sd |= {p + "self_attn.q_norm.weight": w(head_dim), p + "self_attn.k_norm.weight": w(head_dim)}
    return sd


def write_tiny_gguf(path, arch: str, sd: dict[str, np.ndarray], heads=4, kv_heads=2, head_dim=16,
                    name="tiny", quantise_qk: Q | None = None, extra: dict | None = None,
                    extra_tensors: dict | None = None, quantise: list[Q] | None = None):
    """quantise: every matrix stored in one of these types, in turn (the older types: the gguf package
    quantises those)."""
    w = GGUFWriter(str(path), arch)
    w.add_string("general.name", name)
    hidden = sd["model.embed_tokens.weight"].shape[1]
    w.add_uint32(f"{arch}.block_count", 1 + max(int(k.split(".")[2]) for k in sd if k.startswith("model.layers.")))
    w.add_uint32(f"{arch}.context_length", 2048)
    w.add_uint32(f"{arch}.embedding_length", hidden)
    w.add_uint32(f"{arch}.feed_forward_length", sd["model.layers.0.mlp.up_proj.weight"].shape[0])
    w.add_uint32(f"{arch}.attention.head_count", heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", kv_heads)
    w.add_float32(f"{arch}.rope.freq_base", 500000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    if head_dim != hidden // heads:
        w.add_uint32(f"{arch}.attention.key_length", head_dim)
        w.add_uint32(f"{arch}.attention.value_length", head_dim)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(sd["model.embed_tokens.weight"].shape[0])])
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for key, value in (extra or {}).items():
        w.add_uint32(key, value) if isinstance(value, int) else w.add_string(key, value)
    for hf, array in sd.items():
        parts = hf.split(".")
        if hf.startswith("model.layers."):
            module = ".".join(parts[3:-1])
            gguf_name = f"blk.{parts[2]}.{GGUF_NAMES[module]}.{parts[-1]}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                array = llama_cpp_permute(array, heads if module == "self_attn.q_proj" else kv_heads)
                if quantise_qk is not None and array.ndim == 2:
                    w.add_tensor(gguf_name, quants.quantize(array, quantise_qk), raw_dtype=quantise_qk)
                    continue
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[hf]
        if quantise and array.ndim == 2:
            qtype = quantise[len(w.tensors[0]) % len(quantise)] if w.tensors else quantise[0]
            w.add_tensor(gguf_name, quants.quantize(array, qtype), raw_dtype=qtype)
            continue
        w.add_tensor(gguf_name, array)
    for gguf_name, array in (extra_tensors or {}).items():
        w.add_tensor(gguf_name, array)
    finish_gguf(w)
    return path


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_round_trip(tmp_path, arch):
    head_dim = 32 if arch == "qwen3" else 16  # qwen3: head_dim != hidden / heads, from attention.key_length
    sd = tiny_hf_state(arch, head_dim=head_dim, tied=arch == "llama")
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, sd, head_dim=head_dim)
    g = read_gguf(path)
    cfg = gguf_to_hf_config(g)
    assert cfg["model_type"] == arch and cfg["head_dim"] == head_dim and cfg["vocab_size"] == 96
    assert cfg["num_hidden_layers"] == 2 and cfg["num_key_value_heads"] == 2 and cfg["rope_theta"] == 500000.0
    assert cfg["tie_word_embeddings"] == (arch == "llama")
    loaded = load_gguf_state_dict(g, torch.float32, "cpu")
    assert set(loaded) == set(sd)
    for name, array in sd.items():
        assert torch.equal(loaded[name], torch.from_numpy(array)), name
    half = load_gguf_state_dict(g, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in half.values())


def test_llama_permutation_undone_on_quantised_rows(tmp_path):
    sd = tiny_hf_state("llama")
    path = write_tiny_gguf(tmp_path / "q.gguf", "llama", sd, quantise_qk=Q.Q8_0)
    loaded = load_gguf_state_dict(path)
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        # Q8_0 blocks run along rows, so quantising the HF weight gives the same rows the file holds, reordered
        expected = quants.dequantize(quants.quantize(sd[name], Q.Q8_0), Q.Q8_0)
        assert torch.equal(loaded[name], torch.from_numpy(expected))


def test_mistral_and_unknown_architectures(tmp_path):
    sd = tiny_hf_state("llama")
    g = read_gguf(write_tiny_gguf(tmp_path / "m.gguf", "llama", sd, name="Mistral 7B Instruct v0.3"))
    assert gguf_to_hf_config(g)["model_type"] == "mistral"
    g.metadata["general.architecture"] = "phi3"
    with pytest.raises(ValueError, match="phi3"):
        gguf_to_hf_config(g)
    with pytest.raises(ValueError, match="falcon"):
        gguf_to_hf_config({"general.architecture": "falcon"}, {})


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    sd = tiny_hf_state("llama", hidden=256, heads=4, kv_heads=2, head_dim=64, layers=1)

    def factors(factor, low, high, original, theta=500000.0, dim=64):
        # convert_hf_to_gguf.py (LlamaModel.generate_extra_tensors), as llama.cpp writes `rope_freqs`
        out = []
        for i in range(0, dim, 2):
            wavelen = 2 * math.pi * theta ** (i / dim)
            if wavelen < original / high:
                out.append(1.0)
            elif wavelen > original / low:
                out.append(factor)
            else:
                smooth = (original / wavelen - low) / (high - low)
                out.append(1 / ((1 - smooth) / factor + smooth))
        return np.array(out, dtype=np.float32)

    for params in [(8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (16.0, 2.0, 8.0, 4096)]:
        path = write_tiny_gguf(tmp_path / "r.gguf", "llama", sd, head_dim=64,
                               extra_tensors={"rope_freqs.weight": factors(*params)})
        scaling = gguf_to_hf_config(read_gguf(path))["rope_scaling"]
        assert scaling["rope_type"] == "llama3" and scaling["factor"] == params[0]
        recomputed = llama3_rope_factors(500000.0, 64, scaling["factor"], scaling["low_freq_factor"],
                                         scaling["high_freq_factor"], scaling["original_max_position_embeddings"])
        np.testing.assert_allclose(recomputed, factors(*params), rtol=1e-5)
        if params[3] == 8192:
            assert (scaling["low_freq_factor"], scaling["high_freq_factor"]) == params[1:3]
        assert "rope_freqs.weight" in read_gguf(path).tensors and len(load_gguf_state_dict(path)) == len(sd)


# ---------------------------------------------------------------------------------------- the reader

def same_as_gguf_reader(path) -> None:
    """read_gguf's metadata and tensors against the gguf package's GGUFReader: every key's value and Python type,
    every tensor's type, shape and mapped bytes."""
    import gguf
    ref = gguf.GGUFReader(path)
    g = read_gguf(path)
    want = {name: field.contents() for name, field in ref.fields.items()}
    assert list(g.metadata) == list(want)
    for key, value in want.items():
        assert g.metadata[key] == value and type(g.metadata[key]) is type(value), key
    assert [t.name for t in ref.tensors] == list(g.tensors)
    for t in ref.tensors:
        mine = g.tensors[t.name]
        assert mine.qtype == t.tensor_type and mine.shape == tuple(reversed(t.shape.tolist())), t.name
        assert mine.data.dtype == t.data.dtype and mine.data.shape == t.data.shape, t.name
        assert np.array_equal(np.asarray(mine.data).view(np.uint8), np.asarray(t.data).view(np.uint8)), t.name


def test_reader_matches_gguf_package_on_every_value_type(tmp_path):
    import gguf
    path = tmp_path / "values.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ⟨tokens⟩")
    w.add_uint64("t.u64", 2 ** 63 + 5)
    w.add_int64("t.i64", -2 ** 62)
    w.add_float64("t.f64", 1e300)
    w.add_array("t.strings", ["a", "", "ĠĠ", "日本"])
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.empty", [])
    w.add_custom_alignment(64)
    w.add_tensor("f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("f16", np.ones((2, 8), dtype=np.float16))
    raw = np.arange(2 * 18, dtype=np.uint8).reshape(2, 18)  # two Q4_0 rows of 32 values
    w.add_tensor("q", raw, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    same_as_gguf_reader(path)
    assert read_gguf(path).tensors["q"].shape == (2, 32)


def test_reader_matches_gguf_package_on_real_files(smollm2_gguf):
    same_as_gguf_reader(smollm2_gguf)


# ---------------------------------------------------------------------------------------- bad files

def test_truncated_and_foreign_files(tmp_path):
    good = write_tiny_gguf(tmp_path / "good.gguf", "llama", tiny_hf_state("llama"))
    data = good.read_bytes()
    for n in [0, 3, 10, 30, 200, len(data) // 2, len(data) - 1]:
        bad = tmp_path / f"cut{n}.gguf"
        bad.write_bytes(data[:n])
        with pytest.raises(ValueError, match=f"cut{n}.gguf"):
            read_gguf(bad)
    text = tmp_path / "notes.txt"
    text.write_text("definitely not a model\n")
    with pytest.raises(ValueError, match="notes.txt: not a GGUF file"):
        read_gguf(text)


def test_truncated_real_file(tmp_path, smollm2_gguf):
    cut = tmp_path / "smollm2-cut.gguf"
    with open(smollm2_gguf, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(40 << 20))
    with pytest.raises(ValueError, match="smollm2-cut.gguf: truncated"):
        read_gguf(cut)


# --------------------------------------------------------------------------------- the real SmolLM2

def test_smollm2_config_matches_transformers(smollm2_file, smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoConfig.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    cfg = gguf_to_hf_config(smollm2_file)
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert cfg[key] == getattr(ref, key), key
    assert cfg["rope_theta"] == ref.rope_parameters["rope_theta"]
    assert cfg["rope_scaling"] is None and ref.rope_parameters["rope_type"] == "default"
    assert cfg["sliding_window"] is None and getattr(ref, "sliding_window", None) is None


def test_smollm2_state_dict_matches_transformers_conversion(smollm2_file):
    """Against gguf's reference dequantisation plus transformers' GGUF q/k un-permutation and gguf-py's tensor
    name table (the pieces `from_pretrained(gguf_file=...)` is built from): every name and shape, and the values
    of the global tensors and a few layers (the slow test below compares every value with a loaded model)."""
    pytest.importorskip("transformers")
    from dataclasses import replace

    from gguf import MODEL_ARCH, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    from flashdraft.formats.gguf import hf_name
    from flashdraft.models.registry import LLAMA

    cfg = gguf_to_hf_config(smollm2_file)
    names = get_tensor_name_map(MODEL_ARCH.LLAMA, cfg["num_hidden_layers"])
    hf_names = {hf_name(n, LLAMA): n for n in smollm2_file.tensors}
    assert len(hf_names) == len(smollm2_file.tensors) == 272 and "lm_head.weight" not in hf_names  # tied
    for name, gguf_name in hf_names.items():
        base, _, suffix = name.rpartition(".")
        assert f"{names.get_name(base)}.{suffix}" == gguf_name
    layers = ("blk.0.", "blk.1.", "blk.15.", "blk.29.")
    subset = {n: t for n, t in smollm2_file.tensors.items() if not n.startswith("blk.") or n.startswith(layers)}
    mine = load_gguf_state_dict(replace(smollm2_file, tensors=subset), torch.float32, "cpu")
    processor = TENSOR_PROCESSORS["llama"](config=cfg)
    for name, tensor in mine.items():
        t = smollm2_file.tensors[hf_names[name]]
        expected = processor.process(quants.dequantize(t.data, t.qtype), t.name).weights
        assert torch.equal(tensor, torch.from_numpy(np.array(expected, dtype=np.float32))), name


@pytest.mark.slow
def test_smollm2_state_dict_matches_transformers_model(smollm2_file, smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                              dtype=torch.float32)
    ref = model.state_dict()
    mine = load_gguf_state_dict(smollm2_file, torch.float32, "cpu")
    assert set(ref) - set(mine) == {"lm_head.weight"} and set(mine) <= set(ref)
    for name, tensor in mine.items():
        torch.testing.assert_close(tensor, ref[name], rtol=0, atol=1e-6, msg=name)
    cfg = gguf_to_hf_config(smollm2_file)
    assert cfg["rope_theta"] == model.config.rope_parameters["rope_theta"]
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings"):
        assert cfg[key] == getattr(model.config, key), key


def test_kept_matrices_are_read_from_their_file_offsets(tmp_path, monkeypatch):
    """A matrix kept quantized names the file and offset holding its bytes (read there with pread in place of the
    mapping: layers/quantized.read_file), and read_file gives those bytes, over several pieces and threads; llama's
    q/k rows, reordered on loading, name none. A file cut short is a clear error."""
    from flashdraft.formats.gguf import iter_gguf_tensors
    from flashdraft.layers import quantized
    from flashdraft.layers.quantized import QuantizedWeight, read_file
    path = write_tiny_gguf(tmp_path / "m.gguf", "llama", tiny_hf_state("llama"), quantise=[Q.Q4_0, Q.Q8_0])
    monkeypatch.setattr(quantized, "READ_PIECE", 1000)  # a matrix of a few KB in several pieces
    kept = {n: w for n, w in iter_gguf_tensors(path, keep_quantized=True)
            if isinstance(w, QuantizedWeight)}
    assert any(w.source is None for n, w in kept.items() if "q_proj" in n or "k_proj" in n)
    read = [w for w in kept.values() if w.source is not None]
    assert len(read) >= 5 and all(w.source[0] == str(path) for w in read)
    for w in read:
        out = torch.empty(w.data.numel(), dtype=torch.uint8)
        read_file(out, *w.source)
        assert torch.equal(out, w.data.reshape(-1))
    size = path.stat().st_size
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:size - 10])
    with pytest.raises(OSError, match="the file ends at"):
        read_file(torch.empty(100, dtype=torch.uint8), str(cut), size - 50)
