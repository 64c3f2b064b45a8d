"""The sampled path's cost beside the greedy one on a GPU: `sample` with the guide's settings (temperature 0.7,
top-k 64, top-p 0.95, min-p 0) against argmax, for one row and a 16-row verify block, launched eagerly as the decode loop launches them.
Usage: python benchmarks/sampling_cost.py [--vocab 262144,49152]"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu import timed  # noqa: E402

from flashdraft.engine.sampling import SamplingParams, sample  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", default="262144,49152")
    args = ap.parse_args()
    guide = SamplingParams(temperature=0.7, top_k=64, top_p=0.95, min_p=0.0)
    print("| vocab | rows | greedy us | guide us |\n|---|---|---|---|")
    for vocab in map(int, args.vocab.split(",")):
        for rows in (1, 16):
            logits = torch.randn(rows, vocab, device="cuda") * 3
            gen = torch.Generator(device="cuda").manual_seed(0)
            greedy = timed(lambda: sample(logits, SamplingParams(), None), 200, "cuda")
            sampled = timed(lambda: sample(logits, guide, gen), 200, "cuda")
            print(f"| {vocab} | {rows} | {greedy * 1e3:.1f} | {sampled * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
