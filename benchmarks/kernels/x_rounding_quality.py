"""What rounding x to 8 bits costs in quality, per 32 values (what the GGUF integer and int8 mma kernels take today,
llama.cpp's q8_1) against per 256 (llama.cpp's CPU Q8_K; lets a K-quant kernel sum its sub-blocks in int32): the
next-token distribution with every projection's input rounded, against unrounded, on real text (mean KL, top-1
agreement), and per-32 against per-256 (how often the two roundings pick different greedy tokens). CPU, float32,
the file's weights dequantized; the rounding is the tests' emulation of the kernels' (as_int8_rows).

  python benchmarks/kernels/x_rounding_quality.py [-m smollm2-135m | FILE.gguf] [--tokens 1024] [--texts 2]
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))  # benchmarks/, for its shared modules
sys.path.insert(0, str(Path(__file__).parent.parent.parent / "tests"))
from kv_quality import log_probs, texts  # noqa: E402
from test_gguf_kernels import as_int8_rows  # noqa: E402

from flashdraft.formats.loader import load_target  # noqa: E402
from flashdraft.formats.named import resolve_model  # noqa: E402
from flashdraft.layers import linear as L  # noqa: E402

PLAIN = L.linear


def rounding(block: int | None):
    """L.linear with its input rounded per `block` values (None: unrounded)."""
    def linear(x, weight, bias=None):
        return PLAIN(x if block is None or x.shape[-1] % block else as_int8_rows(x, block).to(x.dtype), weight, bias)
    return linear


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="smollm2-135m", help="a named model or a GGUF path")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--texts", type=int, default=2)
    args = ap.parse_args()
    target, tok, path = load_target(str(resolve_model(args.model)), "cpu", torch.float32)
    contexts = [torch.tensor(tok.encode(t)[:args.tokens]) for t in texts(args.texts)]
    runs = {}
    for block in (None, 32, 256):
        L.linear = rounding(block)
        runs[block] = [log_probs(target, ids, ("auto", "auto")) for ids in contexts]
    L.linear = PLAIN
    print(f"{Path(path).name}, {sum(len(c) for c in contexts)} positions")
    print("| x rounded | against | mean KL | top-1 agreement |\n|---|---|---|---|")
    for got, ref in ((32, None), (256, None), (256, 32)):
        kl = torch.cat([(r.exp() * (r - g)).sum(-1) for g, r in zip(runs[got], runs[ref])])
        agree = torch.cat([g.argmax(-1) == r.argmax(-1) for g, r in zip(runs[got], runs[ref])]).float().mean()
        print(f"| per {got} | {'unrounded' if ref is None else f'per {ref}'} | {kl.mean():.2e} | {agree:.2%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
