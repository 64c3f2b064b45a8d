"""benchmarks/gguf_gpu.py's random `qwen35` GGUF files (`make --shape qwen3.5-tiny`, and qwen3.6-27b for the
measurements): written by the `gguf` package's writer a tensor piece at a time, they load in flashdraft, decode
finite logits and give its MTP drafter its `nextn` layer; they hold the tensors and keys llama.cpp's own
convert_hf_to_gguf.py writes for the same config, in the types llama-quantize's Q4_K_M gives them."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_gemma_gguf import converter  # noqa: F401  (the llama.cpp converter fixture)

from flashdraft.formats.gguf import read_gguf
from flashdraft.formats.loader import create_drafter, load_target

REPO = Path(__file__).parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import gguf_gpu  # noqa: E402

TINY = gguf_gpu.QWEN35["qwen3.5-tiny"]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """`make --shape qwen3.5-tiny` with the `transformers` package unimportable: numpy, torch and `gguf` are all
    it needs."""
    out = tmp_path_factory.mktemp("made")
    run = ("import runpy, sys; sys.modules.update(transformers=None); sys.argv = sys.argv[1:]; "
           "runpy.run_path(sys.argv[0], run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", run, str(REPO / "benchmarks" / "gguf_gpu.py"), "make", "--shape",
                        "qwen3.5-tiny", "--out-dir", str(out)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return out / "qwen3.5-tiny-Q4_K_M.gguf"


def test_tiny_file_decodes_in_flashdraft_and_its_mtp_layer_drafts(made):
    target, _, path = load_target(str(made))
    assert target.cfg.num_layers == TINY.layers and target.cfg.tiled_value_heads
    assert target.cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    ids = torch.randint(0, TINY.vocab, (1, 40), generator=torch.Generator().manual_seed(0))
    drafter = create_drafter("mtp", target, params={"draft_n_max": 3}, source=path)
    drafter.setup_cache(64)
    with torch.no_grad():
        logits, features = target(ids, torch.arange(40)[None], target.new_state(1, 64), 0,
                                  capture=drafter.target_layers, fresh=True)
        drafter.observe(ids[:, :39], features[:, :39], torch.arange(39)[None], 0)
        proposed = drafter.propose(target, ids[0, 39:], torch.tensor([39]), 0, 3)
    assert torch.isfinite(logits).all() and 0.05 < float(logits.std()) < 10  # neither vanishing nor blown up
    assert drafter.name == "mtp" and proposed.shape == (1, 3) and int(proposed.max()) < TINY.vocab
    g = read_gguf(made)  # the blocks' values: weights of standard deviation 0.02 (fp16 scales set for it)
    from flashdraft.quant.dequant import tensor_values
    for name in ("blk.0.attn_qkv.weight", "output.weight"):
        assert 0.017 < float(np.std(tensor_values(g.tensors[name]))) < 0.023, name
    assert (tensor_values(g.tensors["blk.0.ssm_a"]) < 0).all()  # -exp(A_log): flashdraft takes its log(-a)


def llama_quantize_q4_k_m(name: str, converter_type: str) -> str:
    """llama-quantize's Q4_K_M type for a tensor of the converter's BF16 file of the tiny shape (5 blocks, the MTP
    one included), as llama-quant.cpp gives it: the converter's F32 tensors stay (1-D, norms, ssm_conv1d); output
    Q6_K; attn_qkv, attn_v and ffn_down Q6_K where use_more_bits(i, 5) (i >= 7 * 5 // 8 or (i - 5 // 8) % 3 == 2:
    blocks 2 and 4), else Q4_K; every other matrix Q4_K."""
    if converter_type == "F32":
        return "F32"
    parts = name.split(".")
    if name == "output.weight" or parts[0] == "blk" and parts[2] in ("attn_qkv", "attn_v", "ffn_down") and \
            parts[1] in ("2", "4"):
        return "Q6_K"
    return "Q4_K"


def hf_folder(folder: Path) -> Path:
    """A random HF qwen3_5 checkpoint of the tiny shape with its MTP layer (mtp.*), as Qwen's are released."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3_5ForCausalLM"):
        pytest.skip("this transformers has no qwen3_5")
    from safetensors.torch import load_file, save_file
    from tiny import write_tokenizer
    c = TINY
    cfg = transformers.AutoConfig.for_model(
        "qwen3_5_text", vocab_size=c.vocab, hidden_size=c.hidden, intermediate_size=c.ffn, num_hidden_layers=c.layers,
        num_attention_heads=c.heads, num_key_value_heads=c.kv_heads, head_dim=c.head_dim,
        linear_num_key_heads=c.k_heads, linear_num_value_heads=c.v_heads, linear_key_head_dim=c.head_k,
        linear_value_head_dim=c.head_k, linear_conv_kernel_dim=c.conv, rms_norm_eps=c.eps,
        max_position_embeddings=c.context, eos_token_id=2, mtp_num_hidden_layers=c.mtp,
        rope_parameters=dict(rope_type="default", rope_theta=c.rope_theta, partial_rotary_factor=c.partial_rotary))
    folder.mkdir()
    write_tokenizer(folder, c.vocab)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    last = f"model.layers.{c.layers - 1}."  # a gated attention layer
    mtp = {f"mtp.{name}.weight": torch.zeros(c.hidden)
           for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    mtp["mtp.fc.weight"] = torch.zeros(c.hidden, 2 * c.hidden)
    mtp.update({"mtp.layers.0." + k.removeprefix(last): v.clone() for k, v in tensors.items() if k.startswith(last)})
    save_file(tensors | mtp, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert json.loads((folder / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    return folder


def test_tiny_file_holds_what_llama_cpp_converter_and_q4_k_m_give(made, converter, tmp_path):  # noqa: F811
    from gguf import GGUFReader
    from test_qwen3_5 import convert
    theirs = GGUFReader(convert(converter, hf_folder(tmp_path / "hf"), outtype="bf16"))
    ours = GGUFReader(made)
    their_tensors = {t.name: (t.tensor_type.name, tuple(int(d) for d in t.shape)) for t in theirs.tensors}
    our_tensors = {t.name: (t.tensor_type.name, tuple(int(d) for d in t.shape)) for t in ours.tensors}
    assert sorted(our_tensors) == sorted(their_tensors)
    assert any(".nextn." in name for name in our_tensors)
    for name, (qtype, shape) in our_tensors.items():
        assert shape == their_tensors[name][1], name
        assert qtype == llama_quantize_q4_k_m(name, their_tensors[name][0]), name
    # the same keys of the same value types; the architecture's values alike; the file type llama-quantize sets
    fields = {r: {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")} for r in (ours, theirs)}
    assert sorted(fields[ours]) == sorted(fields[theirs])
    for key, field in fields[ours].items():
        assert field.types == fields[theirs][key].types, key
        if key.startswith("qwen35."):
            assert field.contents() == fields[theirs][key].contents(), key
    assert fields[ours]["general.file_type"].contents() == 15  # MOSTLY_Q4_K_M (the converter's: 32, BF16)
    assert fields[ours]["general.quantization_version"].contents() == 2


def test_27b_layout(tmp_path):
    """qwen3.6-27b as `make` would write it (sizes from the tensor table, its header alone written): 64 layers and
    the MTP one, Q6_K in the more-bits blocks of 65, the size its docstring gives."""
    c = gguf_gpu.QWEN35["qwen3.6-27b"]
    w, chunks = gguf_gpu.qwen35_writer(c, "qwen3.6-27b", "cpu")
    types = {name: ti.dtype.name for name, ti in w.tensors[0].items()}
    assert list(chunks) == list(types)
    assert len(types) == 3 + 48 * 14 + 16 * 11 + 15 and types["blk.64.nextn.eh_proj.weight"] == "Q4_K"
    six = sorted(int(n.split(".")[1]) for n, q in types.items() if q == "Q6_K" and n.endswith("ffn_down.weight"))
    assert six == [i for i in range(65) if i < 8 or i >= 56 or (i - 8) % 3 == 2]
    assert [types[f"blk.{i}.attn_qkv.weight"] for i in (0, 8, 10)] == ["Q6_K", "Q4_K", "Q6_K"]
    assert types["blk.63.attn_v.weight"] == types["blk.64.attn_v.weight"] == "Q6_K"
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert gguf_gpu.write_head(w, tmp_path / "head.gguf") == 16_804_874_176
    w.close()
