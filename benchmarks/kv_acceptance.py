"""Does a quantized KV cache cost DFlash acceptance beyond noise? Runs `flashdraft bench --json` (in process, full
verify width) once per cache type pair on the same prompts, then compares each type's per-request acceptance length
with the float cache's on the same request: mean paired difference and its standard error.

  python benchmarks/kv_acceptance.py [--types auto,q8_0/q8_0,q5_0/q4_1,q4_1/q4_1] [--prompts mt-bench]
      [--num-prompts 16] [-n 128] [--data-dir DIR] [--out FILE.json]
"""
import argparse
import json
import math
import statistics
import subprocess
import sys


def run(pair: str, args) -> dict[str, dict]:
    k, _, v = pair.partition("/")
    cmd = [sys.executable, "-m", "flashdraft.cli", "bench", "--prompts", args.prompts, "--num-prompts",
           str(args.num_prompts), "-n", str(args.max_tokens), "--no-spec-dm-adaptive", "--json", "-ctk", k, "-ctv",
           v or k]
    if args.data_dir:
        cmd += ["--data-dir", args.data_dir]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    summary = json.loads(out.strip().splitlines()[-1])
    rows = summary["comparisons"][0]["rows"]
    return {r["name"]: r for r in rows if r.get("kind") == "prompt"}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="auto,q8_0/q8_0,q5_0/q4_1,q4_1/q4_1")
    ap.add_argument("--prompts", default="mt-bench")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--data-dir")
    ap.add_argument("--out")
    args = ap.parse_args()
    pairs = args.types.split(",")
    results = {}
    for pair in pairs:
        results[pair] = run(pair, args)
        accept = [r["mean_acceptance_length"] for r in results[pair].values()]
        print(f"{pair}: {len(accept)} requests, mean acceptance length {statistics.mean(accept):.3f}", flush=True)
    base = results[pairs[0]]
    print(f"\n| K/V | requests | acceptance length | paired difference to {pairs[0]} (± s.e.) | same text as plain |")
    print("|---|---|---|---|---|")
    table = []
    for pair in pairs:
        rows = results[pair]
        names = [n for n in rows if n in base]
        diffs = [rows[n]["mean_acceptance_length"] - base[n]["mean_acceptance_length"] for n in names]
        se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
        mean = statistics.mean(rows[n]["mean_acceptance_length"] for n in names)
        same = sum(rows[n]["same"] for n in names)
        table.append(dict(pair=pair, requests=len(names), acceptance=mean, diff=statistics.mean(diffs), se=se, same=same))
        print(f"| {pair} | {len(names)} | {mean:.3f} | {statistics.mean(diffs):+.3f} ± {se:.3f} | {same}/{len(names)} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(settings=vars(args), table=table, rows=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
