"""What a quantized KV cache costs in quality: the next-token distribution with each K/V type pair against the
f16 cache, on real text, as mean KL divergence (and its median and 99th percentile over the scored positions: the
mean of 4-bit keys can be a few rare positions', docs/perf-history.md, 2026-12-05 CPU) and top-1 agreement. Prints
a table; writes JSON with --out.

  python benchmarks/kv_quality.py [-m smollm2-135m] [--tokens 2048] [--texts 4] [--types q8_0/q8_0,q4_1/q4_1]
      [--llama-perplexity BUILD/bin/llama-perplexity]

With --llama-perplexity, llama.cpp's `llama-perplexity --kl-divergence` runs on the same GGUF file and the same
texts (joined into one file) with each type pair against its own f16 run, and its mean KLD and same-top-token rate
stand beside ours. Its protocol is its own: chunks of --ctx tokens from a fresh cache, the second half of each
chunk scored; ours scores every position of each context.

Text: HumanEval prompts with their canonical solutions and MT-Bench questions (../shared/data), joined until each
context holds --tokens tokens. Every context runs through the cache in chunks of 32 positions (each chunk's K/V
are written into the cache first and read back from it, as llama.cpp's batches do), so the stored types shape
every attention read.
"""
import argparse
import gzip
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from flashdraft.formats.loader import load_target
from flashdraft.formats.named import resolve_model

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
CHUNK = 32
POSITION_RANGES = ((0, 32), (32, 256), (256, 512), (512, 1 << 20))  # mean KL by where the token sits
DEFAULT_TYPES = "f16/f16,q8_0/q8_0,q5_0/q4_1,q5_1/q5_1,q4_1/q4_1,q4_0/q4_0"


def texts(n: int, items: int = 10) -> list[str]:
    with gzip.open(DATA / "HumanEval.jsonl.gz", "rt") as f:
        code = [json.loads(line) for line in f]
    chats = [json.loads(line) for line in (DATA / "mt_bench_question.jsonl").read_text().splitlines()]
    out = []
    for i in range(n):
        pool = code if i % 2 == 0 else chats
        start = (i * items) % len(pool)  # MT-Bench has 80 questions: long contexts wrap around
        source = (pool + pool)[start:start + items]
        out.append("\n\n".join(p["prompt"] + p["canonical_solution"] if "prompt" in p else "\n".join(p["turns"])
                               for p in source))
    return out


@torch.inference_mode()
def log_probs(target, ids: torch.Tensor, types: tuple[str, str]) -> torch.Tensor:
    state = target.new_state(1, len(ids) + CHUNK, types)
    rows = []
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start:start + CHUNK]
        positions = torch.arange(start, start + len(chunk))
        logits, _ = target(chunk[None], positions[None], state, 0, attn_len=start + len(chunk))
        rows.append(logits[0].float().log_softmax(-1))
    return torch.cat(rows)


def llama_cpp_kl(binary: str, model: str, text: str, pairs: list[tuple[str, str]], ctx: int) -> dict:
    """(K, V) -> (mean KLD, same top token, median KLD, 99th percentile KLD) from llama-perplexity against its run
    with pairs[0]."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        corpus, base = Path(tmp) / "text.txt", Path(tmp) / "base.kld"
        corpus.write_text(text)
        common = [binary, "-m", model, "-f", str(corpus), "-c", str(ctx), "-b", str(ctx), "-fa", "on", "-t", "2",
                  "--kl-divergence-base", str(base)]
        for i, (k, v) in enumerate(pairs):
            if {k, v} & {"turbo3", "turbo4"}:  # this project's rotated types: llama.cpp has none
                continue
            cmd = common + ["-ctk", k, "-ctv", v] + ([] if i == 0 else ["--kl-divergence"])
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"llama-perplexity failed for {k}/{v}: {proc.stderr[-2000:]}")
            if i:
                log = proc.stdout + proc.stderr
                kld = float(re.search(r"Mean\s+KLD:\s+([-\d.e]+)", log).group(1))
                same = float(re.search(r"Same top p:\s+([\d.]+)", log).group(1)) / 100
                median = float(re.search(r"Median\s+KLD:\s+([-\d.e]+)", log).group(1))
                p99 = float(re.search(r"99\.0%\s+KLD:\s+([-\d.e]+)", log).group(1))
                out[(k, v)] = (kld, same, median, p99)
                print(f"llama.cpp {k}/{v}: mean KLD {kld:.2e} (median {median:.2e}, 99th percentile {p99:.2e}), same "
                      f"top token {same:.2%}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--texts", type=int, default=4)
    ap.add_argument("--items", type=int, default=10, help="HumanEval problems or MT-Bench questions per context")
    ap.add_argument("--types", default=DEFAULT_TYPES, help="K/V pairs, comma-separated; the first is the reference")
    ap.add_argument("--llama-perplexity", help="llama.cpp's llama-perplexity binary: its KL figures beside ours")
    ap.add_argument("--ctx", type=int, default=512, help="llama-perplexity's chunk size")
    ap.add_argument("--llama-protocol", action="store_true",
                    help="score as llama-perplexity does: the texts joined, cut into chunks of --ctx tokens each from "
                         "a fresh cache, positions ctx/2 .. ctx-2 of each scored")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    target, tok, path = load_target(str(resolve_model(args.model)), "cpu", torch.float32)
    pairs = [tuple(p.split("/")) for p in args.types.split(",")]
    contexts = []
    if args.llama_protocol:
        ids = tok.encode("\n\n".join(texts(args.texts, args.items)))
        contexts = [torch.tensor(ids[i:i + args.ctx]) for i in range(0, len(ids) - args.ctx + 1, args.ctx)]
    else:
        for text in texts(args.texts, args.items):
            contexts.append(torch.tensor(tok.encode(text)[:args.tokens]))
    scored = slice(args.ctx // 2, args.ctx - 1) if args.llama_protocol else slice(None)
    results = dict(model=Path(path).name, tokens=[len(c) for c in contexts], date=time.strftime("%Y-%m-%d"), rows=[])
    reference = [log_probs(target, ids, pairs[0]) for ids in contexts]
    for pair in pairs[1:]:
        per_position = []
        agree, n = 0, 0
        for ids, ref in zip(contexts, reference):
            got = log_probs(target, ids, pair)[scored]
            ref = ref[scored]
            per_position.append((ref.exp() * (ref - got)).sum(-1))
            agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
            n += len(ref)
        kl = float(sum(p.sum() for p in per_position))
        every = torch.cat(per_position).double()
        by_range = {f"{lo}-{hi}": float(torch.cat([p[lo:hi] for p in per_position]).mean())
                    for lo, hi in POSITION_RANGES if any(len(p) > lo for p in per_position) and not args.llama_protocol}
        row = dict(k=pair[0], v=pair[1], mean_kl=kl / n, median_kl=float(every.median()),
                   kl_99=float(every.quantile(0.99)), top1_agreement=agree / n, positions=n, kl_by_position=by_range)
        results["rows"].append(row)
        print(f"{pair[0]}/{pair[1]}: mean KL {row['mean_kl']:.2e} (median {row['median_kl']:.2e}, 99th percentile "
              f"{row['kl_99']:.2e}), top-1 agreement {row['top1_agreement']:.2%}; by "
              f"position: " + ", ".join(f"{r} {v:.2e}" for r, v in by_range.items()), flush=True)
    if args.llama_perplexity:
        theirs = llama_cpp_kl(args.llama_perplexity, str(path), "\n\n".join(texts(args.texts, args.items)), pairs, args.ctx)
        for r in results["rows"]:
            if (r["k"], r["v"]) in theirs:
                (r["llama_cpp_mean_kld"], r["llama_cpp_same_top"], r["llama_cpp_median_kld"],
                 r["llama_cpp_kld_99"]) = theirs[(r["k"], r["v"])]
    print(f"\n{results['model']}, {len(contexts)} contexts of {results['tokens']} tokens, against {'/'.join(pairs[0])}")
    print("| K / V | mean KL | median KL | 99th pct KL | top-1 agreement | llama.cpp mean KLD | llama.cpp median | "
          "llama.cpp 99th pct | llama.cpp same top |\n|---|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        lc = (f"{r['llama_cpp_mean_kld']:.2e} | {r['llama_cpp_median_kld']:.2e} | {r['llama_cpp_kld_99']:.2e} | "
              f"{r['llama_cpp_same_top']:.2%}" if "llama_cpp_mean_kld" in r else "- | - | - | -")
        print(f"| {r['k']} / {r['v']} | {r['mean_kl']:.2e} | {r['median_kl']:.2e} | {r['kl_99']:.2e} | "
              f"{r['top1_agreement']:.2%} | {lc} |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
