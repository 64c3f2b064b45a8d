"""Quantized GGUF weights on the GPU against llama.cpp on the same files. Prints tables; writes JSON with --out.

  python benchmarks/gguf_gpu.py make --shape llama-3.1-8b --out-dir DIR       random BF16 GGUF of that shape
  python benchmarks/gguf_gpu.py make --shape gemma-4-31b --out-dir DIR        random blocks in Q4_K_S's layout
  python benchmarks/gguf_gpu.py make --shape qwen2.5-32b --random-quant Q4_K_M --out-dir DIR   the ~32B shape
  python benchmarks/gguf_gpu.py make --shape qwen3.6-27b --out-dir DIR        hybrid qwen35 + MTP layer, Q4_K_M's layout
  python benchmarks/gguf_gpu.py measure --files A.gguf,B.gguf [--compile]      flashdraft's steps on each file

`make` writes the BF16 file with the `gguf` package (random weights, std 0.02); llama.cpp's own `llama-quantize`
makes the other types from it and `llama-bench -ngl 99 -fa 1 -p 512 -n 128` is the peer (run by the caller).
The qwen35 shapes (Qwen3.5 / 3.6: Gated DeltaNet and gated attention, with the MTP `nextn` layer) are written in
Q4_K_M's layout directly, random blocks of each tensor's type, by the same `gguf` writer, each tensor streamed a
piece at a time (no `transformers` package needed).
`measure` loads each file with its matrices kept quantized and times, with CUDA graphs: a decode step and a
verify(16) step at 1k and 16k context, a random 5-layer DFlash draft's step (bf16, or with --draft-quant Q5_K
random blocks kept quantized, as the guide's Q5_K_M draft GGUF is), a 512-token prefill, and reports
peak GPU memory, the weights' GPU bytes against the file's tensor bytes, and the quantized weight-read floor
(the bytes of one step's matrices over the measured copy bandwidth).
"""
import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

# the engine's modules and the `gguf` package are imported where used
sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]


def byte_level_tokens(vocab: int) -> list[str]:
    """GPT-2's 256 byte-level symbols first (llama.cpp looks up the newline token), then placeholders."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs] + ["Ġt"] + [f"<t{i}>" for i in range(vocab - 257)]  # "Ġt": the one merge


def add_byte_level_tokenizer(w, vocab: int) -> None:
    """The tokenizer keys of a random-weight file: byte-level tokens (byte_level_tokens), one merge, BOS 257, EOS 258."""
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", byte_level_tokens(vocab))
    w.add_array("tokenizer.ggml.token_type", [1] * vocab)
    w.add_array("tokenizer.ggml.merges", ["Ġ t"])
    w.add_uint32("tokenizer.ggml.bos_token_id", 257)
    w.add_uint32("tokenizer.ggml.eos_token_id", 258)


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v / ffn_down Q4_K_M stores as Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


# llama-quantize's file types: (their matrices' default type, general.file_type)
FILE_TYPES = {"Q4_K_M": ("Q4_K", 15), "Q4_K_S": ("Q4_K", 14), "Q5_K_M": ("Q5_K", 17), "Q6_K": ("Q6_K", 18),
              "Q8_0": ("Q8_0", 7), "IQ4_XS": ("IQ4_XS", 30), "Q4_1": ("Q4_1", 3)}


def tensor_type(name: str, n_layers: int, file_type: str, gqa: int) -> str:
    """The type llama-quantize (llama_tensor_get_type, no imatrix) gives a llama-architecture matrix."""
    base = FILE_TYPES[file_type][0]
    if base == "Q4_1" and name in ("output.weight", "token_embd.weight"):  # as SmolLM2-135M-Instruct.Q4_1.gguf
        return "Q8_0"
    if name == "output.weight":
        return "Q8_0" if base == "Q8_0" else "Q6_K"
    layer, part = (int(name.split(".")[1]), name.split(".")[2]) if name.startswith("blk.") else (-1, "")
    if part in ("attn_v", "ffn_down") and file_type in ("Q4_K_M", "Q5_K_M") and more_bits(layer, n_layers):
        return "Q6_K"
    if part == "attn_v" and (file_type == "Q4_K_S" and layer < 4 or file_type == "IQ4_XS" and gqa >= 4):
        return "Q5_K"
    if part == "ffn_down" and file_type in ("Q4_K_S", "IQ4_XS") and layer < n_layers // 8:
        return "Q5_K"
    return base


# Qwen2.5-32B (Qwen/Qwen2.5-32B-Instruct's config), LlamaConfig's arguments: a ~32B llama-family shape with q/k/v
# biases; the tiny one's rows are multiples of 256 (K-quants)
QWEN25_32B = {"qwen2.5-32b": dict(arch="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                                  num_layers=64, num_heads=40, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                                  rope_theta=1e6, qkv_bias=True, max_position_embeddings=32768),
              "tiny": dict(arch="qwen2", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=4,
                           num_heads=4, num_kv_heads=2, head_dim=64, qkv_bias=True)}

# Gemma 4 31B (google/gemma-4-31B-it's text config) and a tiny stand-in for smoke tests
GEMMA4 = {"gemma-4-31b": dict(vocab=262144, hidden=5376, ffn=21504, layers=60, heads=32, kv=16, kv_full=4, hd=256,
                              hd_full=512, window=1024),
          "tiny": dict(vocab=512, hidden=256, ffn=512, layers=6, heads=4, kv=2, kv_full=1, hd=64, hd_full=128,
                       window=8)}  # K-quant rows: multiples of 256


def random_blocks(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random stored bytes [rows, row bytes] of `qtype` with sane fp16 scales (the kernel tests' generator)."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from test_gguf_kernels import random_blocks as blocks
    return blocks(qtype, rows, cols, seed)


def random_quantized(w, name: str, qtype: str, rows: int, cols: int) -> None:
    """Random blocks of `qtype` (sane fp16 scales): a file both engines read, no quantizer needed."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    if cols % block:
        raise SystemExit(f"{name}: rows of {cols} values do not hold whole {qtype} blocks of {block} (with --tiny "
                         f"take a 32-value type such as Q8_0)")
    raw = random_blocks(qtype, rows, cols, seed=len(w.tensors[0]))
    w.add_tensor(name, raw.reshape(rows, -1), raw_shape=(rows, cols // block * size),
                 raw_dtype=GGMLQuantizationType[qtype])


def write_out(w, out: Path) -> int:
    t = time.perf_counter()
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {out} ({out.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t:.1f} s")
    return 0


def make_gemma4(args) -> int:
    """A Gemma 4 31B-shaped GGUF with random blocks in Q4_K_S's layout as llama-quantize lays it out: Q4_K, the
    first four attn_v and the first eighth of ffn_down Q5_K, the tied embedding Q6_K (full layers have no attn_v:
    K = V); gemma4 keys as llama.cpp's converter writes them."""
    from gguf import GGUFWriter
    c = GEMMA4["tiny" if args.tiny else "gemma-4-31b"]
    out = Path(args.out_dir) / ("gemma-4-tiny-Q4_K_S.gguf" if args.tiny else "gemma-4-31B-it-Q4_K_S.gguf")
    out.parent.mkdir(parents=True, exist_ok=True)
    n, a = c["layers"], "gemma4"
    sliding = [(i + 1) % 6 != 0 for i in range(n)]
    w = GGUFWriter(str(out), a)
    w.add_string("general.name", "random gemma-4-31B-it shape")
    for key, value in (("block_count", n), ("context_length", 262144), ("embedding_length", c["hidden"]),
                       ("feed_forward_length", c["ffn"]), ("attention.head_count", c["heads"]),
                       ("attention.key_length", c["hd_full"]), ("attention.value_length", c["hd_full"]),
                       ("attention.key_length_swa", c["hd"]), ("attention.value_length_swa", c["hd"]),
                       ("rope.dimension_count", c["hd_full"]), ("rope.dimension_count_swa", c["hd"]),
                       ("attention.sliding_window", c["window"]), ("attention.shared_kv_layers", 0),
                       ("embedding_length_per_layer_input", 0)):
        w.add_uint32(f"{a}.{key}", value)
    w.add_array(f"{a}.attention.head_count_kv", [c["kv"] if s else c["kv_full"] for s in sliding])
    w.add_array(f"{a}.attention.sliding_window_pattern", sliding)
    w.add_float32(f"{a}.rope.freq_base", 1e6)
    w.add_float32(f"{a}.rope.freq_base_swa", 1e4)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{a}.final_logit_softcapping", 30.0)
    w.add_uint32("general.file_type", 14)  # MOSTLY_Q4_K_S
    add_byte_level_tokenizer(w, c["vocab"])
    H = c["hidden"]
    random_quantized(w, "token_embd.weight", "Q6_K", c["vocab"], H)
    w.add_tensor("output_norm.weight", np.ones(H, dtype=np.float32))
    rotated = c["hd_full"] // 8  # proportional RoPE: a quarter of the pairs rotate, the rest get factor 1e30
    w.add_tensor("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (c["hd_full"] // 2 - rotated), np.float32))
    v_seen = 0
    for i in range(n):
        p, hd, kv = f"blk.{i}.", (c["hd"] if sliding[i] else c["hd_full"]), (c["kv"] if sliding[i] else c["kv_full"])
        for norm, size in (("attn_norm", H), ("post_attention_norm", H), ("ffn_norm", H), ("post_ffw_norm", H),
                           ("attn_q_norm", hd), ("attn_k_norm", hd)):
            w.add_tensor(p + norm + ".weight", np.ones(size, dtype=np.float32))
        w.add_tensor(p + "layer_output_scale.weight", np.ones(1, dtype=np.float32))
        random_quantized(w, p + "attn_q.weight", "Q4_K", c["heads"] * hd, H)
        random_quantized(w, p + "attn_k.weight", "Q4_K", kv * hd, H)
        if sliding[i]:
            random_quantized(w, p + "attn_v.weight", "Q5_K" if v_seen < 4 else "Q4_K", kv * hd, H)
            v_seen += 1
        random_quantized(w, p + "attn_output.weight", "Q4_K", H, c["heads"] * hd)
        random_quantized(w, p + "ffn_gate.weight", "Q4_K", c["ffn"], H)
        random_quantized(w, p + "ffn_up.weight", "Q4_K", c["ffn"], H)
        random_quantized(w, p + "ffn_down.weight", "Q5_K" if i < n // 8 else "Q4_K", H, c["ffn"])
    return write_out(w, out)


@dataclass(frozen=True)
class Qwen35Shape:
    """A dense `qwen35` model (HF `qwen3_5`, text part), by the config values llama.cpp's converter reads."""
    vocab: int
    hidden: int
    ffn: int
    layers: int  # num_hidden_layers; the file's blocks add the MTP layers after them
    heads: int
    kv_heads: int
    head_dim: int
    k_heads: int  # linear_num_key_heads
    v_heads: int  # linear_num_value_heads
    head_k: int  # linear_key_head_dim, = linear_value_head_dim (llama.cpp's loader takes ssm.state_size for both)
    conv: int = 4  # linear_conv_kernel_dim
    mtp: int = 1  # mtp_num_hidden_layers
    interval: int = 4  # full_attention_interval: layer i is full attention where (i + 1) % interval == 0
    rope_theta: float = 1e7
    partial_rotary: float = 0.25
    eps: float = 1e-6
    context: int = 262144

    @property
    def blocks(self) -> int:
        return self.layers + self.mtp

    def recurrent(self, i: int) -> bool:
        return i < self.layers and (i + 1) % self.interval != 0


# qwen3.6-27b: Qwen/Qwen3.6-27B's text config (Qwen3.5-27B's is the same): 64 layers of 16 x (3 Gated DeltaNet + 1
# gated attention), 48 value / 16 key heads of 128, attention 24 heads / 4 KV of 256 (RoPE on 64), FFN 17408,
# vocabulary 248320, one MTP layer. In Q4_K_M's layout (q4_k_m_type) the file is 16,804,874,176 bytes (16.80 GB,
# 15.65 GiB; 5 MB of it the header's vocabulary): tensors 15.40 GiB without the MTP layer, as llama.cpp reports
# mradermacher's Qwen3.6-27B i1-Q4_K_M (15.401 GiB, no MTP layer), and 0.25 GiB more with it; model pages list
# Qwen3.6-27B Q4_K_M files at 16.5 and 16.8 GB.
# qwen3.5-tiny: the same layout at test size (every row whole 256-blocks, as in the 27B).
QWEN35 = {"qwen3.6-27b": Qwen35Shape(vocab=248320, hidden=5120, ffn=17408, layers=64, heads=24, kv_heads=4,
                                     head_dim=256, k_heads=16, v_heads=48, head_k=128),
          "qwen3.5-tiny": Qwen35Shape(vocab=320, hidden=256, ffn=512, layers=4, heads=4, kv_heads=2, head_dim=64,
                                      k_heads=2, v_heads=4, head_k=64)}


def qwen35_tensors(c: Qwen35Shape) -> list[tuple[str, tuple[int, ...]]]:
    """(name, torch-order shape) of every tensor llama.cpp's converter writes for the shape, MTP layers included,
    in the order llama-quantize writes them (the globals, then block by block, each by name)."""
    H, key, value = c.hidden, c.k_heads * c.head_k, c.v_heads * c.head_k
    out = [("output.weight", (c.vocab, H)), ("output_norm.weight", (H,)), ("token_embd.weight", (c.vocab, H))]
    for i in range(c.blocks):
        layer = [("attn_norm.weight", (H,)), ("post_attention_norm.weight", (H,)), ("ffn_gate.weight", (c.ffn, H)),
                 ("ffn_up.weight", (c.ffn, H)), ("ffn_down.weight", (H, c.ffn))]
        if c.recurrent(i):  # Gated DeltaNet
            layer += [("attn_qkv.weight", (2 * key + value, H)), ("attn_gate.weight", (value, H)),
                      ("ssm_conv1d.weight", (2 * key + value, c.conv)), ("ssm_dt.bias", (c.v_heads,)),
                      ("ssm_a", (c.v_heads,)), ("ssm_alpha.weight", (c.v_heads, H)),
                      ("ssm_beta.weight", (c.v_heads, H)), ("ssm_norm.weight", (c.head_k,)),
                      ("ssm_out.weight", (H, value))]
        else:  # gated attention: attn_q holds each head's query and gate
            q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
            layer += [("attn_q.weight", (2 * q, H)), ("attn_k.weight", (kv, H)), ("attn_v.weight", (kv, H)),
                      ("attn_output.weight", (H, q)), ("attn_q_norm.weight", (c.head_dim,)),
                      ("attn_k_norm.weight", (c.head_dim,))]
        if i >= c.layers:
            layer += [("nextn.eh_proj.weight", (H, 2 * H)), ("nextn.enorm.weight", (H,)), ("nextn.hnorm.weight", (H,)),
                      ("nextn.shared_head_norm.weight", (H,))]
        out += sorted((f"blk.{i}.{name}", shape) for name, shape in layer)
    return out


# llama-quantize's fallback where a row is not whole blocks of the chosen type (tensor_type_fallback)
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def q4_k_m_type(name: str, shape: tuple[int, ...], blocks: int) -> str:
    """The type llama-quantize gives a tensor of a `qwen35` file it makes Q4_K_M from the converter's BF16 one
    (llama-quant.cpp: tensor_allows_quantization, llama_tensor_get_type_impl; no imatrix or overrides):
    - left as the converter wrote them, F32: 1-D tensors, names not ending in "weight" (ssm_a), "_norm.weight",
      ssm_conv1d (the converter writes it F32 too);
    - output.weight Q6_K (not tied, so token_embd.weight stays the default Q4_K);
    - attn_qkv (the DeltaNet's) and attn_v both count as "attention-v" tensors and, with ffn_down, take Q6_K where
      use_more_bits(i, n) (more_bits), else Q4_K. i counts the tensors of that kind in llama-quantize's order and
      n is their number (ffn_down's: hparams.n_layer_all); each block, the MTP one too, holds one of each, so i is
      the block index and n the block count. (The later Q5_K branch for attn_qkv is not reached: the
      attention-v branch takes it first.)
    - the rest (attn_q/k/output, attn_gate, ssm_alpha/beta/out, ffn_gate/up, nextn.eh_proj) Q4_K.
    A row that is not whole 256-blocks falls back to a 32-block type (FALLBACK), or F16."""
    if len(shape) < 2 or not name.endswith("weight") or "_norm.weight" in name or "ssm_conv1d" in name:
        return "F32"
    qtype = "Q4_K"
    if name == "output.weight":
        qtype = "Q6_K" if shape[-1] % 256 == 0 else "Q8_0"
    elif name.startswith("blk.") and name.split(".")[2] in ("attn_v", "attn_qkv", "ffn_down"):
        qtype = "Q6_K" if more_bits(int(name.split(".")[1]), blocks) else "Q4_K"
    if shape[-1] % 256:
        qtype = FALLBACK[qtype] if shape[-1] % 32 == 0 else "F16"
    return qtype


# mean square of a block's values when its fp16 scales are 1 and the rest is random bytes: Q4_K's 6-bit sub-block
# scales and mins uniform in 0..63 (mean square 1333.5) times its 4-bit codes (77.5) less the mins; Q6_K's int8
# scales (5461.5) times its codes - 32 (341.5); Q8_0's int8 codes; Q5_0's codes - 16 (85.5)
CODE_MEAN_SQUARE = {"Q4_K": 1333.5 * (77.5 + 1), "Q6_K": 5461.5 * 341.5, "Q8_0": 5461.5, "Q5_0": 85.5}
SCALE_OFFSETS = {"Q4_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,), "Q5_0": (0,)}  # each block's fp16 d (and dmin)
CHUNK_BYTES = 1 << 28


def random_block_chunks(qtype: str, rows: int, cols: int, std: float, seed: int,
                        device: str) -> Iterator[np.ndarray]:
    """Random stored bytes of a [rows, cols] matrix of `qtype`, some rows at a time: random codes and sub-block
    scales, each block's fp16 scales uniform in +-b with b such that the values' standard deviation is `std`."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    n_blocks, bound = cols // block, std * math.sqrt(3 / CODE_MEAN_SQUARE[qtype])
    gen = torch.Generator(device).manual_seed(seed)
    step = max(1, CHUNK_BYTES // (n_blocks * size))
    for start in range(0, rows, step):
        n = min(step, rows - start)
        raw = torch.randint(0, 256, (n, n_blocks, size), generator=gen, device=device, dtype=torch.uint8)
        for offset in SCALE_OFFSETS[qtype]:
            d = torch.empty(n, n_blocks, device=device).uniform_(-bound, bound, generator=gen).half()
            raw[:, :, offset:offset + 2] = d.view(torch.uint8).view(n, n_blocks, 2)
        yield raw.cpu().numpy()


def qwen35_float(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """The F32 tensors, at values near a trained model's (HF's initialisation, as the converter stores it)."""
    if name.endswith(".ssm_a"):  # -exp(A_log): A uniform in (1, 16)
        return -rng.uniform(1, 16, shape).astype(np.float32)
    if name.endswith(".ssm_dt.bias"):  # softplus^-1(dt) for dt log-uniform in (0.001, 0.1)
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), shape))
        return (dt + np.log(-np.expm1(-dt))).astype(np.float32)
    if name.endswith(".ssm_conv1d.weight"):  # PyTorch's default bound for a depthwise kernel: 1 / sqrt(taps)
        return rng.uniform(-1, 1, shape).astype(np.float32) / math.sqrt(shape[-1])
    return np.ones(shape, np.float32)  # norms: HF's zero w stored as 1 + w; ssm_norm's plain ones


def float_chunks(name: str, shape: tuple[int, ...], seed: int) -> Iterator[np.ndarray]:
    yield qwen35_float(name, shape, np.random.default_rng(seed))


QWEN35_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 257-259 of byte_level_tokens' vocabulary
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def qwen35_writer(c: Qwen35Shape, label: str, device: str):
    """The whole Q4_K_M file as a `gguf.GGUFWriter` holding its keys and tensor table, with each tensor's stored
    bytes as a generator of pieces (by name, in the table's order): the keys llama.cpp's converter writes for the
    shape (tokenizer: byte_level_tokens with Qwen's three control tokens, EOS <|im_end|>, ChatML),
    general.file_type and quantization_version as llama-quantize sets them, and random tensors (weights' standard
    deviation 0.02). write_streamed writes it."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter
    a = "qwen35"
    w = GGUFWriter(None, a)
    tensors = qwen35_tensors(c)
    params = sum(math.prod(s) for _, s in tensors)
    w.add_string("general.type", "model")
    w.add_string("general.name", f"random {label} shape")
    w.add_string("general.size_label", f"{params / 1e9:.0f}B" if params >= 1e9 else f"{params / 1e6:.1f}M")
    for key, value in (("block_count", c.blocks), ("context_length", c.context), ("embedding_length", c.hidden),
                       ("feed_forward_length", c.ffn), ("attention.head_count", c.heads),
                       ("attention.head_count_kv", c.kv_heads)):
        w.add_uint32(f"{a}.{key}", value)
    w.add_float32(f"{a}.rope.freq_base", c.rope_theta)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", c.eps)
    w.add_uint32(f"{a}.attention.key_length", c.head_dim)
    w.add_uint32(f"{a}.attention.value_length", c.head_dim)
    for key, value in (("nextn_predict_layers", c.mtp), ("ssm.conv_kernel", c.conv), ("ssm.state_size", c.head_k),
                       ("ssm.group_count", c.k_heads), ("ssm.time_step_rank", c.v_heads),
                       ("ssm.inner_size", c.v_heads * c.head_k)):
        w.add_uint32(f"{a}.{key}", value)
    array = partial(w.add_key_value, vtype=GGUFValueType.ARRAY)
    array(f"{a}.attention.recurrent_layers", [c.recurrent(i) for i in range(c.blocks)], sub_type=GGUFValueType.BOOL)
    w.add_uint32(f"{a}.full_attention_interval", c.interval)
    w.add_uint32(f"{a}.rope.dimension_count", int(c.head_dim * c.partial_rotary))
    array(f"{a}.rope.dimension_sections", [11, 11, 10, 0], sub_type=GGUFValueType.INT32)  # the converter's default
    tokens, kinds = byte_level_tokens(c.vocab), [1] * c.vocab
    tokens[257:260], kinds[257:260] = QWEN35_SPECIALS, [3] * 3  # 3: control
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "qwen35")
    array("tokenizer.ggml.tokens", tokens, sub_type=GGUFValueType.STRING)
    array("tokenizer.ggml.token_type", kinds, sub_type=GGUFValueType.INT32)
    array("tokenizer.ggml.merges", ["Ġ t"], sub_type=GGUFValueType.STRING)
    w.add_uint32("tokenizer.ggml.eos_token_id", 259)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template", CHATML)
    w.add_uint32("general.quantization_version", 2)  # llama-quantize sets these two last
    w.add_uint32("general.file_type", FILE_TYPES["Q4_K_M"][1])
    chunks = {}
    for seed, (name, shape) in enumerate(tensors):
        qtype = q4_k_m_type(name, shape, c.blocks)
        if qtype == "F32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * math.prod(shape))
            chunks[name] = partial(float_chunks, name, shape, seed)
        else:  # the stored bytes, [rows, row bytes], as gguf.quants.quantize gives them
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
            raw_shape = (shape[0], shape[1] // block * size)
            w.add_tensor_info(name, raw_shape, np.dtype(np.uint8), math.prod(raw_shape),
                              raw_dtype=GGMLQuantizationType[qtype])
            chunks[name] = partial(random_block_chunks, qtype, shape[0], shape[1], 0.02, seed, device)
    return w, chunks


def write_head(w, path: Path) -> int:
    """The header, key/values and tensor table of `w` (a gguf.GGUFWriter) written to `path`, padded to the data's
    alignment; returns the size the file has once every tensor's bytes (each padded likewise) follow."""
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    f = w.fout[0]
    w.write_padding(f, f.tell())
    return f.tell() + sum(w.ggml_pad(ti.nbytes, w.data_alignment) for ti in w.tensors[0].values())


def write_streamed(w, chunks) -> int:
    """Each tensor of `w`'s table (after write_head), in order, from its generator of pieces, then the padding: one
    piece in memory at a time. Returns the file's size."""
    f = w.fout[0]
    for name, ti in w.tensors[0].items():
        written = 0
        for piece in chunks[name]():
            piece = np.ascontiguousarray(piece)
            piece.tofile(f)
            written += piece.nbytes
        if written != ti.nbytes:
            raise ValueError(f"{name}: {written} bytes written, its {ti.dtype.name} table entry holds {ti.nbytes}")
        w.write_padding(f, written)
    size = f.tell()
    w.close()
    return size


def make_qwen35(args) -> int:
    """A random `qwen35` GGUF in Q4_K_M's layout (random_block_chunks; q4_k_m_type), written by `gguf.GGUFWriter`
    a tensor piece at a time. --size-only prints the size, writing only the header to a temporary file."""
    import tempfile
    shape = "qwen3.5-tiny" if args.tiny else args.shape
    if args.random_quant not in (None, "Q4_K_M"):
        raise SystemExit(f"{shape} is written in Q4_K_M's layout only")
    w, chunks = qwen35_writer(QWEN35[shape], shape, "cuda" if torch.cuda.is_available() else "cpu")
    types: dict[str, list[int]] = {}
    for ti in w.tensors[0].values():
        n, size = types.get(ti.dtype.name, [0, 0])
        types[ti.dtype.name] = [n + 1, size + ti.nbytes]
    print(f"{shape} Q4_K_M: {len(w.tensors[0])} tensors, " + ", ".join(
        f"{q} {n} ({size / 2**30:.2f} GiB)" for q, (n, size) in sorted(types.items())))
    if args.size_only:
        with tempfile.TemporaryDirectory() as tmp:
            size = write_head(w, Path(tmp) / "head.gguf")
            w.close()
        print(f"file size {size:,} bytes ({size / 1e9:.2f} GB, {size / 2**30:.2f} GiB)")
        return 0
    out = Path(args.out_dir) / f"{shape}-Q4_K_M.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    size = write_head(w, out)
    print(f"file size {size:,} bytes ({size / 1e9:.2f} GB, {size / 2**30:.2f} GiB)")
    if write_streamed(w, chunks) != size:
        raise SystemExit(f"{out}: written size differs from the {size:,} bytes its table gives")
    print(f"wrote {out} in {time.perf_counter() - t:.1f} s")
    return 0


def gemma4_draft(target_cfg, device: str, dtype: torch.dtype, tiny: bool):
    """A random draft of z-lab's gemma-4-31B-it-DFlash shape: 5 Qwen3-style layers (4 sliding, window 2048, then
    a full one), 64 heads / 8 KV of 128, MLP 10752, block 16, six target layers, softcapped head."""
    from flashdraft.draft import DFlashDraft, DraftConfig
    hf = dict(architectures=["DFlashDraftModel"], hidden_size=target_cfg.hidden_size,
              intermediate_size=128 if tiny else 10752, num_hidden_layers=5, num_attention_heads=4 if tiny else 64,
              num_key_value_heads=2 if tiny else 8, head_dim=16 if tiny else 128, vocab_size=target_cfg.vocab_size,
              rope_theta=1e6, num_target_layers=target_cfg.num_layers, block_size=16, rms_norm_eps=1e-6,
              layer_types=["sliding_attention"] * 4 + ["full_attention"], use_sliding_window=True,
              sliding_window=8 if tiny else 2048, final_logit_softcapping=30.0,
              dflash_config=dict(mask_token_id=4, target_layer_ids=[1, 2, 3, 4] if tiny else [1, 12, 23, 35, 46, 57]))
    torch.manual_seed(1)
    with torch.device(device):
        draft = DFlashDraft(DraftConfig.from_hf(hf)).to(dtype)
    return draft.eval()


def quantized_draft(draft, qtype: str, device: str, dtype: torch.dtype):
    """`draft` (built on the meta device: only its config and tensor shapes are read) rebuilt with random blocks of
    qtype (sane fp16 scales) for each matrix and ones for the norms, kept quantized as a GGUF draft's matrices are
    (the guide's draft is a Q5_K_M GGUF): its memory and step time are a quantized draft's."""
    from flashdraft.draft.load import build_draft
    from flashdraft.layers.quantized import QuantizedWeight
    tensors = {}
    for i, (name, t) in enumerate(draft.state_dict().items()):
        if t.dim() == 2:
            raw = torch.from_numpy(random_blocks(qtype, t.shape[0], t.shape[1], seed=i))
            tensors[name] = QuantizedWeight(raw, qtype, tuple(t.shape))
        else:
            tensors[name] = torch.ones(t.shape, dtype=dtype, device=device)
    return build_draft(draft.cfg, tensors, Path(f"random {qtype} draft"), device, dtype)


def make(args) -> int:
    if args.shape in QWEN35:
        return make_qwen35(args)
    from gguf import GGMLQuantizationType, GGUFWriter
    from gpu import SHAPES, TINY

    from flashdraft.models.llama import LlamaConfig
    if args.shape.startswith("gemma"):
        return make_gemma4(args)
    if args.shape in QWEN25_32B:
        cfg = LlamaConfig(**QWEN25_32B["tiny" if args.tiny else args.shape])
    else:
        cfg = (TINY if args.tiny else SHAPES)[args.shape]
    if cfg.arch not in ("llama", "qwen2"):
        raise SystemExit(f"make writes llama and qwen2 files; {args.shape} is {cfg.arch}")
    kind = args.random_quant or "BF16"
    out = Path(args.out_dir) / f"{args.shape}-{kind}.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    a = cfg.arch
    w = GGUFWriter(str(out), a)
    w.add_string("general.name", f"random {args.shape}")
    w.add_uint32(f"{a}.block_count", cfg.num_layers)
    w.add_uint32(f"{a}.context_length", 32768)
    w.add_uint32(f"{a}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{a}.feed_forward_length", cfg.intermediate_size)
    w.add_uint32(f"{a}.attention.head_count", cfg.num_heads)
    w.add_uint32(f"{a}.attention.head_count_kv", cfg.num_kv_heads)
    w.add_float32(f"{a}.rope.freq_base", cfg.rope_theta)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_uint32(f"{a}.rope.dimension_count", cfg.head_dim)
    w.add_uint32("general.file_type", FILE_TYPES[args.random_quant][1] if args.random_quant else 32)  # 32: BF16
    add_byte_level_tokenizer(w, cfg.vocab_size)
    gen = torch.Generator(device="cuda" if torch.cuda.is_available() else "cpu").manual_seed(0)
    dev = gen.device

    def add(name: str, *shape: int, norm: bool = False) -> None:
        if norm:
            w.add_tensor(name, np.ones(shape, dtype=np.float32))
            return
        if name.endswith(".bias"):  # float32, as in llama.cpp's files
            bias = 0.02 * np.random.default_rng(len(w.tensors[0])).standard_normal(shape)
            w.add_tensor(name, bias.astype(np.float32))
            return
        if args.random_quant:  # a file type's layout with random blocks: no quantizer needed to time the kernels
            gqa = cfg.num_heads // cfg.num_kv_heads
            random_quantized(w, name, tensor_type(name, cfg.num_layers, args.random_quant, gqa), *shape)
            return
        t = (torch.randn(*shape, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
        w.add_tensor(name, t.view(torch.int16).cpu().numpy().view(np.uint16), raw_shape=shape,
                     raw_dtype=GGMLQuantizationType.BF16)

    H, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    add("token_embd.weight", cfg.vocab_size, H)
    add("output_norm.weight", H, norm=True)
    if not cfg.tie_word_embeddings:
        add("output.weight", cfg.vocab_size, H)
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", H, norm=True)
        add(p + "ffn_norm.weight", H, norm=True)
        add(p + "attn_q.weight", q, H)
        add(p + "attn_k.weight", kv, H)
        add(p + "attn_v.weight", kv, H)
        if cfg.qkv_bias:
            add(p + "attn_q.bias", q)
            add(p + "attn_k.bias", kv)
            add(p + "attn_v.bias", kv)
        add(p + "attn_output.weight", H, q)
        add(p + "ffn_gate.weight", cfg.intermediate_size, H)
        add(p + "ffn_up.weight", cfg.intermediate_size, H)
        add(p + "ffn_down.weight", H, cfg.intermediate_size)
    return write_out(w, out)


def file_matrix_bytes(path: str) -> tuple[int, int, dict]:
    """(bytes of all tensors, bytes one decode step reads: every matrix but the embedding, types count)."""
    from flashdraft.formats.gguf import read_gguf
    g = read_gguf(path)
    total = step = 0
    types: dict[str, int] = {}
    for name, t in g.tensors.items():
        n = int(t.data.nbytes)
        total += n
        if name != "token_embd.weight":
            step += n
        types[t.qtype.name] = types.get(t.qtype.name, 0) + 1
    return total, step, types


def copy_bandwidth(dev: str) -> float:
    from gpu import timed
    x = torch.randn((2 << 30) // 2, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x), 20, dev)
    return 2 * x.numel() * 2 / (ms * 1e-3)


def measure(args) -> int:
    from gpu import draft_for, timed

    from flashdraft.engine.engine import module_bytes
    from flashdraft.engine.generate import prefill
    from flashdraft.engine.graphs import GraphCache
    from flashdraft.engine.sampling import argmax_rows
    from flashdraft.engine.steps import bucket_for, plain_step
    from flashdraft.formats.loader import load_target
    if args.kernel_config:
        from flashdraft.kernels import gguf_matmul as K
        from flashdraft.kernels import gguf_gemv as G
        c = json.loads(Path(args.kernel_config).read_text())
        if "block_n" in c:
            K.BLOCK_N, K.NUM_WARPS, K.TARGET_PROGRAMS = c["block_n"], c["warps"], c["target"]
        G.CONFIG.update(c.get("gemv", {}))
        print(f"GGUF kernels: BLOCK_N {K.BLOCK_N}, {K.NUM_WARPS} warps, {K.TARGET_PROGRAMS} programs; integer "
              f"kernels {G.CONFIG}", flush=True)
    dev = args.device
    if args.no_mma:
        from flashdraft.kernels import gguf_mma
        gguf_mma.ENABLED = False
    if args.no_pdl:
        from flashdraft.kernels import pdl
        pdl.ENABLED = False
    if args.no_inductor_pdl:
        from flashdraft.kernels import pdl
        pdl.INDUCTOR = False
    if args.split_sum_launches:
        from flashdraft.layers import quantized
        quantized.GRAPH_SPLIT_SUMS = False
    if args.mma_programs:
        from flashdraft.kernels import gguf_mma
        gguf_mma.TARGET_PROGRAMS = dict.fromkeys(gguf_mma.TARGET_PROGRAMS, args.mma_programs)  # every type
    for tile in filter(None, args.gemv_tiles.split(";")):
        from flashdraft.kernels import gguf_gemv as G
        qtype, sizes = tile.split("=")
        block_n, sb, *more = map(int, sizes.split(","))
        cfg = dict(G.TYPE_CONFIGS.get(qtype, G.CONFIG), BLOCK_N=block_n, SB=sb)
        if more:
            cfg["num_warps"] = more[0]
        if len(more) > 1:
            cfg["maxnreg"] = more[1] or None
        G.TYPE_CONFIGS[qtype] = cfg
    ctxs = [int(c) for c in args.ctxs.split(",")]
    results = dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__, rows=[])
    if dev == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
        results["copy_GBps"] = copy_bandwidth(dev) / 1e9
    for path in args.files.split(","):
        total, step_bytes, types = file_matrix_bytes(path)
        torch.cuda.empty_cache() if dev == "cuda" else None
        torch.cuda.reset_peak_memory_stats() if dev == "cuda" else None
        t0 = time.perf_counter()
        with torch.inference_mode():
            target, _, _ = load_target(path, dev, torch.bfloat16, quantized=not args.dequantize)
        load_s = time.perf_counter() - t0
        weights = module_bytes(target)
        random_draft = gemma4_draft if target.cfg.arch == "gemma4" else draft_for
        draft = random_draft(target.cfg, "meta" if args.draft_quant else dev, torch.bfloat16, args.tiny)
        if args.draft_quant:
            draft = quantized_draft(draft, args.draft_quant, dev, torch.bfloat16)
        draft_bytes = module_bytes(draft)
        max_len = max(ctxs) + 256
        state = target.new_state(1, max_len)
        state.allow_rollback(16)  # a recurrent layer keeps a verify block's inputs, as the engine's target state
        draft.setup_cache(max_len)
        if args.compile:
            target.compile_layers((1, 16))
            draft.compile_layers()
        name = (Path(path).stem + (" +compile" if args.compile else "") + (" (dequantized)" if args.dequantize else "")
                + (" no-pdl" if args.no_pdl else "") + (f" tiles {args.gemv_tiles}" if args.gemv_tiles else "")
                + (" no-inductor-pdl" if args.no_inductor_pdl else "")
                + (" split-sum-launches" if args.split_sum_launches else "")
                + (f" mma {args.mma_programs}" if args.mma_programs else "")
                + (f" draft {args.draft_quant}" if args.draft_quant else ""))
        for ctx in ctxs:
            with torch.inference_mode():
                prompt = torch.randint(0, target.cfg.vocab_size - 1, (ctx,), device=dev)
                draft.reset(0)
                prefill(target, state, prompt, 0, draft=draft)
                graphs = GraphCache(dev)
                bucket = bucket_for(ctx + 16, max_len)
                tok, pos = torch.tensor([5], device=dev), torch.tensor([ctx], device=dev)
                block = torch.randint(0, target.cfg.vocab_size - 1, (16,), device=dev)
                positions = torch.arange(ctx, ctx + 16, device=dev)
                ids = draft.cfg.target_layer_ids

                def decode():
                    return graphs.run("plain", lambda t, p: plain_step(target, state, t, p, 0, bucket), [tok, pos])

                def verify():
                    return graphs.run("verify", lambda b, p: target(b[None], p[None], state, 0, capture=ids,
                                                                    attn_len=bucket), [block, positions])

                def draft_step():
                    def fn(b, p):
                        h = draft(target.token_embedding(b) * draft.cfg.input_embedding_scale, p, 0, None, bucket)
                        return (argmax_rows(draft.compute_logits(h[1:], target.logits)),)
                    return graphs.run("draft", fn, [block, positions])

                iters = 5 if args.tiny else 30
                ms = {f.__name__: timed(f, iters, dev) for f in (decode, verify, draft_step)}
                sweep = {}
                from torch import _dynamo  # (`import torch._dynamo` here would make torch a local name)

                from flashdraft.kernels import gguf_mma
                for point in filter(None, args.mma_sweep.split(",")):  # verify's split of K (and tile), same model
                    kept = gguf_mma.TARGET_PROGRAMS, gguf_mma.BLOCK_N, gguf_mma.NUM_WARPS
                    programs, *tile = [int(v) for v in point.split(":")]
                    gguf_mma.BLOCK_N, gguf_mma.NUM_WARPS = tile + list(kept[1 + len(tile):])
                    gguf_mma.TARGET_PROGRAMS = dict.fromkeys(kept[0], programs)  # every type
                    # compiled and captured again: the split (and the graph's partial sums' count) is chosen as a
                    # graph is traced
                    _dynamo.reset()
                    graphs = GraphCache(dev)
                    sweep[point] = timed(verify, iters, dev)
                    gguf_mma.TARGET_PROGRAMS, gguf_mma.BLOCK_N, gguf_mma.NUM_WARPS = kept
                if sweep:
                    _dynamo.reset()
                p512 = torch.randint(0, target.cfg.vocab_size - 1, (512,), device=dev)
                prefill_ms = timed(lambda: prefill(target, state, p512, 0), 3 if args.tiny else 5, dev)
            peak = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else 0.0
            floor_ms = step_bytes / (results.get("copy_GBps", 1.0) * 1e9) * 1e3
            row = dict(file=name, types=types, ctx=ctx, decode_ms=ms["decode"], decode_tok_s=1e3 / ms["decode"],
                       verify16_ms=ms["verify"], verify_over_decode=ms["verify"] / ms["decode"],
                       draft_ms=ms["draft_step"], draft_over_decode=ms["draft_step"] / ms["decode"],
                       prefill512_tok_s=512e3 / prefill_ms, peak_mem_GiB=peak, weights_GB=weights / 1e9,
                       draft_GB=draft_bytes / 1e9,
                       file_tensors_GB=total / 1e9, weights_over_file=weights / total,
                       step_bytes_GB=step_bytes / 1e9, floor_ms=floor_ms, decode_over_floor=ms["decode"] / floor_ms,
                       load_s=load_s, verify16_ms_by_mma_programs=sweep)
            results["rows"].append(row)
            print(f"{name} ctx {ctx}: decode {ms['decode']:.3f} ms ({1e3 / ms['decode']:.1f} tok/s, "
                  f"x{row['decode_over_floor']:.2f} the {floor_ms:.3f} ms floor), verify16 "
                  f"x{row['verify_over_decode']:.3f}, draft x{row['draft_over_decode']:.3f}, prefill "
                  f"{row['prefill512_tok_s']:.0f} tok/s, weights {weights / 1e9:.2f} GB of {total / 1e9:.2f} GB in "
                  f"the file, draft {draft_bytes / 1e9:.2f} GB, peak {peak:.1f} GiB", flush=True)
            for programs, t in sweep.items():
                print(f"  mma programs {programs}: verify16 {t:.3f} ms (x{t / ms['decode']:.3f} decode)", flush=True)
        target = draft = state = None  # free this file's model before the next loads
    print("\n| file | ctx | decode ms | tok/s | decode/floor | verify16/decode | draft/decode | prefill512 tok/s | "
          "weights GB / file GB | peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        print(f"| {r['file']} | {r['ctx']} | {r['decode_ms']:.3f} | {r['decode_tok_s']:.1f} | {r['decode_over_floor']:.2f} | "
              f"{r['verify_over_decode']:.3f} | {r['draft_over_decode']:.3f} | {r['prefill512_tok_s']:.0f} | "
              f"{r['weights_GB']:.2f} / {r['file_tensors_GB']:.2f} | {r['peak_mem_GiB']:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("action", choices=["make", "measure"])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--out-dir", default=".")
    ap.add_argument("--files", default="")
    ap.add_argument("--random-quant", choices=list(FILE_TYPES), default=None,
                    help="make: random blocks in a file type's layout (each matrix the type llama-quantize gives it)")
    ap.add_argument("--kernel-config", default=None,
                    help="measure: JSON {block_n, warps, target} and/or {gemv: {...}} for the GGUF kernels")
    ap.add_argument("--ctxs", default="1024,16384")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--dequantize", action="store_true", help="expand to bf16 at load (today's path, for comparison)")
    ap.add_argument("--no-mma", action="store_true",
                    help="measure: verify widths of Q4_K/Q6_K through the float kernel instead of kernels/gguf_mma.py")
    ap.add_argument("--no-pdl", action="store_true", help="plain launches (kernels/pdl.py off), for comparison")
    ap.add_argument("--split-sum-launches", action="store_true",
                    help="K's partial sums added by a launch of their own under --compile too (layers/quantized."
                         "GRAPH_SPLIT_SUMS off), for comparison")
    ap.add_argument("--no-inductor-pdl", action="store_true",
                    help="torch.compile's kernels launched the plain way (kernels/pdl.compile_options), for comparison")
    ap.add_argument("--mma-programs", type=int, default=None,
                    help="kernels/gguf_mma.TARGET_PROGRAMS for every type (split-K of verify)")
    ap.add_argument("--mma-sweep", default="", help="then time verify(16) again at each of these TARGET_PROGRAMS[:BLOCK_N"
                                                     "[:warps]], e.g. 132,264,264:64 (one load, graphs captured again)")
    ap.add_argument("--gemv-tiles", default="",
                    help='integer-kernel tiles per type, "IQ4_XS=16,8;Q5_K=4,16,4,0": BLOCK_N,SB[,warps[,maxnreg '
                         '(0: no cap)]]')
    ap.add_argument("--draft-quant", help="measure: the random draft's matrices as random blocks of this type, kept "
                                          "quantized (Q5_K: the guide's Q5_K_M draft GGUF; tiny shapes take Q8_0); "
                                          "default bf16")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke test of this script")
    ap.add_argument("--size-only", action="store_true",
                    help="make (qwen35 shapes): print the file's size and types, write no file (the "
                         "header alone goes to a temporary one, to be measured)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out")
    args = ap.parse_args()
    return make(args) if args.action == "make" else measure(args)


if __name__ == "__main__":
    sys.exit(main())
