"""The GGUF matmul kernel alone on Llama-3.1-8B's matrix shapes: time per call and achieved bandwidth against a
bf16 F.linear of the same shape, over a sweep of tile sizes. Random stored bytes (valid fp16 scales).
Usage: python benchmarks/kernels/gguf_kernels.py [--types Q4_K,Q6_K,Q8_0] [--sweep] [--gemv-sweep] [--dot] [--out FILE.json]
The integer kernels (kernels/gguf_gemv.py) take the rows they cover unless --dot; --sweep varies the tensor-core
kernel's tiles, --gemv-sweep / --gemv-configs the integer kernels'."""
import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).parent.parent))  # benchmarks/, for its shared modules
sys.path.insert(0, str(Path(__file__).parent.parent.parent / "tests"))
from gpu import graphed, timed  # noqa: E402

from flashdraft.kernels import gguf_gemv as G  # noqa: E402
from flashdraft.quant.ggml import stored_blocks  # noqa: E402
from flashdraft.kernels import gguf_matmul as K  # noqa: E402
from flashdraft.kernels import gguf_mma  # noqa: E402

SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)]  # (N, K): q/o, k/v, gate/up, down


def main() -> int:
    from test_gguf_kernels import random_blocks
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--configs", default=None, help='tile configs to time, "BLOCK_N,warps,programs;..."')
    ap.add_argument("--gemv-sweep", action="store_true")
    ap.add_argument("--gemv-configs", default=None, help='integer-kernel configs, "BLOCK_N,SB,warps,programs;..."')
    ap.add_argument("--dot", action="store_true", help="the tensor-core kernel for every row count")
    ap.add_argument("--shapes", default=None, help='matrix shapes "N,K;..." (default: the 8B\'s four)')
    ap.add_argument("--mma-min-rows", default=None,
                    help='gguf_mma.MIN_ROWS values to time each row count with, "3,5" (default: as set)')
    ap.add_argument("--mma-few-tokens", default=None,
                    help='gguf_mma.FEW_TOKENS values to time each row count with, "0,8" (default: as set)')
    ap.add_argument("--mma-programs", default=None,
                    help="gguf_mma.TARGET_PROGRAMS (every type) to time each row count with, \"264,396\"")
    ap.add_argument("--out")
    ap.add_argument("--best", help="write the fastest config (summed over types and rows) to this JSON")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")] if args.shapes else SHAPES
    dev = "cuda"
    configs = [(K.BLOCK_N, K.NUM_WARPS, K.TARGET_PROGRAMS)]
    if args.sweep:
        configs = list(itertools.product((16, 32, 64), (4, 8), (528, 1056)))
    if args.configs:  # "BLOCK_N,warps,programs;..."
        configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")]
    if args.dot:
        K._route = lambda x, qtypes, k: "dot"  # noqa: E731
    gemv_configs = [tuple(G.CONFIG.values())]
    if args.gemv_sweep:
        gemv_configs = list(itertools.product((2, 4, 8), (4, 8, 16), (4,), (2112,)))
    if args.gemv_sweep or args.gemv_configs:
        G.TYPE_CONFIGS.clear()  # every type and K takes the swept tile
        G.FIT_TILE = False
    if args.gemv_configs:
        gemv_configs = [tuple(int(v) for v in c.split(",")) for c in args.gemv_configs.split(";")]
    if len(gemv_configs) > 1:  # sweep the integer kernels with the tensor-core kernel's default tile
        configs = [tuple(c) + g for c in configs[:1] for g in gemv_configs]
    else:
        configs = [tuple(c) + gemv_configs[0] for c in configs]
    rows_out = []
    for qtype in args.types.split(","):
        weights = {s: stored_blocks(torch.from_numpy(random_blocks(qtype, *s, 0)), qtype).to(dev) for s in shapes}
        dense = {s: torch.randn(s, device=dev, dtype=torch.bfloat16) for s in shapes}
        for m in map(int, args.rows.split(",")):
            xs = {s: torch.randn(m, s[1], device=dev, dtype=torch.bfloat16) for s in shapes}
            ref_ms = timed(graphed(lambda: [F.linear(xs[s], dense[s]) for s in shapes], dev), 20, dev)
            qbytes = sum(w.numel() for w in weights.values())
            mma_from = [int(v) for v in args.mma_min_rows.split(",")] if args.mma_min_rows else [gguf_mma.MIN_ROWS]
            few = [int(v) for v in args.mma_few_tokens.split(",")] if args.mma_few_tokens else [gguf_mma.FEW_TOKENS]
            programs = [int(v) for v in args.mma_programs.split(",")] if args.mma_programs else [None]
            for (bn, warps, target, *gemv), gguf_mma.MIN_ROWS, gguf_mma.FEW_TOKENS, mma_programs in itertools.product(
                    configs, mma_from, few, programs):
                if mma_programs is not None:
                    for table in (gguf_mma.TARGET_PROGRAMS, gguf_mma.FEW_TARGET_PROGRAMS):
                        table.update(dict.fromkeys(table, mma_programs))
                K.BLOCK_N, K.NUM_WARPS, K.TARGET_PROGRAMS = bn, warps, target
                G.CONFIG.update(zip(("BLOCK_N", "SB", "num_warps", "target_programs"), gemv))
                sb = 0  # the tensor-core kernel's tile; an integer kernel's names its super-blocks too
                route = K._route(xs[shapes[0]], [qtype], shapes[0][1])
                if route == "gemv":
                    bn, sb, warps, target = gemv
                try:
                    ms = timed(graphed(lambda: [K.gguf_matmul(xs[s], weights[s], qtype, s[1]) for s in shapes], dev),
                               20, dev)
                except Exception as e:  # a tile that does not fit: skip it
                    print(f"{qtype} M={m} BN={bn} warps={warps} target={target}: {type(e).__name__}", flush=True)
                    continue
                if route == "mma":
                    route += "8" if m <= gguf_mma.FEW_TOKENS else "16"
                    few = m <= gguf_mma.FEW_TOKENS
                    target = (gguf_mma.FEW_TARGET_PROGRAMS if few else gguf_mma.TARGET_PROGRAMS).get(
                        qtype, gguf_mma.TARGET_PROGRAMS[qtype])
                r = dict(qtype=qtype, m=m, route=route, block_n=bn, sb=sb, warps=warps, target=target, ms=ms,
                         bf16_ms=ref_ms,
                         GBps=qbytes / (ms * 1e-3) / 1e9, over_bf16=ms / ref_ms)
                rows_out.append(r)
                print(f"{qtype} M={m} {route} BN={bn} SB={sb} warps={warps} target={target}: {ms:.3f} ms "
                      f"for the four "
                      f"matrices "
                      f"({r['GBps']:.0f} GB/s of quantized bytes; bf16 F.linear {ref_ms:.3f} ms)", flush=True)
    best = {}
    for r in rows_out:
        key = (r["qtype"], r["m"], r["route"])
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    print("\n| type | M | kernels | best BLOCK_N | SB | warps | programs | ms | GB/s | / bf16 F.linear |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    for r in best.values():
        print(f"| {r['qtype']} | {r['m']} | {r['route']} | {r['block_n']} | {r['sb']} | {r['warps']} | {r['target']} | "
              f"{r['ms']:.3f} | {r['GBps']:.0f} | {r['over_bf16']:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows_out, indent=1))
    if args.best:  # the config with the least total time over the types and row counts measured
        totals: dict[tuple, float] = {}
        for r in rows_out:
            key = (r["block_n"], r["sb"], r["warps"], r["target"])
            totals[key] = totals.get(key, 0.0) + r["ms"]
        bn, sb, warps, target = min(totals, key=totals.get)
        if sb:  # an integer-kernel sweep
            best_cfg = dict(gemv=dict(BLOCK_N=bn, SB=sb, num_warps=warps, target_programs=target))
        else:
            best_cfg = dict(block_n=bn, warps=warps, target=target)
        Path(args.best).write_text(json.dumps(best_cfg))
        print(f"best over all: {best_cfg}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
