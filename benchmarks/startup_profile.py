"""Where a start-up's model loading goes: `load_target` (as `flashdraft serve` calls it for a GGUF file kept
quantized) under cProfile, then the functions that took the most time, cumulative and their own. For finding
where time goes, not a start-up figure (that is guide_e2e.py's, through the server).
Usage: python benchmarks/startup_profile.py MODEL.gguf [--device cuda] [--top 25]"""
import argparse
import cProfile
import pstats
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    t = time.perf_counter()
    from flashdraft.formats.loader import load_target
    print(f"imports {time.perf_counter() - t:.2f} s")
    profile = cProfile.Profile()
    t = time.perf_counter()
    profile.enable()
    load_target(args.model, args.device, torch.bfloat16, quantized=True)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    profile.disable()
    print(f"load_target {time.perf_counter() - t:.2f} s")
    stats = pstats.Stats(profile)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
