"""What the request budgets (flashdraft/server/budgets.py) allow at most costs on a real vocabulary: each field
filled to its limit in the shapes that cost the most, prepared with the server's own functions (the output
constraint checked and compiled as request_grammar does, its first token mask, the stop-string automaton, the
logit_bias map, the budget check that refuses a body over a limit), timed on this machine. Prints a Markdown table
per tokenizer; each figure must stay well under the preparation deadline (budgets.PREPARE_SECONDS).

  python benchmarks/request_budgets.py [--models smollm2-135m,PATH.gguf] [--repeat 3]

The time of a step is the median of --repeat runs (max in brackets); the first llguidance tokenizer of a vocabulary
is made once per server and reported apart.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashdraft.server import budgets as B  # noqa: E402


def fill(make, limit: int, measure=None) -> tuple[object, int]:
    """The largest n (doubling, then bisecting) whose make(n) stays within `limit` characters (as JSON text for
    objects, or as `measure` tells): (make(n), its size)."""
    def size(n: int) -> int:
        value = make(n)
        if measure is not None:
            return measure(value)
        return len(value) if isinstance(value, str) else len(json.dumps(value))
    lo, hi = 1, 2
    while size(hi) <= limit:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid) <= limit else (lo, mid)
    return make(lo), size(lo)


def gbnf_alternatives(n: int) -> str:
    return "root ::= " + " | ".join(f'"w{i}"' for i in range(n))


def gbnf_rules(n: int) -> str:  # a chain of rules, each with a character class repetition and a literal
    return "root ::= r0\n" + "\n".join(f'r{i} ::= [a-z]{{1,4}} "k{i}" (r{i + 1})?' for i in range(n)) + \
        f'\nr{n} ::= "end"'


def gbnf_nested(n: int) -> str:  # one expression nested n deep
    return "root ::= " + "(" * n + '"a"' + ")" * n


def schema_properties(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)},
            "required": [f"p{i}" for i in range(n)], "additionalProperties": False}


def schema_nested(n: int) -> dict:  # objects 60 deep (llguidance reads at most 128 levels of JSON), n of them
    node: dict = {"type": "integer"}
    for i in range(60):
        node = {"type": "object", "properties": {"x": node}, "required": ["x"]}
    return {"type": "object", "properties": {f"q{i}": node for i in range(n)}}


def schema_any_of(n: int) -> dict:
    return {"anyOf": [{"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]}
                      for i in range(n)]}


def schema_enum(n: int) -> dict:
    return {"type": "object", "properties": {"v": {"enum": [f"value number {i}" for i in range(n)]}}}


def schema_patterns(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{2,9}}-{i}(x|yz)*$"}
                                             for i in range(n)}, "required": ["p0"]}


def schema_refs(n: int) -> dict:  # a chain of definitions, the last recursive
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "integer"}]} for i in range(n)}
    defs[f"d{n}"] = {"type": "array", "items": {"$ref": "#/$defs/d0"}, "maxItems": 2}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def tool(i: int, n_properties: int) -> dict:
    return {"type": "function", "function": {"name": f"tool_{i}", "parameters": {
        "type": "object", "properties": {f"arg{j}": {"type": "string"} for j in range(n_properties)},
        "required": [f"arg{j}" for j in range(n_properties)]}}}


def call_schema_size(choice_grammar, tools: list) -> int:
    try:
        return len(choice_grammar(tools, "required", True).text)
    except ValueError:  # over the schema budget
        return 1 << 62


def timed(fn, repeat: int) -> tuple[float, float, object]:
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), max(times), out


def run(name: str, repeat: int, rows: list) -> None:
    """Appends (field, size, step, median s, max s) rows to `rows` as they are measured."""
    from flashdraft.engine.engine import StopStrings
    from flashdraft.engine.grammar import Constraint, _ll_tokenizer
    from flashdraft.formats.gguf import read_gguf
    from flashdraft.formats.named import resolve_model
    from flashdraft.formats.tokenizer import Tokenizer
    from flashdraft.server import protocol as P
    from flashdraft.server.structured import request_grammar
    from flashdraft.server.tools import choice_grammar, tool_plan

    tokenizer = Tokenizer.from_gguf(read_gguf(str(resolve_model(name))))
    vocab = tokenizer.vocab_size
    t = time.perf_counter()
    _ll_tokenizer(tokenizer)
    rows.append(("llguidance tokenizer (once per server)", f"{vocab:,} tokens", "", time.perf_counter() - t, 0.0))

    def constraint_rows(label: str, body: dict, size: int) -> None:
        def prepare():
            try:
                grammar = request_grammar(tokenizer, body)
            except P.ApiError as e:
                return e.message
            t = time.perf_counter()
            Constraint(tokenizer, grammar, vocab)._bits()  # the slot's first mask
            return time.perf_counter() - t
        median, worst, first_mask = timed(prepare, repeat)
        if isinstance(first_mask, str):
            rows.append((label, f"{size:,} chars", f"refused: {first_mask[:60]}", median, worst))
            return
        rows.append((label, f"{size:,} chars", "checked, compiled, first mask", median, worst))
        rows.append(("", "", "of which the first mask", first_mask, 0.0))

    for label, make in (("GBNF, alternatives", gbnf_alternatives), ("GBNF, chained rules", gbnf_rules),
                        ("GBNF, nested groups", gbnf_nested)):
        text, size = fill(make, B.GRAMMAR_CHARS)
        if label.endswith("nested groups"):
            text, size = gbnf_nested(120), len(gbnf_nested(120))  # deeper: the parser's own recursion limit
        constraint_rows(label, {"grammar": text}, size)
    for label, make in (("JSON schema, required properties", schema_properties),
                        ("JSON schema, objects 60 deep", schema_nested), ("JSON schema, anyOf", schema_any_of),
                        ("JSON schema, enum", schema_enum), ("JSON schema, patterns", schema_patterns),
                        ("JSON schema, chain of $refs", schema_refs)):
        schema, size = fill(make, B.SCHEMA_CHARS)
        constraint_rows(label, {"json_schema": schema}, size)

    # tool_choice "required": the call schema of every tool, at the schema budget
    template = "{% if tools %}{{ tools }}{% endif %}<tool_call>"
    tools, size = fill(lambda n: [tool(i, n) for i in range(B.TOOLS_COUNT)], B.SCHEMA_CHARS,
                       lambda tools: call_schema_size(choice_grammar, tools))
    body = {"tools": tools, "tool_choice": "required"}
    median, worst, plan = timed(lambda: tool_plan(template, body), repeat)
    rows.append((f"tools, {len(tools)} under tool_choice required", f"call schema {size:,} chars", "checked",
                 median, worst))
    median, worst, _ = timed(lambda: request_grammar(tokenizer, {}, tool_plan(template, body).grammar), repeat)
    rows.append(("", "", "call schema compiled, checked", median, worst))

    stops = [f"stop string {i} " + "x" * (B.STOP_CHARS // B.STOP_COUNT - 20) for i in range(B.STOP_COUNT)]
    median, worst, matcher = timed(lambda: StopStrings(stops), repeat)
    rows.append((f"stop, {len(stops)} strings", f"{sum(map(len, stops)):,} chars", "automaton built", median, worst))
    piece = "some generated text "
    t = time.perf_counter()
    for _ in range(1000):
        matcher.push(piece)
    rows.append(("", "", "per token of text (1000 tokens)", (time.perf_counter() - t) / 1000, 0.0))

    ids = {str(i): -1.0 for i in range(min(vocab, B.LOGIT_BIAS_ENTRIES))}
    median, worst, _ = timed(lambda: P.logit_bias({"logit_bias": ids}, tokenizer, vocab), repeat)
    rows.append(("logit_bias, every token id", f"{len(ids):,} entries", "read and checked", median, worst))
    words = "the quick brown fox jumps over the lazy dog "
    text_key = (words * (B.LOGIT_BIAS_TEXT_CHARS // len(words) + 1))[:B.LOGIT_BIAS_TEXT_CHARS]
    pairs = [[text_key[i:] + text_key[:i], 1.0] for i in range(B.LOGIT_BIAS_TEXTS_CHARS // B.LOGIT_BIAS_TEXT_CHARS)]
    median, worst, _ = timed(lambda: P.logit_bias({"logit_bias": pairs}, tokenizer, vocab), repeat)
    rows.append(("logit_bias, text keys", f"{len(pairs)} x {B.LOGIT_BIAS_TEXT_CHARS:,} chars", "tokenized",
                 median, worst))

    over = {"grammar": gbnf_alternatives(500_000), "stop": stops * 6,
            "response_format": {"type": "json_schema", "json_schema": {"schema": schema_properties(100_000)}}}
    for field in over:
        body = {field: over[field]}

        def refuse():
            try:
                B.check_budgets(body)
            except P.ApiError:
                return
            raise AssertionError(f"{field} over its budget was not refused")
        median, worst, _ = timed(refuse, repeat)
        size = len(json.dumps(over[field]))
        rows.append((f"{field} over its budget", f"{size:,} chars", "refused (400)", median, worst))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"budgets: grammar {B.GRAMMAR_CHARS:,} chars, schema {B.SCHEMA_CHARS:,}, stop {B.STOP_COUNT} strings / "
          f"{B.STOP_CHARS:,} chars, logit_bias {B.LOGIT_BIAS_ENTRIES:,} entries / text keys "
          f"{B.LOGIT_BIAS_TEXTS_CHARS:,} chars; deadline {B.PREPARE_SECONDS:g} s; median of {args.repeat} [max]\n")
    worst_all = 0.0
    for name in args.models.split(","):
        print(f"### {Path(name).name}\n")
        print("| field at its limit | size | step | ms |")
        print("| --- | --- | --- | --- |", flush=True)

        class Printed(list):
            def append(self, row) -> None:
                nonlocal worst_all
                field, size, step, median, worst = row
                ms = f"{1e3 * median:.3f}" if median < 0.001 else f"{1e3 * median:.1f}"
                print(f"| {field} | {size} | {step} | {ms}" + (f" [{1e3 * worst:.1f}]" if worst else "") + " |",
                      flush=True)
                if not field.startswith("llguidance tokenizer"):
                    worst_all = max(worst_all, worst, median)
        run(name, args.repeat, Printed())
        print(flush=True)
    print(f"slowest step: {worst_all:.2f} s = {worst_all / B.PREPARE_SECONDS:.1%} of the deadline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
