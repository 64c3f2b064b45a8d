"""How far a verify step's logits drift from the plain decode steps' logits for the same tokens, per attention
kernel. Greedy speculative decoding is token-identical to plain decoding only where the two agree on the argmax;
in bf16 they differ by rounding (matrix products of 1 and of 16 rows take different kernels), and this prints by
how much: max and mean |logit difference| and the share of positions whose argmax differs.

Usage: python benchmarks/kernels/verify_drift.py [--tokens 256] [--compile] [--kernels split,matmul] [--out FILE.json]
       python benchmarks/kernels/verify_drift.py --tiny --device cpu   (a smoke test)
"""
import argparse
import json
import sys
from pathlib import Path

import torch

from flashdraft.engine.generate import prefill
from flashdraft.engine.steps import bucket_for, plain_step
from flashdraft.layers import attention
sys.path.insert(0, str(Path(__file__).parent.parent))  # benchmarks/, for gpu.py
from gpu import SHAPES, TINY, log, random_target

BLOCK = 16


def drift(target, state, prompt: torch.Tensor, n: int) -> dict:
    dev, P = prompt.device, len(prompt)
    logits = prefill(target, state, prompt, 0)
    tokens, decoded = [int(logits[-1].argmax())], []
    for i in range(n):  # plain greedy decode, as the baseline runs it (bucketed attention length)
        pos = P + i
        out = plain_step(target, state, torch.tensor([tokens[-1]], device=dev), torch.tensor([pos], device=dev), 0,
                         bucket_for(pos + 1, state.max_len))[0]
        decoded.append(out[0].float())
        tokens.append(int(out[0].argmax()))
    decoded = torch.stack(decoded)
    prefill(target, state, prompt, 0)
    verified = []
    for start in range(0, n, BLOCK):  # the same tokens, 16 at a time, as verify steps see them
        ids = torch.tensor(tokens[start:start + BLOCK], device=dev)
        positions = torch.arange(P + start, P + start + len(ids), device=dev)
        out, _ = target(ids[None], positions[None], state, attn_len=bucket_for(P + start + BLOCK, state.max_len))
        verified.append(out[0].float())
    verified = torch.cat(verified)[:n]
    diff = (verified - decoded).abs()
    top2 = decoded.topk(2, dim=-1).values
    return dict(max_abs_diff=diff.max().item(), mean_abs_diff=diff.mean().item(),
                logit_std=decoded.std().item(),
                argmax_disagree=(verified.argmax(-1) != decoded.argmax(-1)).float().mean().item(),
                median_top2_margin=(top2[:, 0] - top2[:, 1]).median().item())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--kernels", default="split,matmul")
    ap.add_argument("--compile", action="store_true", help="also measure with torch.compile'd layers")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out")
    args = ap.parse_args()
    cfg = (TINY if args.tiny else SHAPES)[args.model]
    n, P = (32, 40) if args.tiny else (args.tokens, args.prompt_len)
    rows = []
    with torch.inference_mode():
        target = random_target(cfg, args.device, torch.bfloat16 if args.device == "cuda" else torch.float32)
        state = target.new_state(1, P + n + 2 * BLOCK)
        prompt = torch.randint(0, cfg.vocab_size, (P,), generator=torch.Generator().manual_seed(0)).to(args.device)
        for compiled in [False] + ([True] if args.compile else []):
            if compiled:
                target.compile_layers((1, BLOCK))
            for kernel in args.kernels.split(","):
                attention.KERNEL = kernel
                r = dict(kernel=kernel, compiled=compiled, **drift(target, state, prompt, n))
                rows.append(r)
                log(f"{kernel}{' compiled' if compiled else ''}: {r}")
    log(f"\n{args.model}, random {target.lm_head.weight.dtype} weights, {P}-token prompt, {n} greedy tokens on {args.device}")
    log("| attention | compiled | max abs diff | mean abs diff | logit std | argmax differs | median top-2 margin |")
    log("|---|---|---|---|---|---|---|")
    for r in rows:
        log(f"| {r['kernel']} | {r['compiled']} | {r['max_abs_diff']:.4f} | {r['mean_abs_diff']:.5f} | {r['logit_std']:.3f} | "
            f"{100 * r['argmax_disagree']:.1f}% | {r['median_top2_margin']:.4f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
