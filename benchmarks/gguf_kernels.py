"""The GGUF matmul kernel alone on Llama-3.1-8B's matrix shapes: time per call and achieved bandwidth against a
bf16 F.linear of the same shape, over a sweep of tile sizes. Random stored bytes (valid fp16 scales).
Usage: python benchmarks/gguf_kernels.py [--types Q4_K,Q6_K,Q8_0] [--sweep] [--out FILE.json]"""
import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from gpu import graphed, timed  # noqa: E402

from flashdraft.kernels import gguf_matmul as K  # noqa: E402

SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]  # (N, K): q/o, k/v, gate/up, down


def main() -> int:
    from test_gguf_kernels import random_blocks
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--configs", default=None, help='tile configs to time, "BLOCK_N,warps,programs;..."')
    ap.add_argument("--out")
    ap.add_argument("--best", help="write the fastest config (summed over types and rows) to this JSON")
    args = ap.parse_args()
    dev = "cuda"
    configs = [(K.BLOCK_N, K.NUM_WARPS, K.TARGET_PROGRAMS)]
    if args.sweep:
        configs = list(itertools.product((16, 32, 64), (4, 8), (528, 1056)))
    if args.configs:  # "BLOCK_N,warps,programs;..."
        configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")]
    rows_out = []
    for qtype in args.types.split(","):
        weights = {s: torch.from_numpy(random_blocks(qtype, s[0], s[1], 0)).to(dev) for s in SHAPES}
        dense = {s: torch.randn(s, device=dev, dtype=torch.bfloat16) for s in SHAPES}
        for m in map(int, args.rows.split(",")):
            xs = {s: torch.randn(m, s[1], device=dev, dtype=torch.bfloat16) for s in SHAPES}
            ref_ms = timed(graphed(lambda: [F.linear(xs[s], dense[s]) for s in SHAPES], dev), 20, dev)
            qbytes = sum(w.numel() for w in weights.values())
            for bn, warps, target in configs:
                K.BLOCK_N, K.NUM_WARPS, K.TARGET_PROGRAMS = bn, warps, target
                try:
                    ms = timed(graphed(lambda: [K.gguf_matmul(xs[s], weights[s], qtype, s[1]) for s in SHAPES], dev),
                               20, dev)
                except Exception as e:  # a tile that does not fit: skip it
                    print(f"{qtype} M={m} BN={bn} warps={warps} target={target}: {type(e).__name__}", flush=True)
                    continue
                r = dict(qtype=qtype, m=m, block_n=bn, warps=warps, target=target, ms=ms, bf16_ms=ref_ms,
                         GBps=qbytes / (ms * 1e-3) / 1e9, over_bf16=ms / ref_ms)
                rows_out.append(r)
                print(f"{qtype} M={m} BN={bn} warps={warps} target={target}: {ms:.3f} ms for the four matrices "
                      f"({r['GBps']:.0f} GB/s of quantized bytes; bf16 F.linear {ref_ms:.3f} ms)", flush=True)
    best = {}
    for r in rows_out:
        key = (r["qtype"], r["m"])
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    print("\n| type | M | best BLOCK_N | warps | programs | ms | GB/s | / bf16 F.linear |\n|---|---|---|---|---|---|---|---|")
    for r in best.values():
        print(f"| {r['qtype']} | {r['m']} | {r['block_n']} | {r['warps']} | {r['target']} | {r['ms']:.3f} | "
              f"{r['GBps']:.0f} | {r['over_bf16']:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows_out, indent=1))
    if args.best:  # the config with the least total time over the types and row counts measured
        totals: dict[tuple, float] = {}
        for r in rows_out:
            key = (r["block_n"], r["warps"], r["target"])
            totals[key] = totals.get(key, 0.0) + r["ms"]
        bn, warps, target = min(totals, key=totals.get)
        Path(args.best).write_text(json.dumps(dict(block_n=bn, warps=warps, target=target)))
        print(f"best over all: BLOCK_N {bn}, {warps} warps, {target} programs", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
