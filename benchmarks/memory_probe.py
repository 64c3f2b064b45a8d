"""Where an engine's GPU memory goes after start-up: the live allocations grouped by the Python line that made them
(largest first), beside the caching allocator's totals. Finds what `memory`'s "workspace" figure (reserved less weights
and caches) holds.
Usage: python benchmarks/memory_probe.py -m MODEL.gguf [-md DRAFT] [--ctx-size 32768] [-ctk q5_0 -ctv q4_1]"""
import argparse
import collections
import sys

import torch

from flashdraft.args import add_engine_args, engine_config


def main() -> int:
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    from flashdraft.engine.engine import Engine
    engine = Engine.load(engine_config(args, args.draft, "cuda", adaptive=args.adaptive and args.draft is not None))
    torch.cuda.synchronize()
    print({k: f"{v / 2**20:.0f} MiB" for k, v in engine.memory.items() if k != "kv_per_token"})
    print(f"allocated {torch.cuda.memory_allocated() / 2**20:.0f} MiB, reserved {torch.cuda.memory_reserved() / 2**20:.0f}"
          f" MiB, peak allocated {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB")
    free, total = torch.cuda.mem_get_info()
    used = (total - free) / 2**20
    print(f"device memory in use {used:.0f} MiB, of which outside PyTorch's allocator (CUDA context, loaded kernels, "
          f"library handles) {used - torch.cuda.memory_reserved() / 2**20:.0f} MiB (when no other process holds any)")
    snapshot = torch.cuda.memory._snapshot()
    by_line: dict[str, int] = collections.Counter()
    pools: dict[str, int] = collections.Counter()
    for seg in snapshot["segments"]:
        pools[str(seg.get("segment_pool_id"))] += seg["total_size"]
        for block in seg["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = [f for f in block.get("frames", []) if "flashdraft" in f["filename"]]
            where = " < ".join(f"{f['filename'].split('flashdraft/')[-1]}:{f['line']}" for f in frames[:3]) or "?"
            by_line[where] += block["size"]
    print("segments by pool:", {k: f"{v / 2**20:.0f} MiB" for k, v in pools.items()})
    for where, size in by_line.most_common(args.top):
        print(f"{size / 2**20:10.1f} MiB  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
