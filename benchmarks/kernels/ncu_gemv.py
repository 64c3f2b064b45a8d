"""One launch of the integer GGUF kernel per matrix shape, for Nsight Compute to read its counters.
Usage: ncu --clock-control none --set full -k regex:_kquant -c 3 python benchmarks/kernels/ncu_gemv.py --types Q4_K
(the first call of each shape compiles and warms up outside the profiled launches: ncu's --launch-skip)."""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent.parent / "tests"))

from flashdraft.kernels import gguf_gemv as G  # noqa: E402
from flashdraft.kernels import gguf_matmul as K  # noqa: E402
from flashdraft.quant.ggml import stored_blocks  # noqa: E402

SHAPES = "14336,4096;4096,14336;21504,5376;5376,21504"  # (N, K): 8B gate/up, down; Gemma 4 31B's


def main() -> int:
    from test_gguf_kernels import random_blocks
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_K")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--dot", action="store_true", help="the tensor-core kernel (kernels/gguf_matmul.py) instead")
    args = ap.parse_args()
    if args.dot:
        K._route = lambda x, qtypes, k: "dot"  # noqa: E731
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")]
    for qtype in args.types.split(","):
        for n, k in shapes:
            w = stored_blocks(torch.from_numpy(random_blocks(qtype, n, k, 0)), qtype).cuda()
            x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
            for _ in range(2):
                K.gguf_matmul(x, w, qtype, k) if args.dot else G.gemv(x, w, qtype, k)
            torch.cuda.synchronize()
            print(f"{qtype} N={n} K={k} rows={args.rows}: {w.numel() / 1e6:.1f} MB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
