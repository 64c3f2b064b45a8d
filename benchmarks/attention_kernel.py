"""The split attention kernel alone (kernels/split_attention.py) at the 8B's decode and verify shapes (32 query heads
over 8 KV heads of 128, bf16 cache), replayed in a CUDA graph, over a sweep of its tile settings.
Usage: python benchmarks/attention_kernel.py [--lengths 1280,16640] [--configs "ROW_TILE,BLOCK_N,TARGET,warps,stages;..."]"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu import graphed, timed  # noqa: E402

from flashdraft.kernels import split_attention as S  # noqa: E402

DEFAULT = f"{S.ROW_TILE},{S.BLOCK_N},{S.TARGET_PROGRAMS},{S.NUM_WARPS},{S.NUM_STAGES}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="1280,16640")
    ap.add_argument("--queries", default="1,16")
    ap.add_argument("--configs", default=DEFAULT)
    ap.add_argument("--heads", default="32,8,128")
    args = ap.parse_args()
    H, KV, D = (int(v) for v in args.heads.split(","))
    rows = []
    for L in map(int, args.lengths.split(",")):
        k = torch.randn(KV, L, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(KV, L, D, device="cuda", dtype=torch.bfloat16)
        for T in map(int, args.queries.split(",")):
            q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
            mask = torch.ones(T, L, device="cuda", dtype=torch.bool).tril(L - T)
            for cfg in args.configs.split(";"):
                S.ROW_TILE, S.BLOCK_N, S.TARGET_PROGRAMS, S.NUM_WARPS, S.NUM_STAGES = (int(c) for c in cfg.split(","))
                try:
                    ms = timed(graphed(lambda: S.split_attention(q, k, v, mask, D ** -0.5, 0.0), "cuda"), 50, "cuda")
                except Exception as e:  # a tile that does not fit
                    print(f"L={L} T={T} {cfg}: {type(e).__name__} {str(e)[:80]}", flush=True)
                    continue
                gbps = 2 * k.numel() * 2 / (ms * 1e-3) / 1e9
                rows.append((L, T, cfg, ms))
                print(f"L={L} T={T} cfg={cfg}: {ms * 1e3:.1f} us ({gbps:.0f} GB/s of K+V)", flush=True)
    print("\n| keys | queries | ROW_TILE,BLOCK_N,TARGET,warps,stages | us |\n|---|---|---|---|")
    for L, T, cfg, ms in rows:
        print(f"| {L} | {T} | {cfg} | {ms * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
