"""Tokenizer (the `tokenizers` library) from an HF folder or GGUF metadata, chat templates rendered with
jinja2 the way transformers does, and an incremental detokenizer for streaming text deltas."""
from __future__ import annotations

import json
import re
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# GGUF token types (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# Control tokens that end a turn even when the file names another eos (llama.cpp treats them the same way).
END_OF_GENERATION = {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<turn|>",
                     "<|end_of_text|>", "<|return|>", "<|call|>", "<EOT>", "<|END_OF_TURN_TOKEN|>"}


LONG_TEXT = 1 << 16  # characters


class TooManyTokens(ValueError):
    def __init__(self, at_least: int, limit: int):
        super().__init__(f"the text has at least {at_least} tokens, more than the {limit} allowed")
        self.at_least, self.limit = at_least, limit


class Tokenizer:
    def __init__(self, backend: Backend, bos_id: int | None = None, eos_ids: Iterable[int] = (),
                 add_bos: bool = False, add_eos: bool = False, chat_template: str | None = None,
                 special_tokens: Mapping[str, str] | None = None):
        self.backend = backend
        self.bos_id = bos_id
        self.eos_ids: list[int] = _unique(eos_ids)
        self.add_bos = add_bos and bos_id is not None
        self.add_eos = add_eos and bool(self.eos_ids)
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})  # template variables: bos_token, eos_token, ...

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special: bool = True, limit: int | None = None) -> list[int]:
        """Token ids of `text`; TooManyTokens, before any work, when it cannot fit in `limit` tokens."""
        if limit is not None and len(text) > limit * self.max_token_chars:
            raise TooManyTokens(-(-len(text) // self.max_token_chars), limit)
        # encode_batch lets go of the GIL (encode does not), so other threads run while a long text is encoded
        encoded = (self.backend.encode_batch([text], add_special_tokens=False)[0] if len(text) > LONG_TEXT
                   else self.backend.encode(text, add_special_tokens=False))
        ids = encoded.ids
        # BOS/EOS are added here rather than by the backend's post-processor, so that a prompt rendered from a
        # chat template that already starts with BOS does not get a second one.
        if add_special and self.add_bos and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        if add_special and self.add_eos:
            ids.append(self.eos_ids[0])
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (its spelling is at least as long as its text)."""
        vocab = self.backend.get_vocab(with_added_tokens=True)
        return max(map(len, vocab), default=1)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for on its own (a piece of a UTF-8 character stays a piece), as
        llama.cpp's token_to_piece and OpenAI's logprob `bytes`."""
        return _token_bytes(self.backend, token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, documents: list[dict] | None = None, **kwargs) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        # APIs send `content: null` next to tool calls; templates handle a missing key better than None.
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {**self.special_tokens, **kwargs}
        return compile_chat_template(self.chat_template).render(
            messages=messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
            **variables)

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> "Tokenizer":
        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"{folder}: no tokenizer.json (flashdraft reads fast-tokenizer files only)")
        backend = Backend.from_file(str(folder / "tokenizer.json"))
        config = _read_json(folder / "tokenizer_config.json")
        specials = {name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name)))}
        bos_id = backend.token_to_id(specials["bos_token"]) if "bos_token" in specials else None
        generation = _read_json(folder / "generation_config.json")
        eos = generation.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if "eos_token" in specials and (tok_eos := backend.token_to_id(specials["eos_token"])) is not None:
            eos_ids.append(tok_eos)
        # Without an explicit flag, add what the file's post-processor would add.
        probe = backend.encode("", add_special_tokens=True).ids
        add_bos = config.get("add_bos_token")
        add_bos = bool(probe) and probe[0] == bos_id if add_bos is None else bool(add_bos)
        add_eos = config.get("add_eos_token")
        add_eos = bool(probe) and probe[-1] in eos_ids if add_eos is None else bool(add_eos)
        return cls(backend, bos_id, eos_ids, add_bos, add_eos, _hf_chat_template(folder, config), specials)

    @classmethod
    def from_gguf(cls, gguf: Any) -> "Tokenizer":
        """From a GGUFFile (flashdraft.formats.gguf.read_gguf) or its metadata dict."""
        md: Mapping[str, Any] = getattr(gguf, "metadata", gguf)
        kind = md.get("tokenizer.ggml.model")
        tokens: list[str] = md.get("tokenizer.ggml.tokens") or []
        types: list[int] = md.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
        if kind == "gpt2":
            backend = _byte_level_bpe(md, tokens, types)
        elif kind == "llama":
            backend = _sentencepiece_bpe(md, tokens, types)
        elif kind == "gemma4":
            backend = _gemma4_bpe(md, tokens, types)
        else:
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama, gemma4)")
        ids = {name: md.get(f"tokenizer.ggml.{key}_token_id") for name, key in
               (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding"))}
        specials = {name: tokens[i] for name, i in ids.items() if i is not None and 0 <= i < len(tokens)}
        eos_ids = [md.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
        eos_ids += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL and t in END_OF_GENERATION]
        return cls(backend, ids["bos_token"], [i for i in eos_ids if i is not None],
                   add_bos=bool(md.get("tokenizer.ggml.add_bos_token", kind == "llama")),
                   add_eos=bool(md.get("tokenizer.ggml.add_eos_token", False)),
                   chat_template=md.get("tokenizer.chat_template"), special_tokens=specials)


class IncrementalDetokenizer:
    """Turns streamed token ids into text deltas. Text ending inside a UTF-8 sequence is held back until the
    sequence completes, and `push`es followed by `flush()` concatenate to `decode(all ids)`."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = []
        # Decoding restarts at `prefix` (one emitted chunk back, so a SentencePiece leading space decodes the
        # same way both times); text up to `read` has been emitted.
        self.prefix = 0
        self.read = 0

    def push(self, ids: int | Iterable[int]) -> str:
        self.ids.extend([ids] if isinstance(ids, int) else ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """Whatever is still held back (an unfinished UTF-8 sequence decodes to U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix:self.read], self.skip_special)
        text = decode(self.ids[self.prefix:], self.skip_special)
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]


# ------------------------------------------------------------------------------------- chat templates

class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering ignores it."""
    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which templates do not expect
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _hf_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _unique(values: Iterable[int]) -> list[int]:
    out: list[int] = []
    for v in values:
        if v is not None and int(v) not in out:
            out.append(int(v))
    return out


@lru_cache(maxsize=1 << 16)
def _token_bytes(backend: Backend, token_id: int) -> bytes:
    token = backend.id_to_token(token_id)
    if token is None:
        return b""
    if isinstance(backend.decoder, decoders.ByteLevel):
        spelled = unicode_to_bytes()
        if all(c in spelled for c in token):
            return bytes(spelled[c] for c in token)
    elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):  # SentencePiece byte fallback
        return bytes([int(token[3:5], 16)])
    else:
        token = token.replace("\u2581", " ")
    return token.encode("utf-8")


# ------------------------------------------------------------------------------------ GGUF vocabularies

@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used to spell byte-level BPE tokens."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"  # Qwen2's, marks with letters
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split pattern applied before byte-level BPE, as llama.cpp does it
PRE_TOKENIZER_SPLITS = {
    "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT, "smaug-bpe": LLAMA3_SPLIT,
    "dbrx": LLAMA3_SPLIT, "falcon3": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT, "megrez": QWEN2_SPLIT, "qwen35": QWEN35_SPLIT,
    "tekken": TEKKEN_SPLIT,
}
GPT2_PATTERN = {"default", "gpt2", "gpt-2"}  # ByteLevel's own regex
DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "codeshell"}  # every digit split off first (StarCoder family)


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in GPT2_PATTERN:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in PRE_TOKENIZER_SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    known = ", ".join(sorted([*GPT2_PATTERN, *DIGITS_THEN_GPT2, *PRE_TOKENIZER_SPLITS]))
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre; supported: {known})")


def _byte_level_bpe(md: Mapping[str, Any], tokens: list[str], types: list[int]) -> Backend:
    spell = bytes_to_unicode()
    alphabet = set(spell.values())
    # A token outside the byte alphabet is stored as raw text; respell it so BPE can reach it.
    vocab = {t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges") or []]
    pre = md.get("tokenizer.ggml.pre") or "default"
    backend = Backend(models.BPE(vocab, merges, ignore_merges=PRE_TOKENIZER_SPLITS.get(pre) is LLAMA3_SPLIT))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    # Control tokens spelled outside the byte alphabet are llama.cpp mislabels; adding them would grow the vocab.
    _add_special_tokens(backend, tokens, types, lambda t: set(t) <= alphabet)
    return backend


def _sentencepiece_bpe(md: Mapping[str, Any], tokens: list[str], types: list[int]) -> Backend:
    vocab = {t: i for i, t in enumerate(tokens)}
    if md.get("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]]
    else:
        scores = md.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        merges = merges_from_scores(vocab, dict(zip(tokens, scores)))
    backend = Backend(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True))
    space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if space_prefix else "never",
                                                     split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    _add_special_tokens(backend, tokens, types, lambda t: True)
    return backend


def _gemma4_bpe(md: Mapping[str, Any], tokens: list[str], types: list[int]) -> Backend:
    """Gemma 4's vocabulary: BPE with byte fallback over the whole text with spaces spelled "▁" (transformers'
    GemmaTokenizer; llama.cpp's `gemma4` tokenizer model)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges") or []]
    unk = md.get("tokenizer.ggml.unknown_token_id")
    backend = Backend(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True,
                                 unk_token=tokens[unk] if unk is not None else None))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    _add_special_tokens(backend, tokens, types, lambda t: True)
    return backend


def merges_from_scores(vocab: Mapping[str, int], scores: Mapping[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two known tokens,
    best-scoring merged token first (the order transformers derives them in)."""
    merges = []
    for token, score in scores.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(backend: Backend, tokens: list[str], types: list[int], usable) -> None:
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
               if ty == CONTROL and usable(t)]
    # user-defined tokens (like `<think>`) are matched whole in text but are not special
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
            if ty == USER_DEFINED and backend.token_to_id(t) is not None]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)
