"""Gemma GGUF files as users get them: random Gemma 3 / Gemma 4 models written by llama.cpp's own
convert_hf_to_gguf.py (from the llama-cpp-python==0.3.36 sdist, fetched on first use, never part of the
project) load with transformers' logits and tokenizer; a feature not supported yet is named; the real Gemma 3
270M file (slow) decodes as transformers' GGUF loading does."""
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch
from tiny import TEXT, write_gemma_tokenizer

from flashdraft.formats.gguf import gguf_to_hf_config, read_gguf
from flashdraft.formats.loader import load_target

transformers = pytest.importorskip("transformers")
SDIST = "llama-cpp-python==0.3.36"
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/templates/google-gemma-4")


@pytest.fixture(scope="session")
def converter() -> Path:
    """llama.cpp's convert_hf_to_gguf.py from the sdist (FLASHDRAFT_LLAMA_CPP: an unpacked vendor/llama.cpp)."""
    given = os.environ.get("FLASHDRAFT_LLAMA_CPP")
    root = Path(given) if given else Path.home() / ".cache" / "flashdraft" / "llama-cpp-0.3.36"
    if not (root / "models/templates/google-gemma-4-31B-it.jinja").is_file():
        if given:
            pytest.skip(f"FLASHDRAFT_LLAMA_CPP={given} has no convert_hf_to_gguf.py")
        work = root.with_name(root.name + ".download")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", SDIST,
                            "-d", str(work)], capture_output=True, text=True)
        archives = list(work.glob("*.tar.gz"))
        if r.returncode or not archives:
            pytest.skip(f"the {SDIST} sdist could not be fetched: {r.stderr[-300:]}")
        with tarfile.open(archives[0]) as tar:
            prefix = tar.getnames()[0].split("/")[0] + "/vendor/llama.cpp/"
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                       and m.name[len(prefix):].startswith(CONVERTER_PARTS)]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(root, members=members, filter="data")
        shutil.rmtree(work, ignore_errors=True)
    return root


def convert(converter: Path, folder: Path) -> Path:
    out = folder.with_suffix(".gguf")
    env = {**os.environ, "PYTHONPATH": str(converter / "gguf-py")}
    r = subprocess.run([sys.executable, str(converter / "convert_hf_to_gguf.py"), str(folder), "--outfile", str(out),
                        "--outtype", "f32"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def random_model(folder: Path, vocab_size: int, **config):
    config = dict(dict(head_dim=16), **config)
    cfg = transformers.AutoConfig.for_model(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=1024, eos_token_id=1, bos_token_id=2,
                                            pad_token_id=0, **config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(folder)
    return model


def write_sentencepiece(folder: Path) -> int:
    """A Gemma 3-style SentencePiece BPE vocabulary (byte fallback, Gemma's special ids) as tokenizer.model."""
    spm = pytest.importorskip("sentencepiece")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.txt").write_text(TEXT.replace(". ", ".\n"))
    spm.SentencePieceTrainer.train(input=str(folder / "corpus.txt"), model_prefix=str(folder / "tokenizer"),
                                   vocab_size=400, model_type="bpe", byte_fallback=True, pad_id=0, eos_id=1,
                                   bos_id=2, unk_id=3, add_dummy_prefix=False, user_defined_symbols=["<mask>"],
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   minloglevel=2)
    (folder / "corpus.txt").unlink()
    (folder / "tokenizer.vocab").unlink()
    return spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model")).vocab_size()


def check_logits(hf, gguf: Path) -> None:
    target, _, _ = load_target(str(gguf))
    ids = torch.randint(0, hf.config.vocab_size, (1, 50))
    with torch.no_grad():
        ref = hf(ids).logits[0]
        got, _ = target(ids, torch.arange(50)[None], target.new_state(1, 128), 0, fresh=True)
    assert (got[0] - ref).abs().max() / ref.abs().max() < 1e-4


GEMMA4 = dict(model_type="gemma4_text", sliding_window=8, global_head_dim=32, num_global_key_value_heads=1,
              attention_k_eq_v=True, final_logit_softcapping=30.0, hidden_size_per_layer_input=0)
TEXTS = ["The quick fox\n\n jumps over 日本 the lazy dog", "  two  spaces\tand tab", "<|turn>user\nhi<turn|>\n"]


def test_gemma4_gguf_from_llama_cpp_converter(converter, tmp_path):
    folder = tmp_path / "gemma4"
    vocab = write_gemma_tokenizer(folder)
    hf = random_model(folder, vocab, **GEMMA4)
    gguf = convert(converter, folder)
    check_logits(hf, gguf)
    _, tok, _ = load_target(str(gguf))
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        ids = tok.encode(text, add_special=False)
        assert ids == ref(text, add_special_tokens=False).input_ids, text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    turn_end = tok.token_to_id("<turn|>")
    assert turn_end in tok.eos_ids and tok.add_bos  # <turn|> ends a generation; BOS first, as llama.cpp
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False,
                                                                        add_generation_prompt=True)


def test_gemma3_gguf_from_llama_cpp_converter(converter, tmp_path):
    folder = tmp_path / "gemma3"
    vocab = write_sentencepiece(folder)
    hf = random_model(folder, vocab, model_type="gemma3_text", sliding_window=8, query_pre_attn_scalar=16)
    gguf = convert(converter, folder)
    assert read_gguf(gguf).tensors["output_norm.weight"] is not None
    check_logits(hf, gguf)  # the (1 + w) norms baked into the file by the converter come back as w
    import sentencepiece
    sp = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    _, tok, _ = load_target(str(gguf))
    for text in TEXTS[:2]:
        assert tok.encode(text, add_special=False) == sp.encode(text), text


@pytest.mark.parametrize("key,value,words", [("gemma4.expert_count", 128, "mixture of experts"),
                                             ("gemma4.embedding_length_per_layer_input", 256, "per-layer embeddings"),
                                             ("gemma4.attention.shared_kv_layers", 20, "shared KV layers")])
def test_gemma4_gguf_features_not_supported_yet_are_named(converter, tmp_path, key, value, words):
    folder = tmp_path / "gemma4"
    random_model(folder, write_gemma_tokenizer(folder), **GEMMA4)
    g = read_gguf(convert(converter, folder))
    with pytest.raises(ValueError, match=words):
        gguf_to_hf_config({**g.metadata, key: value}, g.tensors)


@pytest.mark.slow
def test_gemma3_270m_real_file_matches_transformers():
    from flashdraft.formats.named import cache_dir
    path = cache_dir() / "models" / "gemma-3-270m-q4_k_m.gguf"
    if not path.is_file():
        pytest.skip(f"{path.name} is not in the cache: python tests/data_files.py gemma270m (253 MB from PyPI)")
    target, tok, _ = load_target(str(path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ref_tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    prompt = "def fibonacci(n):\n    "
    ids = tok.encode(prompt)
    assert ids == ref_tok(prompt).input_ids
    state = target.new_state(1, 256)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        got, _ = target(torch.tensor([ids]), torch.arange(len(ids))[None], state, 0, fresh=True)
        assert (got[0] - ref).abs().max() / ref.abs().max() < 1e-4
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)[0, len(ids):].tolist()
        out = [int(got[0, -1].argmax())]
        for pos in range(len(ids), len(ids) + len(expected) - 1):
            logits, _ = target(torch.tensor([[out[-1]]]), torch.tensor([[pos]]), state, 0)
            out.append(int(logits[0, -1].argmax()))
    assert out == expected


GUIDE_TARGET, GUIDE_DRAFT = "gemma-4-31B-it-Q4_K_S.gguf", "gemma4-31b-it-dflash-Q5_K_M.gguf"


@pytest.fixture(scope="module")
def guide_files(converter, tmp_path_factory) -> tuple[Path, Path]:
    """Random-weight Gemma 4 files of small shapes, named as the guide names them: the target converted by
    llama.cpp (Q8_0), the draft in BeeLlama's dflash-draft layout (z-lab's Gemma draft shape: sliding layers
    then a full one, mask token <mask>, softcapped head)."""
    from tiny import write_beellama_draft_gguf

    from flashdraft.draft import DFlashDraft, DraftConfig
    root = tmp_path_factory.mktemp("guide")
    folder = root / "gemma4-hf"
    vocab = write_gemma_tokenizer(folder)
    random_model(folder, vocab, **GEMMA4 | dict(head_dim=32, global_head_dim=64))  # heads of q5_0/q4_1 blocks
    target = convert(converter, folder)
    target = target.rename(root / GUIDE_TARGET)
    cfg = DraftConfig.from_hf(dict(architectures=["DFlashDraftModel"], hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   vocab_size=vocab, num_target_layers=6, block_size=8, sliding_window=16,
                                   use_sliding_window=True, final_logit_softcapping=30.0,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                   dflash_config=dict(mask_token_id=4, target_layer_ids=[1, 3, 4])))
    torch.manual_seed(3)
    draft = DFlashDraft(cfg)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * 0.2)
    return target, write_beellama_draft_gguf(root / GUIDE_DRAFT, draft)


@pytest.mark.parametrize("line", ["LINE_1", "LINE_2"])
def test_guide_command_lines_with_gemma4_files(guide_files, line):
    """The guide's two llama-server lines with flashdraft serve: the first (q5_0 K and q4_1 V cache, no draft)
    and the second (DFlash) serve the guide's request shape."""
    import test_server
    from test_server import REPO, free_port
    from tiny import interrupt, wait_healthy
    target, draft = guide_files
    port = free_port()
    cmd = [sys.executable, "-m", "flashdraft.cli", "serve",
           *getattr(test_server, line).format(target=target, draft=draft, port=port).split(), "--device", "cpu"]
    speculative = line == "LINE_2"
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        import httpx
        props = httpx.get(url + "/props").json()
        if speculative:
            assert props["speculative"]["type"] == "dflash" and props["speculative"]["block_size"] == 8
        else:  # 32-value blocks of K (22 bytes) and V (20 bytes) per head; sliding layers hold their window only
            assert props["memory_bytes"]["kv_per_token"] == 2 * 5 * (1 * 22 + 1 * 20) + 1 * (2 * 22 + 2 * 20)
            assert "flashdraft:kv_per_token_bytes 504" in httpx.get(url + "/metrics").text
        prompt = httpx.post(url + "/apply-template", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert prompt["prompt"].endswith("<|turn>model\n<|channel>thought\n<channel|>")  # --reasoning off
        body = {"model": "gemma", "messages": [{"role": "user", "content": "Write a quicksort in Python."}],
                "max_tokens": 40, "stream": False, "ignore_eos": True}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
        assert "usage" in r, r
        assert r["usage"]["completion_tokens"] == 40 and r["timings"]["predicted_per_second"] > 0
        if speculative:
            assert r["timings"]["draft_n"] > 0 and r["speculative"]["block_size"] == 8
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- the server's log ---\n{interrupt(proc, 30)[-4000:]}") from e
    finally:
        log = interrupt(proc, 30) if proc.poll() is None else ""
    assert "Traceback" not in log, log[-3000:]


def test_the_real_gemma4_template_renders_thinking_on_and_off(converter):
    """gemma-4-31B-it's own chat template (as llama.cpp ships it) through flashdraft's jinja path: --reasoning off
    gives the empty thought channel, on the <|think|> system flag; tools render."""
    from flashdraft.formats.chat import chat_ids
    from flashdraft.formats.tokenizer import Tokenizer
    from flashdraft.server.reasoning import prompt_opens_thinking
    template = (converter / "models/templates/google-gemma-4-31B-it.jinja").read_text()

    class Echo(Tokenizer):  # renders, and "tokenizes" to the text itself
        def __init__(self):
            super().__init__(None, chat_template=template, special_tokens={"bos_token": "<bos>"})

        def encode(self, text, add_special=True, limit=None):
            return text

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    off = chat_ids(Echo(), messages, "off")
    on = chat_ids(Echo(), messages, "on")
    assert off.endswith("<|turn>model\n<|channel>thought\n<channel|>") and prompt_opens_thinking(off) is None
    assert on.endswith("<|turn>model\n") and "<|think|>" in on and "<|think|>" not in off
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    assert "get_weather" in chat_ids(Echo(), messages, "off", {"tools": tools})
