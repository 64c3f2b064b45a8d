"""Where the time of one decode, verify(16) and draft step goes: torch.profiler's CUDA kernel times, grouped
by kernel, for the random-weight shapes of benchmarks/gpu.py. Prints one table per step and a summary of
matrix-product time against everything else.

Usage: python benchmarks/kernels/profile_steps.py [--model llama-3.1-8b | --file FILE.gguf [--draft FOLDER]] [--ctx 1024]
           [--compile] [--cache-types K/V] [--batch N] [--out FILE.json]

--batch N adds "decode_batchN": one plain step of N slots at once (the engine's Steps.plain_batch: slots a [N]
tensor), each slot holding ctx positions, beside the one-slot decode.
"""
import argparse
import collections
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from flashdraft.engine.generate import prefill
from flashdraft.engine.steps import bucket_for
from flashdraft.engine.sampling import argmax_rows
sys.path.insert(0, str(Path(__file__).parent.parent))  # benchmarks/, for gpu.py
from gpu import SHAPES, TINY, draft_for, random_target

GEMM_MARKERS = ("gemm", "gemv", "cutlass", "sm90_xmma", "nvjet", "splitkreduce", "cublas")


def kernel_table(prof, steps: int) -> list[tuple[str, float, int]]:
    """(kernel name, microseconds per step, launches per step), largest first."""
    total: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name] += ev.device_time
            count[ev.name] += 1
    rows = [(name, us / steps, count[name] // steps) for name, us in total.items()]
    return sorted(rows, key=lambda r: -r[1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--file", help="a GGUF file (matrices kept quantized) instead of a random --model")
    ap.add_argument("--draft", help="a DFlash draft folder (e.g. flashdraft/drafts/smollm2-135m) instead of a random one")
    ap.add_argument("--cache-types", default="auto/auto", help="the target's KV cache types, K/V")
    ap.add_argument("--batch", type=int, default=1, help="also profile a plain step of this many slots at once")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev, dtype = args.device, torch.bfloat16
    ctx = 64 if args.tiny else args.ctx
    results = {}
    with torch.inference_mode():
        if args.file:
            from flashdraft.formats.loader import load_target
            from gguf_gpu import gemma4_draft
            target = load_target(args.file, dev, dtype, quantized=True)[0]
            cfg = target.cfg
            draft = (gemma4_draft if cfg.arch == "gemma4" else draft_for)(cfg, dev, dtype, args.tiny)
            args.model = args.file.rsplit("/", 1)[-1]
        else:
            cfg = (TINY if args.tiny else SHAPES)[args.model]
            target, draft = random_target(cfg, dev, dtype), draft_for(cfg, dev, dtype, args.tiny)
        if args.draft:
            from flashdraft.draft.load import load_draft_folder
            draft = load_draft_folder(args.draft, dev, dtype).eval()
        max_len = ctx + 256
        slots = max(1, args.batch)
        state = target.new_state(slots, max_len, tuple(args.cache_types.split("/")))
        draft.setup_cache(min(ctx, 1024), slots)
        if args.compile:
            target.compile_layers((1, 16))
            draft.compile_layers()
        ids = draft.cfg.target_layer_ids
        for slot in range(slots):
            prefill(target, state, torch.randint(0, cfg.vocab_size - 1, (ctx,), device=dev), slot, draft=draft)
        bucket = bucket_for(ctx + 16, max_len)
        tok, pos = torch.tensor([5], device=dev), torch.tensor([ctx], device=dev)
        block = torch.randint(0, cfg.vocab_size - 1, (16,), device=dev)
        positions = torch.arange(ctx, ctx + 16, device=dev)
        steps = {
            "decode": lambda: target(tok[None], pos[None], state, attn_len=bucket),
            "verify16": lambda: target(block[None], positions[None], state, capture=ids, attn_len=bucket),
            "draft": lambda: argmax_rows(draft.compute_logits(draft(target.token_embedding(block), positions, 0, None, bucket)[1:], target.logits)),
        }
        if slots > 1:
            rows = torch.arange(slots, device=dev)
            toks, poss = tok.repeat(slots)[:, None], pos.repeat(slots)[:, None]
            steps[f"decode_batch{slots}"] = lambda: target(toks, poss, state, rows, attn_len=bucket)
        n = 5
        for name, fn in steps.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize() if dev == "cuda" else None
            with profile(activities=[ProfilerActivity.CUDA] if dev == "cuda" else [ProfilerActivity.CPU]) as prof:
                for _ in range(n):
                    fn()
                torch.cuda.synchronize() if dev == "cuda" else None
            table = kernel_table(prof, n) if dev == "cuda" else []
            gemm = sum(us for k, us, _ in table if any(m in k.lower() for m in GEMM_MARKERS))
            total = sum(us for _, us, _ in table)
            launches = sum(c for _, _, c in table)
            results[name] = dict(kernel_us=total, gemm_us=gemm, launches=launches,
                                 kernels=[dict(name=k[:160], us=us, launches=c) for k, us, c in table])
            print(f"\n== {args.model} ctx {ctx} {'compiled' if args.compile else 'eager layers'}, KV {args.cache_types}: {name} "
                  f"step: "
                  f"{total:.0f} us of kernels in {launches} launches; matrix products {gemm:.0f} us, "
                  f"other {total - gemm:.0f} us")
            print("| us/step | launches | kernel |\n|---|---|---|")
            for k, us, c in table[:args.top]:
                print(f"| {us:8.1f} | {c:4d} | {k[:110]} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
