"""Whether the integer kernels give a token the same bits whatever the row count (1, 2, 4, 16 rows), on the GPU,
for a given tile. Usage: python benchmarks/kernels/gguf_row_invariance.py [--sb 8] [--types Q4_K,Q6_K]"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent.parent / "tests"))
from test_gguf_kernels import random_blocks  # noqa: E402

from flashdraft.kernels import gguf_gemv as G  # noqa: E402
from flashdraft.quant.ggml import stored_blocks  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q4_K")
    ap.add_argument("--sb", type=int, default=G.CONFIG["SB"])
    args = ap.parse_args()
    G.CONFIG.update(SB=args.sb)
    for qtype in args.types.split(","):
        w = stored_blocks(torch.from_numpy(random_blocks(qtype, 4096, 4096, 0)), qtype).cuda()
        x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
        one = G.gemv(x[:1], w, qtype, 4096)[0]
        same = {m: torch.equal(one, G.gemv(x[:m], w, qtype, 4096)[0]) for m in (2, 4, 16)}
        print(f"{qtype} SB={args.sb}: row 0 the same bits as alone for {same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
