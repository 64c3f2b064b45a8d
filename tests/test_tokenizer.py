import json
import random

import numpy as np
import pytest
from tiny import finish_gguf
from gguf import GGUFWriter

from flashdraft.formats.gguf import read_gguf
from flashdraft.formats.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # memo? {}\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }\r\n",
    "naïve café, Ünïcödé ñ ß ∑ ∫ → ✓ 日本語のテキスト 한국어 العربية हिन्दी",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 🤖",
    "  leading, trailing and   multiple   spaces  \t\ttabs\n\n\n   \n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "a<|im_end|>b <|endoftext|> <repo_name>x<file_sep>y",
    "12345 3.14159 1,000,000 2024-01-31 0x1F",
    "I'm sure we'll see they've DON'T can't",
    "email@example.com https://example.org/a/b?x=1&y=%20z#frag",
    "", " ", "\n", "\t",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Write a haiku about the sea 🌊."}],
    [{"role": "user", "content": "  spaces\n\nand lines  "}, {"role": "assistant", "content": "ok"}],
]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_file):
    return Tokenizer.from_gguf(smollm2_file)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


def test_gguf_tokenizer_matches_transformers(smollm2_tokenizer, hf_tokenizer):
    tok = smollm2_tokenizer
    assert tok.vocab_size == len(hf_tokenizer) == 49152
    assert tok.bos_id == hf_tokenizer.bos_token_id == 1 and tok.eos_ids[0] == hf_tokenizer.eos_token_id == 2
    assert not tok.add_bos  # the file says add_bos_token = false
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tokenizer(text).input_ids, text
        assert tok.encode(text, add_special=False) == hf_tokenizer(text, add_special_tokens=False).input_ids
        assert tok.decode(ids, skip_special=False) == hf_tokenizer.decode(ids, skip_special_tokens=False)
        assert tok.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert tok.encode("<|im_start|>") == [1]  # control tokens are matched whole


def test_smollm2_splits_digits(smollm2_tokenizer):
    # llama.cpp's `smollm` pre-tokenizer (and SmolLM2's own tokenizer.json) split every digit
    ids = smollm2_tokenizer.encode("2024")
    assert [smollm2_tokenizer.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_chat_template_matches_transformers(smollm2_tokenizer, hf_tokenizer):
    assert smollm2_tokenizer.chat_template == hf_tokenizer.chat_template
    for messages in CONVERSATIONS:
        for gen in (True, False):
            mine = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=gen)
            ref = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert mine == ref
            assert smollm2_tokenizer.encode(mine, add_special=False) == hf_tokenizer(
                ref, add_special_tokens=False).input_ids


FEATURE_TEMPLATES = [
    # trim_blocks / lstrip_blocks, bos/eos variables, extra kwargs
    "{{ bos_token }}{% for m in messages %}\n  {% if m.role == 'user' %}\n[U] {{ m.content }}{{ eos_token }}\n  {% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}[A]{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% endif %}{% endif %}",
    # tojson keeps non-ASCII and takes options; loop controls; namespace
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}{{ m | tojson }}|{{ m | tojson(indent=2) }}{% endfor %}{{ ns.n }}{{ tools | tojson }}",
    # the {% generation %} tag used for assistant masks renders its body
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
    "{% else %}{{ m.content }}{% endif %}{% endfor %}",
]


@pytest.mark.parametrize("template", FEATURE_TEMPLATES)
def test_template_features_match_transformers(template):
    pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template
    from tokenizers import Tokenizer as Backend, models

    tok = Tokenizer(Backend(models.BPE()), chat_template=template,
                    special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    messages = CONVERSATIONS[1] + [{"role": "user", "content": "日本 \"quoted\" <tag>", "name": None}]
    for kwargs in ({}, {"enable_thinking": False}, {"tools": [{"name": "f", "description": "é"}]}):
        ref, _ = render_jinja_template([messages], chat_template=template, add_generation_prompt=True,
                                       bos_token="<s>", eos_token="</s>", **kwargs)
        assert tok.apply_chat_template(messages, **kwargs) == ref[0]


def test_template_helpers():
    import datetime

    import jinja2
    from tokenizers import Tokenizer as Backend, models

    tok = Tokenizer(Backend(models.BPE()), chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(jinja2.exceptions.TemplateError, match="no system role"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    tok.chat_template = "{{ strftime_now('%Y') }}"
    assert tok.apply_chat_template([]) == str(datetime.datetime.now().year)
    tok.chat_template = "{{ ''.__class__.__mro__ }}"  # the sandbox refuses attribute escapes
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([])
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([])


# -------------------------------------------------------------------------------------- HF folders

def write_hf_folder(folder, smollm2_tokenizer, bos_post_processor=False, **config):
    from tokenizers import processors

    backend = smollm2_tokenizer.backend
    if bos_post_processor:  # like Llama 3's tokenizer.json: the post-processor adds BOS
        backend = type(backend).from_str(backend.to_str())
        backend.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", pair="<|im_start|> $A $B",
                                                               special_tokens=[("<|im_start|>", 1)])
    folder.mkdir(exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
              "chat_template": smollm2_tokenizer.chat_template, **config}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return folder


def test_hf_folder(tmp_path, smollm2_tokenizer):
    transformers = pytest.importorskip("transformers")
    folder = write_hf_folder(tmp_path / "plain", smollm2_tokenizer)
    tok = Tokenizer.from_hf_folder(folder)
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    assert tok.eos_ids == [2, 0] and tok.bos_id == 1 and not tok.add_bos
    for text in TEXTS:
        assert tok.encode(text) == ref(text).input_ids, text
    messages = CONVERSATIONS[1]
    assert tok.apply_chat_template(messages) == ref.apply_chat_template(messages, tokenize=False,
                                                                        add_generation_prompt=True)
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer.from_hf_folder(folder).apply_chat_template(messages) == "You are terse.!"


def test_hf_folder_bos_is_not_doubled(tmp_path, smollm2_tokenizer):
    transformers = pytest.importorskip("transformers")
    folder = write_hf_folder(tmp_path / "bos", smollm2_tokenizer, bos_post_processor=True)
    tok = Tokenizer.from_hf_folder(folder)
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    assert tok.add_bos
    assert tok.encode("Hello world") == ref("Hello world").input_ids == [1] + tok.encode("Hello world", False)
    rendered = tok.apply_chat_template(CONVERSATIONS[0])
    assert rendered.startswith("<|im_start|>")
    assert tok.encode(rendered)[:2] == [1] + tok.encode("system", False)[:1]
    assert tok.encode(rendered).count(1) == rendered.count("<|im_start|>")
    no_bos = Tokenizer.from_hf_folder(write_hf_folder(tmp_path / "nobos", smollm2_tokenizer, bos_post_processor=True,
                                                      add_bos_token=False))
    assert not no_bos.add_bos


def test_hf_folder_without_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)


# ------------------------------------------------------------------------- SentencePiece-style GGUF

SPM_PIECES = ["▁the", "▁qu", "ick", "▁bro", "wn", "▁fox", "▁j", "umps", "▁over", "▁lazy", "▁dog", "in", "ing",
              "er", "▁a", "▁t", "he", "th", "▁", "▁▁", "▁▁▁▁", "▁Hello", "▁world"]


def write_spm_gguf(path):
    chars = sorted(set("".join(SPM_PIECES)) | set("abcdefghijklmnopqrstuvwxyzHW0123456789.,!?'é"))
    normal = list(dict.fromkeys(chars + SPM_PIECES))
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + normal + ["<|user|>", "<think>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(normal) + [3, 4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(normal))] + [0.0, 0.0]
    w = GGUFWriter(str(path), "llama")
    for key, value in {"block_count": 1, "context_length": 128, "embedding_length": 32, "feed_forward_length": 64,
                       "attention.head_count": 2, "attention.head_count_kv": 2}.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.scores", scores)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_uint32("tokenizer.ggml.unknown_token_id", 0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_string("tokenizer.chat_template", "{{ bos_token }}{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}")
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), np.float32))
    finish_gguf(w)
    return path


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory):
    return write_spm_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf")


def test_sentencepiece_gguf_matches_transformers(spm_gguf):
    transformers = pytest.importorskip("transformers")
    tok = Tokenizer.from_gguf(read_gguf(spm_gguf))
    ref = transformers.AutoTokenizer.from_pretrained(spm_gguf.parent, gguf_file=spm_gguf.name)
    texts = ["the quick brown fox", "Hello world. The lazy dog jumps over the fox!", "  two spaces", "日本 é ü",
             "a<|user|>b <think>x", "", "Hello!\n\nWorld 42"]
    for text in texts:
        ids = tok.encode(text)
        assert ids == ref(text).input_ids, text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.add_bos and tok.bos_id == 1 and tok.eos_ids == [2]
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<s><|user|>hi"
    assert tok.encode(rendered)[:2] == [1, tok.token_to_id("<|user|>")]  # one BOS, not two


# ---------------------------------------------------------------------------------- detokenizer

MULTIBYTE = "Grüße, 世界! 😀👍🏽 👨‍👩‍👧‍👦 naïve — “quotes” ∑x² 🇯🇵 done"


@pytest.mark.parametrize("which", ["byte_level", "sentencepiece"])
def test_incremental_detokenizer_round_trip(which, smollm2_tokenizer, spm_gguf):
    tok = smollm2_tokenizer if which == "byte_level" else Tokenizer.from_gguf(read_gguf(spm_gguf))
    ids = tok.encode(MULTIBYTE, add_special=False)
    assert tok.decode(ids) == MULTIBYTE
    rng = random.Random(0)
    for chunking in ("one", "random"):
        detok = IncrementalDetokenizer(tok)
        deltas, i = [], 0
        while i < len(ids):
            n = 1 if chunking == "one" else rng.randint(1, 4)
            deltas.append(detok.push(ids[i:i + n]))
            i += n
        deltas.append(detok.flush())
        assert "".join(deltas) == tok.decode(ids)
        assert not any("\ufffd" in d for d in deltas)
        assert "" in deltas[:-1]  # some pushes ended inside a UTF-8 sequence and were held back


def test_incremental_detokenizer_specials_and_cut_sequences(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("<|im_start|>assistant\nHi 😀<|im_end|>", add_special=False)
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.push(i) for i in ids) + detok.flush()
    assert text == tok.decode(ids) == "assistant\nHi 😀"
    emoji = tok.encode("😀", add_special=False)
    assert len(emoji) > 1
    detok = IncrementalDetokenizer(tok)
    assert detok.push(emoji[:-1]) == ""
    assert detok.flush() == tok.decode(emoji[:-1])  # a stream cut mid-character ends with U+FFFD, like decode


@pytest.mark.parametrize("which", ["byte_level", "sentencepiece"])
def test_token_bytes_concatenate_to_the_text(which, smollm2_tokenizer, spm_gguf):
    """Each token's own bytes (a piece of a UTF-8 character stays a piece): joined, they are the decoded text."""
    tok = smollm2_tokenizer if which == "byte_level" else Tokenizer.from_gguf(read_gguf(spm_gguf))
    ids = tok.encode(MULTIBYTE + " and more", add_special=False)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces).decode().lstrip() == tok.decode(ids)
    assert any(len(p) and not _utf8_whole(p) for p in pieces) or which == "sentencepiece"


def _utf8_whole(raw: bytes) -> bool:
    try:
        raw.decode()
        return True
    except UnicodeDecodeError:
        return False


def test_long_texts_encode_as_short_ones_and_the_length_bound(smollm2_tokenizer):
    from flashdraft.formats.tokenizer import LONG_TEXT, TooManyTokens
    tok = smollm2_tokenizer
    text = "def f(x):\n    return x  # héllo 日本 😀\n" * 3000
    assert len(text) > LONG_TEXT
    ids = tok.encode(text, add_special=False)
    assert ids == tok.backend.encode(text, add_special_tokens=False).ids
    assert tok.encode(text, add_special=False, limit=len(ids)) == ids  # fits exactly: no false rejection
    worst = max(range(tok.vocab_size), key=lambda i: len(tok.token_bytes(i)))
    dense = tok.decode([worst] * 100, skip_special=False)  # as many characters per token as a text can have
    assert len(dense) <= 100 * tok.max_token_chars
    with pytest.raises(TooManyTokens, match="at least"):
        tok.encode(text, limit=len(text) // tok.max_token_chars - 1)
