"""Tiny random models written to disk in the real formats, for tests."""
import json
from pathlib import Path

import torch

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXT = ("def add(a, b):\n    return a + b\n\nThe quick brown fox jumps over the lazy dog. "
        "Speculative decoding drafts tokens and verifies them in one pass. 0123456789 ") * 20


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(
        bos_token=None, eos_token="<|im_end|>", chat_template=CHATML, add_bos_token=False)))


GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|channel>", "<channel|>",
                  "<|tool_call>", "<tool_call|>", "<|think|>"]
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}"
                  "\n{{ m['content'] }}<turn|>\n{% endfor %}{% if add_generation_prompt %}<|turn>model\n"
                  "{% if not enable_thinking | default(false) %}<|channel>thought\n<channel|>{% endif %}{% endif %}")


def write_gemma_tokenizer(folder: Path, merges: int = 80) -> int:
    """A Gemma-4-style tokenizer (transformers' GemmaTokenizer: BPE with byte fallback, spaces as "▁") with
    Gemma's special tokens first, the 256 byte tokens, then `merges` learned merges; returns its size."""
    import transformers
    from tokenizers import Tokenizer, models, normalizers, trainers
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    trainer = trainers.BpeTrainer(vocab_size=1000, show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    learned = json.loads(tok.to_str())["model"]
    vocab = {t: i for i, t in enumerate(GEMMA_SPECIALS + [f"<0x{b:02X}>" for b in range(256)])}
    for t in sorted(learned["vocab"], key=learned["vocab"].get):
        if len(t) == 1:
            vocab.setdefault(t, len(vocab))
    merge_list = []
    for m in learned["merges"][:merges]:
        a, b = m if isinstance(m, list) else m.split(" ")
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
            merge_list.append((a, b))
    hf = transformers.GemmaTokenizer(vocab=vocab, merges=merge_list, additional_special_tokens=GEMMA_SPECIALS[5:])
    hf.chat_template = GEMMA_TEMPLATE
    hf.save_pretrained(folder)
    return len(vocab)


def make_target(folder: Path, arch: str = "llama", vocab_size: int = 320, layers: int = 4, seed: int = 0,
                std: float = 0.15, heads: int = 4, kv_heads: int = 2) -> Path:
    import transformers
    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(folder, vocab_size)
    eos = 2  # <|im_end|>
    cfg = transformers.AutoConfig.for_model(
        model_type=arch, vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048, rms_norm_eps=1e-5,
        tie_word_embeddings=arch == "llama", eos_token_id=eos, bos_token_id=None)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    model.save_pretrained(folder)
    return folder


def make_draft(folder: Path, target: Path, layers: int = 2, block_size: int = 8, seed: int = 1,
               std: float = 0.15, **dflash) -> Path:
    from safetensors.torch import save_file
    from flashdraft.draft import DFlashDraft, DraftConfig
    tcfg = json.loads((target / "config.json").read_text())
    n_target = tcfg["num_hidden_layers"]
    hf = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=tcfg["hidden_size"],
              intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=tcfg["vocab_size"],
              max_position_embeddings=2048, num_target_layers=n_target, block_size=block_size,
              dflash_config=dict(dict(mask_token_id=tcfg["vocab_size"] - 1,
                                      target_layer_ids=[1, n_target - 2]), **dflash))
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    draft = DFlashDraft(DraftConfig.from_hf(hf))
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.normal_(1.0 if name.endswith("norm.weight") else 0.0, std)
    (folder / "config.json").write_text(json.dumps(hf))
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, str(folder / "model.safetensors"))
    return folder


def wait_healthy(proc, url: str, timeout: float = 120) -> None:
    """Wait until a server started as `proc` answers /health with 200 (fails if the process exits first)."""
    import contextlib
    import time

    import httpx
    deadline, status = time.time() + timeout, None
    while time.time() < deadline and status != 200:
        assert proc.poll() is None, proc.stdout.read()
        with contextlib.suppress(httpx.TransportError):
            status = httpx.get(url + "/health", timeout=5).status_code
        time.sleep(0.2)
    assert status == 200


def interrupt(proc, timeout: float = 60) -> str:
    """Stop a server with SIGINT (as Ctrl-C) and return its output; kill it if it does not stop in time."""
    import signal
    import subprocess
    proc.send_signal(signal.SIGINT)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        log, _ = proc.communicate()
    return log


def loaded_from_hf(model_cls, config_cls, hf, cfg: dict, max_len: int, unexpected_ok: str | None = None):
    """Our model of a family, built from an HF config dict and holding the HF model's weights, with a state of one
    slot of max_len positions (unexpected_ok: a part of the names the HF state dict may hold beyond ours)."""
    model = model_cls(config_cls.from_hf(cfg)).float()
    missing, unexpected = model.load_state_dict(hf.state_dict(), strict=False)
    unexpected = [k for k in unexpected if unexpected_ok is None or unexpected_ok not in k]
    assert not missing and not unexpected, (missing, unexpected)
    model.state = model.new_state(1, max_len)
    return model.eval()


def forward1(target, state, ids, positions, **kw):
    """One row through a target: ids, positions [T] -> (logits [T or 1, V] or None, features [T, L*H] or None)."""
    logits, feats = target(ids[None], positions[None], state, **kw)
    return None if logits is None else logits[0], None if feats is None else feats[0]


def greedy_continuation(target, state, prompt, n: int, **prefill_kw) -> list[int]:
    """n greedy tokens after prompt [T]: the prompt in one forward (prefill_kw, e.g. fresh=True), then one token a
    step through the cache."""
    import torch
    logits, _ = forward1(target, state, prompt, torch.arange(len(prompt)), **prefill_kw)
    out = [int(logits[-1].argmax())]
    for pos in range(len(prompt), len(prompt) + n - 1):
        logits, _ = forward1(target, state, torch.tensor([out[-1]]), torch.tensor([pos]))
        out.append(int(logits[-1].argmax()))
    return out


def decode_tokens(target, state, prompt, params, draft=None, static: bool = False, device: str = "cpu",
                  whole_cache: bool | None = None, **kw) -> list[int]:
    """Every token the engine's decode loop commits. static: bucketed shapes, as under CUDA graphs (on the CPU
    the same functions run eagerly; on CUDA the graphs themselves). whole_cache: override Steps.whole_cache."""
    import itertools

    from flashdraft.engine.generate import decode
    from flashdraft.engine.steps import Steps
    steps = Steps(target, state, draft, device)
    steps.static = static or steps.static
    steps.whole_cache = steps.whole_cache if whole_cache is None else whole_cache
    return list(itertools.chain.from_iterable(decode(steps, prompt, params, speculative=draft is not None, **kw)))


def finish_gguf(w) -> None:
    """Write a gguf.GGUFWriter's header, metadata and tensors, and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_beellama_draft_gguf(path: Path, draft, qtype: str = "Q8_0") -> Path:
    """A DFlash draft as BeeLlama's `dflash-draft` GGUF (the keys and names its converter writes, as in the shared
    fixtures), matrices in `qtype`, norms F32."""
    import gguf
    cfg, arch = draft.cfg, "dflash-draft"
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", cfg.num_hidden_layers), ("context_length", cfg.max_position_embeddings),
                       ("embedding_length", cfg.hidden_size), ("feed_forward_length", cfg.intermediate_size),
                       ("attention.head_count", cfg.num_attention_heads),
                       ("attention.head_count_kv", cfg.num_key_value_heads), ("attention.key_length", cfg.head_dim),
                       ("attention.value_length", cfg.head_dim), ("rope.dimension_count", cfg.head_dim),
                       ("dflash.block_size", cfg.block_size), ("dflash.mask_token_id", cfg.mask_token_id),
                       ("dflash.n_target_features", cfg.context_width)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_theta)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_bool(f"{arch}.attention.causal", False)
    w.add_array(f"{arch}.dflash.target_layer_ids", list(cfg.target_layer_ids))
    if cfg.sliding_window:
        w.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
        w.add_array(f"{arch}.attention.sliding_window_pattern", [t == "sliding_attention" for t in cfg.layer_types])
    names = {"fc": "dflash_fc", "hidden_norm": "dflash_hidden_norm", "norm": "output_norm"}
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, t in draft.state_dict().items():
        base = name.removesuffix(".weight")
        if base.startswith("layers."):
            _, i, part = base.split(".", 2)
            gname = f"blk.{i}.{parts[part]}.weight"
        else:
            gname = f"{names[base]}.weight"
        data = t.float().numpy()
        if data.ndim == 2:
            kind = getattr(gguf.GGMLQuantizationType, qtype)
            w.add_tensor(gname, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            w.add_tensor(gname, data)
    finish_gguf(w)
    return path


def write_target_gguf(path: Path, folder: Path) -> Path:
    """A make_target folder (llama) as the GGUF llama.cpp's converter would write: F32 tensors with q/k rows
    permuted, its byte-level BPE vocabulary and merges, the chat template. flashdraft loads both to the same model."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file
    cfg = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.name", folder.name)
    for key, value in (("block_count", cfg["num_hidden_layers"]), ("context_length", cfg["max_position_embeddings"]),
                       ("embedding_length", cfg["hidden_size"]), ("feed_forward_length", cfg["intermediate_size"]),
                       ("attention.head_count", heads), ("attention.head_count_kv", kv_heads)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.rope.freq_base", float(cfg.get("rope_theta", 10000.0)))
    w.add_float32("llama.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"]: t["id"] for t in tok["added_tokens"]}
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", [t for t, _ in vocab])
    w.add_array("tokenizer.ggml.token_type", [3 if t in specials else 1 for t, _ in vocab])  # 3: control
    w.add_array("tokenizer.ggml.merges", [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_uint32("tokenizer.ggml.eos_token_id", cfg["eos_token_id"])
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template", CHATML)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, array in load_file(str(folder / "model.safetensors")).items():
        array = array.astype(np.float32)
        if name.startswith("model.layers."):
            _, _, i, module = name.removesuffix(".weight").split(".", 3)
            if module in ("self_attn.q_proj", "self_attn.k_proj"):  # convert_hf_to_gguf.py's LlamaModel.permute
                n = heads if module == "self_attn.q_proj" else kv_heads
                array = array.reshape(n, 2, array.shape[0] // n // 2, -1).swapaxes(1, 2).reshape(array.shape)
            w.add_tensor(f"blk.{i}.{names[module]}.weight", array)
        elif name != "lm_head.weight" or not cfg.get("tie_word_embeddings"):
            w.add_tensor({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                          "lm_head.weight": "output.weight"}[name], array)
    finish_gguf(w)
    return path
