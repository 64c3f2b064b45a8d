"""Tensor-parallel step times on random Llama-3.1-70B-shaped bf16 weights: each rank builds only its own
share (meta tensors, then its shard allocated and filled in place; the whole model never exists anywhere),
then times the decode step and the verify step of 16 tokens, each one CUDA graph with its all-reduces inside,
at a few context lengths. Prints decode tok/s, verify(16)/decode and the weight-read bandwidth per rank.
Usage: python benchmarks/tp.py [--tp N] [--ctx 1024,16384] [--out FILE.json]   (N defaults to every GPU)
       torchrun --nproc-per-node N benchmarks/tp.py
       python benchmarks/tp.py --tiny --device cpu   (a smoke test: 2 gloo ranks, tiny shapes)
"""
import argparse
import dataclasses
import functools
import json
import sys

import torch
import torch.distributed as dist

from flashdraft.draft import build_target_layer_ids
from flashdraft.engine.generate import prefill
from flashdraft.engine.graphs import GraphCache
from flashdraft.engine.steps import bucket_for, plain_step
from flashdraft.launch import run_tensor_parallel, spawn, under_torchrun
from flashdraft.models.llama import LlamaConfig
from flashdraft.models.llama import Llama
from gpu import LLAMA3_ROPE, log, timed, weight_bytes  # benchmarks/gpu.py, beside this script

LLAMA_70B = LlamaConfig(arch="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
                        num_heads=64, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                        rope_scaling=LLAMA3_ROPE, max_position_embeddings=131072)
TINY = LlamaConfig(arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                   num_kv_heads=2, head_dim=16, rope_scaling=LLAMA3_ROPE)
BLOCK = 16


def sharded_random_target(cfg: LlamaConfig, device: str, dtype: torch.dtype) -> Llama:
    """This rank's share of a random target, allocated on `device` only (bf16 from the start)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.device("meta"):
        model = Llama(cfg, rank, world).to(dtype)
    model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(rank)  # replicated tensors: see below
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=generator)
        dist.broadcast(model.model.embed_tokens.weight, src=0)  # replicated: the same on every rank
    return model.eval()


def bench_rank(args: argparse.Namespace, device: str) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, dtype = (TINY, torch.float32) if args.tiny else (LLAMA_70B, torch.bfloat16)
    if args.layers:  # fewer layers of the same width, e.g. to fit one GPU
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    ctxs = [int(c) for c in args.ctx.split(",")]
    target = sharded_random_target(cfg, device, dtype)
    max_len = bucket_for(max(ctxs) + BLOCK, 1 << 30)
    state = target.new_state(1, max_len)
    nbytes = weight_bytes(target)  # this rank's share, lm_head included
    capture = build_target_layer_ids(cfg.num_layers, 5)
    timing_device = "cuda" if device.startswith("cuda") else device  # gpu.timed: events on the current GPU
    rows = []
    for ctx in ctxs:
        prompt = torch.randint(0, cfg.vocab_size, (ctx,), generator=torch.Generator().manual_seed(ctx)).to(device)
        with torch.inference_mode():
            prefill(target, state, prompt, 0)
        graphs = GraphCache(device)
        bucket = bucket_for(ctx + BLOCK, max_len)
        tok, pos = torch.tensor([5], device=device), torch.tensor([ctx], device=device)
        block, positions = prompt[:BLOCK].clone(), torch.arange(ctx, ctx + BLOCK, device=device)

        def decode_step():
            return graphs.run(("plain",), lambda t, p: plain_step(target, state, t, p, 0, bucket), [tok, pos])

        def verify_step():
            return graphs.run(("verify",), lambda b, p: target(b[None], p[None], state, capture=capture, attn_len=bucket),
                              [block, positions])

        with torch.inference_mode():
            ms_decode = timed(decode_step, args.iters, timing_device)
            ms_verify = timed(verify_step, args.iters, timing_device)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else 0.0
        rows.append(dict(ctx=ctx, decode_ms=ms_decode, decode_tok_s=1e3 / ms_decode, verify16_ms=ms_verify,
                         verify_over_decode=ms_verify / ms_decode,
                         weight_read_GBps_per_rank=nbytes / (ms_decode * 1e-3) / 1e9, peak_mem_GiB=peak))
    if rank == 0:
        report(args, rows, world, nbytes, device, dtype)
    dist.barrier()  # rank 0 reports before any rank tears the group down
    return 0


def report(args, rows: list[dict], world: int, nbytes: int, device: str, dtype: torch.dtype) -> None:
    name = "tiny" if args.tiny else "Llama-3.1-70B"
    where = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    log(f"== {name} shapes, {str(dtype).removeprefix('torch.')}, tensor-parallel over {world} ranks ({where}); "
        f"weights per rank {nbytes / 1e9:.3g} GB (lm_head split by vocabulary, embedding replicated)")
    log("| ctx | decode ms | tok/s | GB/s per rank | verify16 ms | verify16/decode | peak GiB |")
    log("|---|---|---|---|---|---|---|")
    for r in rows:
        log(f"| {r['ctx']} | {r['decode_ms']:.3f} | {r['decode_tok_s']:.1f} | {r['weight_read_GBps_per_rank']:.3g} | "
            f"{r['verify16_ms']:.3f} | {r['verify_over_decode']:.3f} | {r['peak_mem_GiB']:.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(model=name, world_size=world, device=where, weight_bytes_per_rank=nbytes, rows=rows), f,
                      indent=2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tp", type=int, default=None, help="ranks (default: every GPU; 2 on the CPU)")
    ap.add_argument("--ctx", default=None, help="comma-separated context lengths (default 1024,16384; tiny 64,300)")
    ap.add_argument("--iters", type=int, default=None, help="timed runs per step (default 30; tiny 5)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's; 80 for 70B)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes in float32: a smoke test on the CPU")
    ap.add_argument("--out", help="write the results as JSON")
    args = ap.parse_args()
    args.ctx = args.ctx or ("64,300" if args.tiny else "1024,16384")
    args.iters = args.iters or (5 if args.tiny else 30)
    if args.tp is None:  # torchrun's own process count, every GPU, or two CPU ranks
        args.tp = 1 if under_torchrun() else torch.cuda.device_count() if args.device.startswith("cuda") else 2
    rank_main = functools.partial(bench_rank, args)
    if args.tp == 1 and not under_torchrun():  # still a process group (of one), so the collectives run too
        return spawn(rank_main, 1, args.device)
    return run_tensor_parallel(rank_main, args.tp, args.device)


if __name__ == "__main__":
    sys.exit(main())
