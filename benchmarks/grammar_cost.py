"""What a grammar constraint costs per token, llguidance (what flashdraft uses) beside xgrammar, and what it does to
DFlash's acceptance length. Prints tables; writes JSON with --out.

  python benchmarks/grammar_cost.py [--models smollm2-135m,PATH.gguf] [--acceptance] [--out FILE]

Mask cost: each library's matcher follows a valid answer token by token (tokenized by the model's own tokenizer)
and computes the allowed-token bitmask before every token, as the engine does for each verified row; the table
gives the tokenizer's one-time preparation, the schema's set-up and the mean / 95th percentile / max mask time. xgrammar is only measured here
(`pip install xgrammar`). --acceptance: SmolLM2 with its shipped draft on the guide's three prompts, the answer
unconstrained and constrained to a JSON object with the same request, acceptance length and speed.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}},
                                           "address": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "zip": {"type": "string"}},
                                                       "required": ["city"]}},
          "required": ["name", "age", "tags", "address"]}
ANSWER = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["mathematician", "writer", "analyst"],
                     "address": {"city": "London", "zip": "W1"}}, indent=2)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def llguidance_cost(tokenizer, ids: list[int]) -> dict:
    from flashdraft.engine.grammar import Constraint, Grammar, _ll_tokenizer
    t0 = time.perf_counter()
    _ll_tokenizer(tokenizer)  # once per tokenizer (cached by the engine)
    t1 = time.perf_counter()
    constraint = Constraint(tokenizer, Grammar("json_schema", json.dumps(SCHEMA)), tokenizer.vocab_size)
    setup = time.perf_counter() - t1
    times = []
    for token in ids:
        t = time.perf_counter()
        bits = constraint._bits()
        times.append(time.perf_counter() - t)
        assert (int(bits[token // 32]) >> (token % 32)) & 1, "the answer left the grammar"
        constraint.commit([token])
    return dict(tokenizer_ms=1e3 * (t1 - t0), setup_ms=1e3 * setup, times=times)


def xgrammar_cost(tokenizer, ids: list[int]) -> dict:
    import xgrammar as xgr
    vocab = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=tokenizer.vocab_size,
                             stop_token_ids=list(tokenizer.eos_ids))
    compiler = xgr.GrammarCompiler(info)
    t1 = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))
    setup = time.perf_counter() - t1
    bitmask = xgr.allocate_token_bitmask(1, tokenizer.vocab_size)
    times = []
    for token in ids:
        t = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - t)
        assert (int(bitmask[0, token // 32]) >> (token % 32)) & 1, "the answer left the grammar"
        assert matcher.accept_token(token), "the answer left the grammar"
    return dict(tokenizer_ms=1e3 * (t1 - t0), setup_ms=1e3 * setup, times=times)


def acceptance(out: dict) -> None:
    from flashdraft.bench.prompts import SEED_PROMPTS
    from flashdraft.engine.engine import Engine, EngineConfig, Request
    from flashdraft.engine.grammar import Grammar
    from flashdraft.engine.sampling import SamplingParams
    from flashdraft.formats.chat import chat_ids
    from flashdraft.formats.named import default_draft, resolve_model
    model = resolve_model("smollm2-135m")
    engine = Engine.load(EngineConfig(str(model), draft=str(default_draft(model)), device="cpu", ctx_size=2048,
                                      adaptive=False))
    rows = []
    for prompt in SEED_PROMPTS:
        text = prompt + " Answer with a JSON object whose keys are file names and whose values are their contents."
        ids = chat_ids(engine.tokenizer, [{"role": "user", "content": text}])
        for label, grammar in (("none", None), ("json_object", Grammar("json_schema", '{"type": "object"}'))):
            t = time.perf_counter()
            c = engine.generate(Request(ids, SamplingParams(max_tokens=256), grammar=grammar, cache_prompt=False))
            s = c.speculative_summary()
            rows.append(dict(constraint=label, tokens=len(c.token_ids), seconds=time.perf_counter() - t,
                             acceptance_length=s["mean_acceptance_length"]))
            print(f"{label:12s} {len(c.token_ids)} tokens, acceptance length {s['mean_acceptance_length']:.2f}, "
                  f"{len(c.token_ids) / rows[-1]['seconds']:.1f} tok/s", flush=True)
    out["acceptance"] = rows
    print("\n| constraint | mean acceptance length | tok/s |\n|---|---|---|")
    for label in ("none", "json_object"):
        mine = [r for r in rows if r["constraint"] == label]
        print(f"| {label} | {statistics.mean(r['acceptance_length'] for r in mine):.2f} | "
              f"{sum(r['tokens'] for r in mine) / sum(r['seconds'] for r in mine):.1f} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m")
    ap.add_argument("--acceptance", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    from flashdraft.formats.gguf import read_gguf
    from flashdraft.formats.named import resolve_model
    from flashdraft.formats.tokenizer import Tokenizer
    out: dict = dict(date=time.strftime("%Y-%m-%d"), schema=SCHEMA, rows=[])
    for name in args.models.split(","):
        tokenizer = Tokenizer.from_gguf(read_gguf(str(resolve_model(name))))
        ids = tokenizer.encode(ANSWER, add_special=False)
        for library, fn in (("llguidance", llguidance_cost), ("xgrammar", xgrammar_cost)):
            try:
                r = fn(tokenizer, ids)
            except ImportError:
                print(f"{library}: not installed", flush=True)
                continue
            us = [1e6 * t for t in r["times"]]
            row = dict(model=Path(name).name, vocab=tokenizer.vocab_size, library=library, tokens=len(ids),
                       tokenizer_ms=r["tokenizer_ms"], setup_ms=r["setup_ms"], mean_us=statistics.mean(us),
                       p95_us=percentile(us, 0.95), max_us=max(us))
            out["rows"].append(row)
            print(f"{row['model']} ({row['vocab']}) {library}: tokenizer {row['tokenizer_ms']:.0f} ms, grammar "
                  f"{row['setup_ms']:.1f} ms, mask "
                  f"{row['mean_us']:.0f} us mean, {row['p95_us']:.0f} p95, {row['max_us']:.0f} max", flush=True)
    print("\n| model (vocabulary) | library | tokenizer ms (once) | grammar ms | mask us mean | p95 | max |\n"
          "|---|---|---|---|---|---|---|")
    for r in out["rows"]:
        print(f"| {r['model']} ({r['vocab']}) | {r['library']} | {r['tokenizer_ms']:.0f} | {r['setup_ms']:.1f} | "
              f"{r['mean_us']:.0f} | {r['p95_us']:.0f} | {r['max_us']:.0f} |")
    if args.acceptance:
        acceptance(out)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
