"""Constrained decoding (JSON schemas, Lark and GBNF grammars) with llguidance, kept lossless under speculation.

The matcher follows the committed tokens. For a verify block it walks the drafted tokens too: row i's mask is the
grammar's state after the committed tokens and the first i drafted ones, so each verified row is sampled from the
target's distribution under the constraint, exactly as a plain step would; a drafted token the grammar forbids is
masked out of its row and so rejected like any mismatch. The walk is rolled back before the accepted tokens are
committed. The draft itself proposes freely.

Why llguidance (measured with benchmarks/grammar_cost.py, docs/PERF.md): xgrammar computes one mask faster (9-13 us
mean against 36-41 us on SmolLM2's and Qwen2.5's vocabularies), but compiles each request's schema 5-16x slower
(6-21 ms against 1.2-1.3 ms), so for answers under several hundred tokens llguidance costs less per request and
its first token is not delayed; both stay a few percent of a verify step. llguidance also reads the tokenizer's
own definition (special tokens never match text) and has no dependencies.
"""
import threading
from dataclasses import dataclass, field

import torch
from torch import Tensor

KINDS = ("json_schema", "lark", "gbnf")


@dataclass(frozen=True)
class Grammar:
    """What a request constrains its output to: a JSON schema (as JSON text), a Lark grammar (llguidance's dialect,
    which can embed `%json {...}` schemas) or a GBNF grammar (llama.cpp's)."""
    kind: str
    text: str
    compact: bool = False  # a JSON schema's output without whitespace between tokens (machine-read JSON)
    # the matcher check() compiled, taken by the request's Constraint so that the grammar is compiled once
    compiled: list = field(default_factory=list, compare=False, hash=False, repr=False)

    def __getstate__(self) -> dict:
        """Pickled (a request shared with tensor-parallel ranks) without the compiled matcher, which does not pickle:
        each rank compiles its own."""
        return {**self.__dict__, "compiled": []}


class _TextTokenizer:
    """The tokenizer as llguidance's TokenizerWrapper reads it: each token's bytes and which tokens are special
    (from llguidance's own reading of the tokenizer's definition) and an encoder that reads special-token text as
    text. llguidance tokenizes the bytes a grammar forces (a literal, a schema's `const`) with it: the tokenizer
    itself would turn `<|im_end|>` in a literal into the end-of-turn token, so that the grammar made the model
    end its answer there instead of writing the text."""

    def __init__(self, tokenizer, spelled):
        from tokenizers import Tokenizer as Backend
        n = tokenizer.vocab_size
        self.tokens = [spelled.decode_bytes([i]) for i in range(n)]
        self.special_token_ids = [i for i in range(n) if spelled.is_special_token(i)]
        self.eos_token_id = tokenizer.eos_ids[0] if tokenizer.eos_ids else spelled.eos_token
        self.bos_token_id = tokenizer.bos_id
        self.backend = Backend.from_str(tokenizer.backend.to_str())  # a copy: the prompt's encoder is unchanged
        self.backend.encode_special_tokens = True

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # TokenizerWrapper then passes text, never bytes
            raise TypeError("text only")
        return self.backend.encode(text, add_special_tokens=False).ids


def _ll_tokenizer(tokenizer):
    """The llguidance view of a tokenizer (made once per tokenizer: about a second for a large vocabulary)."""
    cached = getattr(tokenizer, "_llguidance", None)
    if cached is None:
        import llguidance
        eos = list(tokenizer.eos_ids) or None
        spelled = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size, eos_token=eos)
        cached = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TextTokenizer(tokenizer, spelled)),
                                        n_vocab=tokenizer.vocab_size, eos_token=eos)
        tokenizer._llguidance = cached
    return cached


# Whitespace between JSON tokens as llama.cpp's schema grammars allow it (up to two newlines and 20 spaces or tabs):
# unbounded whitespace lets a weak model pad forever instead of closing the object.
JSON_WHITESPACE = r"(\n{1,2}[ \t]{0,20}| )?"


def _resolve(g, rules: dict) -> None:
    """llguidance's gbnf_to_lark.resolve, except that which rules are terminals (rules whose every reference
    is to a terminal rule) is found by propagation, in time linear in the grammar: llguidance rescans every rule
    until nothing changes, quadratic in a chain of rules (8 s for 3k rules, 62 KB of GBNF, on one CPU core)."""
    import re

    def rename(r, name: str) -> None:
        if name in rules:
            raise Exception(f"Rule '{name}' already exists")
        del rules[r.name]
        r.name = name
        rules[name] = r

    for i, r in enumerate(rules.values()):
        r.order = i
        r.alternatives = r.alternatives.simplify()
    refs: dict[str, list] = {}  # rule name -> the rules it refers to
    for r in rules.values():
        stack, found = list(r.children()), []
        while stack:
            node = stack.pop()
            if isinstance(node, g.RuleRefNode):
                if node.name not in rules:
                    raise Exception(f"Rule '{node.name}' not found")
                node.target = rules[node.name]
                found.append(node.target)
            stack.extend(node.children())
        refs[r.name] = found
    if "root" not in rules:
        raise Exception("No 'root' rule found")
    start = rules["root"]
    waiting = {id(r): len(refs[r.name]) for r in rules.values()}
    users: dict[int, list] = {}
    for r in rules.values():
        for target in refs[r.name]:
            users.setdefault(id(target), []).append(r)
    ready = [r for r in rules.values() if waiting[id(r)] == 0 and r is not start]
    while ready:
        r = ready.pop()
        if r.rule_is_terminal:
            continue
        r.rule_is_terminal = True
        for user in users.get(id(r), []):
            waiting[id(user)] -= 1
            if waiting[id(user)] == 0 and user is not start:
                ready.append(user)
    rename(start, "start")
    for r in list(rules.values()):
        new_name = re.sub(r"([a-z])([A-Z])", r"\1_\2", r.name.replace("-", "_")).lower()
        new_name = new_name.upper() if r.rule_is_terminal else new_name.lower()
        if r.name != new_name:
            rename(r, new_name)


def gbnf_to_lark(text: str) -> str:
    """llguidance's GBNF-to-Lark conversion, except that a repetition of a repetition keeps its parentheses:
    llguidance writes `("a"{1,3}){2}` as `"a"{1,3}{2,2}`, which its Lark parser rejects; and that resolving the
    rules takes linear time (_resolve)."""
    from llguidance import gbnf_to_lark as g

    class Group(g.ASTNode):
        def __init__(self, node: g.ASTNode):
            self.node = node

        def __str__(self) -> str:
            return f"({self.node})"

        def children(self) -> list:
            return [self.node]

    def fix(node) -> None:
        for child in node.children():
            fix(child)
        if isinstance(node, g.RepetitionNode) and isinstance(node.node, g.RepetitionNode):
            node.node = Group(node.node)

    rules = g.GrammarParser().parse(text)
    _resolve(g, rules)
    out, newline = "%llguidance {}\n\n", True
    for rule in sorted(rules.values(), key=lambda r: r.order):  # as llguidance prints them
        fix(rule.alternatives)
        line = str(rule)
        if not newline and "\n" in line:
            out += "\n"
        out += line + "\n"
        newline = "\n" in line
        if newline:
            out += "\n"
    return out


def lark_source(grammar: Grammar) -> str:
    import llguidance
    if grammar.kind == "json_schema":
        options = {"whitespace_flexible": False} if grammar.compact else {"whitespace_pattern": JSON_WHITESPACE}
        return llguidance.LLMatcher.grammar_from_json_schema(grammar.text, overrides=options)
    if grammar.kind == "gbnf":
        return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(grammar.text))
    return llguidance.LLMatcher.grammar_from_lark(grammar.text)


def _pointer(root, ref: str):
    """The node a local JSON pointer (`#`, `#/$defs/a`, `#/properties/a~1b/items`) names in `root`, or None."""
    from urllib.parse import unquote
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def unmatchable(schema) -> str | None:
    """Why no JSON value can match `schema`, or None when one may. llguidance finds a property or an intersection
    that nothing matches, but not what comes from references: a `$ref` cycle with nothing else in it, or a
    recursive object whose every instance needs another one, compiles into a grammar that allows no output at all,
    or none that ever ends.

    The schema becomes an and/or graph (a `$ref`, an `allOf`, the required properties of an object, the first
    `minItems` items of an array must each be matchable; an `anyOf`/`oneOf` needs one branch; `false` never is)
    and the matchable nodes are found bottom-up as for a context-free grammar's productive symbols: linear in the
    schema's size, cycles included. Only what certainly matches nothing is reported; keywords not read here
    (types, bounds, `not`, ...) count as matchable."""
    nodes: dict[int, int] = {}  # id(schema object) -> its node
    kinds: list[str] = []  # "and" / "or"
    children: list[list[int]] = []
    todo: list[tuple[int, dict]] = []  # nodes whose children are still to be read (no recursion: refs chain deep)

    def new(kind: str, parts: list[int] | None = None) -> int:
        kinds.append(kind)
        children.append(parts or [])
        return len(kinds) - 1

    def node(value) -> int:
        if value is False:
            return new("or")  # an "or" of nothing: never matchable
        if not isinstance(value, dict):
            return new("and")
        if id(value) not in nodes:
            nodes[id(value)] = new("and")
            todo.append((nodes[id(value)], value))
        return nodes[id(value)]

    def listed(value: dict, key: str) -> list:
        return value[key] if isinstance(value.get(key), list) else []

    root = node(schema)
    while todo:
        index, value = todo.pop()
        parts = []
        ref = value.get("$ref")
        target = _pointer(schema, ref) if isinstance(ref, str) else None
        if target is not None:
            parts.append(node(target))
        parts += [node(sub) for sub in listed(value, "allOf")]
        for key in ("anyOf", "oneOf"):
            if listed(value, key):
                parts.append(new("or", [node(sub) for sub in listed(value, key)]))
        kind = value.get("type")
        if kind in ("object", ["object"]) and isinstance(value.get("properties"), dict):
            properties = value["properties"]
            parts += [node(properties[name]) for name in listed(value, "required")
                      if isinstance(name, str) and name in properties]
        if kind in ("array", ["array"]):
            least, prefix, items = value.get("minItems"), listed(value, "prefixItems"), value.get("items")
            if isinstance(items, list):  # the older tuple form
                prefix, items = items, value.get("additionalItems")
            if isinstance(least, int) and not isinstance(least, bool) and least > 0:
                parts += [node(sub) for sub in prefix[:least]]
                if least > len(prefix) and isinstance(items, dict | bool):
                    parts.append(node(items))
        children[index] = parts
    # bottom-up: an "and" is matchable once all its children are, an "or" once one is
    waiting = [len(c) if k == "and" else min(len(c), 1) for k, c in zip(kinds, children)]
    parents: list[list[int]] = [[] for _ in kinds]
    for i, c in enumerate(children):
        for child in c:
            parents[child].append(i)
    matchable = [False] * len(kinds)
    ready = [i for i, (k, w) in enumerate(zip(kinds, waiting)) if k == "and" and w == 0]
    while ready:
        i = ready.pop()
        if matchable[i]:
            continue
        matchable[i] = True
        for p in parents[i]:
            if not matchable[p]:
                waiting[p] -= 1
                if waiting[p] <= 0:
                    ready.append(p)
    if matchable[root]:
        return None
    return "no JSON value matches this schema (a $ref cycle with nothing else in it, or a required property or item " \
           "that nothing matches)"


# llguidance's compiler recurses once per level of a grammar's rules (a chain of GBNF rules, of schema `$ref`s): at
# the grammar budget's size (about 4k levels) that overflows a thread's usual 8 MiB stack and kills the process
# (a segmentation fault, no Python exception). Compiling runs in a thread with a stack of this size; the memory is
# only reserved, pages are taken as the recursion reaches them (a compiled matcher is then used and freed on any
# thread: it does not recurse so).
COMPILE_STACK = 512 << 20
_stack_lock = threading.Lock()


def _on_big_stack(fn, *args):
    """fn(*args) in a thread of COMPILE_STACK bytes of stack; its exception is raised here."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001  (raised again in the caller's thread)
            out["error"] = e

    with _stack_lock:  # the size applies to the threads started while it is set
        previous = threading.stack_size(COMPILE_STACK)
        try:
            thread = threading.Thread(target=run, name="grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def compile_matcher(tokenizer, source: str, first_mask: bool = False):
    """llguidance's matcher of a grammar source (lark_source), compiled on a big stack; `first_mask`: its first
    token's set computed too (some grammars are found to match nothing only then)."""
    import llguidance

    def compile_():
        matcher = llguidance.LLMatcher(_ll_tokenizer(tokenizer), source, log_level=0)
        if first_mask and not matcher.is_error():
            matcher.compute_bitmask()
        return matcher
    return _on_big_stack(compile_)


def check(tokenizer, grammar: Grammar) -> None:
    """Raise ValueError naming what is wrong with a grammar (before a request takes a slot)."""
    if grammar.kind not in KINDS:
        raise ValueError(f"unknown grammar kind {grammar.kind!r} (kinds: {', '.join(KINDS)})")
    try:
        source = lark_source(grammar)
    except Exception as e:  # gbnf_to_lark's own errors
        raise ValueError(f"invalid {grammar.kind}: {e}") from None
    if grammar.kind == "json_schema":
        import json
        why = unmatchable(json.loads(grammar.text))
        if why:
            raise ValueError(why)
    matcher = compile_matcher(tokenizer, source, first_mask=True)
    if matcher.is_error():
        raise ValueError(f"invalid {grammar.kind}: {matcher.get_error()}")
    if matcher.is_stopped() and not matcher.is_accepting():
        raise ValueError(f"no output matches this {grammar.kind}")
    grammar.compiled[:] = [matcher]  # for Constraint: compiled once per request


def pack(allowed: Tensor) -> Tensor:
    """bool [32 * words] -> int32 bitmask [words] (unpack's inverse)."""
    words = (allowed.view(-1, 32).long() << torch.arange(32)).sum(1)
    return (words - (words >> 31 << 32)).to(torch.int32)  # the top bit as int32's sign


def unpack(bits: Tensor) -> Tensor:
    """int32 bitmasks [k, words] -> bool [k, 32 * words]."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits[:, :, None] >> shifts) & 1).bool().flatten(1)


class Constraint:
    """One request's grammar state over the model's vocabulary of `n_logits` rows (padding rows are never
    allowed). Once the grammar is complete only the end-of-generation tokens are allowed."""

    def __init__(self, tokenizer, grammar: Grammar, n_logits: int):
        try:
            self.matcher = grammar.compiled.pop()  # check() compiled it (a fresh matcher, used once)
        except IndexError:
            self.matcher = compile_matcher(tokenizer, lark_source(grammar))
        if self.matcher.is_error():
            raise ValueError(f"invalid {grammar.kind}: {self.matcher.get_error()}")
        self.n_logits = n_logits
        self.words = (n_logits + 31) // 32
        eos = torch.zeros(self.words * 32, dtype=torch.bool)
        eos[list(tokenizer.eos_ids)] = True
        self.eos_bits = pack(eos)

    def _bits(self) -> Tensor:
        """The next token's allowed set as llguidance's bitmask [words] int32 (bit t % 32 of word t // 32)."""
        if self.matcher.is_stopped() or self.matcher.is_error():
            return self.eos_bits
        bits = torch.empty(self.words, dtype=torch.int32)
        self.matcher.unsafe_compute_mask_ptr(bits.data_ptr(), 4 * self.words)
        return bits

    def bitmasks(self, drafted: list[int]) -> Tensor:
        """[len(drafted) + 1, words]: row i allowed after the committed tokens and drafted[:i]. Rows past a drafted
        token the grammar forbids allow everything: that token is rejected, they are never used."""
        rows = [self._bits()]
        walked = 0
        for token in drafted:
            allowed = token < self.n_logits and (int(rows[-1][token // 32]) >> (token % 32)) & 1
            if not allowed or not self.matcher.consume_token(token):
                break
            walked += 1
            rows.append(self._bits())
        if walked:
            self.matcher.rollback(walked)
        rows += [torch.full((self.words,), -1, dtype=torch.int32)] * (len(drafted) + 1 - len(rows))
        return torch.stack(rows)

    def masks(self, drafted: list[int]) -> Tensor:
        """bitmasks() as bool rows [len(drafted) + 1, n_logits]."""
        return unpack(self.bitmasks(drafted))[:, :self.n_logits]

    def apply(self, logits: Tensor, drafted: list[int]) -> Tensor:
        """logits [k, V] with the forbidden tokens of each row at -inf (the bits unpacked on the logits' device)."""
        allowed = unpack(self.bitmasks(drafted).to(logits.device, non_blocking=True))[:, :logits.shape[-1]]
        return logits.masked_fill(~allowed, float("-inf"))

    def commit(self, tokens: list[int]) -> None:
        for token in tokens:
            if self.matcher.is_stopped():
                return
            self.matcher.consume_token(token)

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()
