"""The split attention kernel alone (kernels/split_attention.py) at the 8B's decode and verify shapes (32 query heads
over 8 KV heads of 128, a bf16 cache or a stored KV type), replayed in a CUDA graph, over a sweep of its tile settings.
Usage: python benchmarks/kernels/attention_kernel.py [--lengths 1280,16640] [--types f16,q4_1]
           [--configs "ROW_TILE,BLOCK_N,TARGET,warps,stages[,tiles];..."] [--cache 32768]
(tiles: row tiles a program takes, FLOAT_TILES or STORED_TILES). --cache N: the queries' positions given (the last
is length - 1), each length is timed as a launch over its bucket's rows (engine/steps.bucket_for) and as one over
all N rows of the cache (the grid sized for N, the split partition taken from the positions at run time); the two
outputs must be equal, bit for bit."""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))  # benchmarks/, for its shared modules
from gpu import graphed, timed  # noqa: E402

from flashdraft.engine.steps import bucket_for  # noqa: E402
from flashdraft.kernels import split_attention as S  # noqa: E402
from flashdraft.layers.kv_quant import kv_codecs  # noqa: E402

FLOAT_DEFAULT = f"{S.ROW_TILE},{S.BLOCK_N},{S.TARGET_PROGRAMS},{S.NUM_WARPS},{S.NUM_STAGES},{S.FLOAT_TILES}"
STORED_DEFAULT = f"{S.ROW_TILE},{S.STORED_BLOCK_N},{S.TARGET_PROGRAMS},{S.NUM_WARPS},{S.STORED_STAGES},{S.STORED_TILES}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="1280,16640")
    ap.add_argument("--queries", default="1,16")
    ap.add_argument("--configs", help=f"default: the kernel's own, {FLOAT_DEFAULT} over float rows and "
                                      f"{STORED_DEFAULT} over stored types")
    ap.add_argument("--heads", default="32,8,128")
    ap.add_argument("--types", default="f16", help="KV cache types (K = V), as --cache-type-k takes them")
    ap.add_argument("--cache", type=int, help="rows of a whole cache: time each length's bucketed launch against "
                                              "a launch over all of them, at the same positions")
    args = ap.parse_args()
    H, KV, D = (int(v) for v in args.heads.split(","))
    rows = []
    for name, L in ((n, int(l)) for n in args.types.split(",") for l in args.lengths.split(",")):
        codec = kv_codecs((name, name), torch.bfloat16)[0]
        codec.prepare("cuda", D)
        n_rows = max(L, args.cache or L)
        k = codec.encode(torch.randn(KV, n_rows, D, device="cuda", dtype=torch.bfloat16))
        v = codec.encode(torch.randn(KV, n_rows, D, device="cuda", dtype=torch.bfloat16))
        row_type = S.ROW_TYPES.get(name, 0) if codec.packed else 0
        rotated = codec.rotates(D)  # as the engine calls it: q rotated in the kernel, the output back in the merge
        keys_read = 2 * KV * L * k.shape[-1] * k.element_size()  # bytes of K and V up to the last position
        for T in map(int, args.queries.split(",")):
            q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
            mask = torch.ones(T, n_rows, device="cuda", dtype=torch.bool).tril(L - T)
            positions = torch.arange(L - T, L, device="cuda") if args.cache else None
            attended = bucket_for(L, n_rows) if args.cache else L  # the bucketed launch's rows

            def launch(n):  # over the first n rows
                return S.split_attention(q, k[:, :n], v[:, :n], mask[:, :n], D ** -0.5, 0.0, row_type, row_type,
                                         rotated, rotated, positions)

            for cfg in (args.configs or (STORED_DEFAULT if row_type else FLOAT_DEFAULT)).split(";"):
                S.ROW_TILE, S.BLOCK_N, S.TARGET_PROGRAMS, S.NUM_WARPS, S.NUM_STAGES, *tiles = map(int, cfg.split(","))
                S.STORED_BLOCK_N, S.STORED_STAGES = S.BLOCK_N, S.NUM_STAGES
                if tiles:  # exactly these tiles a program, however few the programs
                    S.FLOAT_TILES = S.STORED_TILES = tiles[0]
                    S.FEWER_TILES_BELOW = 0
                try:
                    ms = timed(graphed(lambda: launch(attended), "cuda"), 50, "cuda")
                    whole_ms = timed(graphed(lambda: launch(n_rows), "cuda"), 50, "cuda") if args.cache else None
                except Exception as e:  # a tile that does not fit
                    print(f"{name} L={L} T={T} {cfg}: {type(e).__name__} {str(e)[:80]}", flush=True)
                    continue
                gbps = keys_read / (ms * 1e-3) / 1e9
                rows.append((name, L, T, cfg, ms, gbps, whole_ms))
                line = f"{name} L={L} T={T} cfg={cfg}: {ms * 1e3:.1f} us ({gbps:.0f} GB/s of K+V)"
                if args.cache:
                    same = torch.equal(launch(attended), launch(n_rows))
                    line += (f" over {attended} rows, {whole_ms * 1e3:.1f} us over {n_rows}"
                             f" ({'the same' if same else 'NOT the same'} output)")
                    if not same:
                        print(line, flush=True)
                        return 1
                print(line, flush=True)
    whole = f" us over {args.cache} rows | +us |" if args.cache else ""
    print(f"\n| type | keys | queries | ROW_TILE,BLOCK_N,TARGET,warps,stages,tiles | us{' (bucket)' if whole else ''} "
          f"| GB/s |{whole}")
    print("|---|---|---|---|---|---|" + ("---|---|" if whole else ""))
    for name, L, T, cfg, ms, gbps, whole_ms in rows:
        extra = f" {whole_ms * 1e3:.1f} | {(whole_ms - ms) * 1e3:+.1f} |" if whole_ms is not None else ""
        print(f"| {name} | {L} | {T} | {cfg} | {ms * 1e3:.1f} | {gbps:.0f} |{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
