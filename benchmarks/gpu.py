"""GPU fast-path measurements: step times against the bandwidth limit and peers. Prints tables; writes JSON with --out.

Sections:
  limits     device-to-device copy bandwidth, bf16 matmul rate, and the weight-read ceiling: every matrix
             product of one decode step (M=1) and one verify step (M=16) replayed as one CUDA graph
  synthetic  random-weight Llama-3.1-8B / Qwen3-8B shapes with a random z-lab Qwen3-8B-shaped DFlash draft:
             decode / verify(16) / draft step times at 1k and 16k context, achieved bandwidth, peak memory
  hf         the same random Llama-3.1-8B weights through HF transformers generate (eager)
  zlab       z-lab's reference dflash_generate loop on the same random Qwen3-8B-shaped target and draft
Usage: python benchmarks/gpu.py --sections limits,synthetic,hf,zlab [--out FILE.json] [--tiny]
"""
import argparse
import json
import statistics
import sys
import time

import torch
from torch.nn import functional as F

from flashdraft.draft import DFlashDraft, DraftConfig, build_target_layer_ids
from flashdraft.engine.generate import prefill
from flashdraft.engine.graphs import GraphCache
from flashdraft.engine.steps import bucket_for, plain_step
from flashdraft.engine.sampling import argmax_rows
from flashdraft.layers import attention
from flashdraft.models.llama import LlamaConfig
from flashdraft.models.llama import Llama

LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
SHAPES = {
    "llama-3.1-8b": LlamaConfig(arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                                rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, max_position_embeddings=131072),
    "qwen3-8b": LlamaConfig(arch="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
                            rope_theta=1e6, qk_norm=True, max_position_embeddings=40960),
    # SmolLM2-135M-Instruct's shape: its rows of 576 values are not whole 256-blocks (gguf_gpu make: Q4_1, Q8_0)
    "smollm2-135m": LlamaConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                                rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=8192),
}
TINY = {
    "llama-3.1-8b": LlamaConfig(arch="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=6,
                                num_heads=4, num_kv_heads=2, head_dim=16, rope_scaling=LLAMA3_ROPE),
    "qwen3-8b": LlamaConfig(arch="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=6,
                            num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True),
}


def log(*a):
    print(*a, flush=True)


def timed(fn, iters: int, device: str) -> float:
    """Median milliseconds of fn() over iters runs (events on CUDA, wall clock elsewhere)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); fn(); b.record(); b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter(); fn(); times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def graphed(fn, device: str):
    """Capture fn() (no inputs) as one CUDA graph and return its replay; eager elsewhere."""
    if device != "cuda":
        return fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def random_target(cfg: LlamaConfig, device: str, dtype: torch.dtype) -> Llama:
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(cfg).to(dtype)
    return model.eval()


def draft_for(target_cfg: LlamaConfig, device: str, dtype: torch.dtype, tiny: bool) -> DFlashDraft:
    hidden = target_cfg.hidden_size
    layers = 5
    hf = dict(architectures=["DFlashDraftModel"], hidden_size=hidden,
              intermediate_size=128 if tiny else 12288, num_hidden_layers=layers,
              num_attention_heads=4 if tiny else 32, num_key_value_heads=2 if tiny else 8,
              head_dim=16 if tiny else 128, vocab_size=target_cfg.vocab_size, rope_theta=1e6,
              num_target_layers=target_cfg.num_layers, block_size=16, rms_norm_eps=1e-6,
              dflash_config=dict(mask_token_id=target_cfg.vocab_size - 1,
                                 target_layer_ids=build_target_layer_ids(target_cfg.num_layers, layers)))
    torch.manual_seed(1)
    with torch.device(device):
        draft = DFlashDraft(DraftConfig.from_hf(hf)).to(dtype)
    return draft.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one decode step must read: every matrix but the embedding table (one row of it is read)."""
    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" not in name:
            total += p.numel() * p.element_size()
    if model.cfg.tie_word_embeddings:
        total += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    return total


def section_limits(args, results):
    dev, dtype = args.device, torch.bfloat16
    n = (2 << 30) // 2 if not args.tiny else 1 << 20
    x = torch.randn(n, device=dev, dtype=dtype)
    y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x), 20, dev)
    copy_bw = 2 * x.numel() * 2 / (ms * 1e-3)
    size = 8192 if not args.tiny else 256
    a = torch.randn(size, size, device=dev, dtype=dtype)
    b = torch.randn(size, size, device=dev, dtype=dtype)
    ms_mm = timed(lambda: a @ b, 10, dev)
    tflops = 2 * size ** 3 / (ms_mm * 1e-3) / 1e12
    shapes = TINY if args.tiny else SHAPES
    cfg = shapes["llama-3.1-8b"]
    model = random_target(cfg, dev, dtype)
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    ceiling = {}
    for m in (1, 16):
        inp = {w.shape[1]: torch.randn(m, w.shape[1], device=dev, dtype=dtype) for w in weights}
        def all_products():
            for w in weights:
                F.linear(inp[w.shape[1]], w)
        ceiling[m] = timed(graphed(all_products, dev), 20, dev)
    del model, weights
    results["limits"] = dict(copy_bandwidth_GBps=copy_bw / 1e9, bf16_matmul_TFLOPs=tflops,
                             weight_read_ceiling_ms_m1=ceiling[1], weight_read_ceiling_ms_m16=ceiling[16],
                             weight_bytes_llama8b=nbytes, weight_read_GBps=nbytes / (ceiling[1] * 1e-3) / 1e9)
    log(f"\n== limits ({torch.cuda.get_device_name() if dev == 'cuda' else dev})")
    log(f"device-to-device copy        {copy_bw / 1e9:8.1f} GB/s (read + write)")
    log(f"bf16 matmul {size}^3           {tflops:8.1f} TFLOP/s")
    log(f"weight-read ceiling (Llama-3.1-8B linears, one CUDA graph): M=1 {ceiling[1]:.3f} ms, "
        f"M=16 {ceiling[16]:.3f} ms ({nbytes / 1e9:.2f} GB, {nbytes / (ceiling[1] * 1e-3) / 1e9:.0f} GB/s)")


def section_synthetic(args, results):
    dev, dtype = args.device, torch.bfloat16
    shapes = TINY if args.tiny else SHAPES
    ctxs = [int(c) for c in args.ctxs.split(",")] if not args.tiny else [64, 300]
    rows = []
    for name, cfg in shapes.items():
        if args.models and name not in args.models.split(","):
            continue
        torch.cuda.empty_cache() if dev == "cuda" else None
        target = random_target(cfg, dev, dtype)
        draft = draft_for(cfg, dev, dtype, args.tiny)
        nbytes = weight_bytes(target)
        max_len = max(ctxs) + 256
        t0 = time.perf_counter()
        draft.setup_cache(max_len)
        compiled = [False] + ([True] if name in args.compile.split(",") else [])
        caches = [tuple(p.split("/")) for p in args.cache_types.split(",")]
        variants = [(c, kernel, kv) for c in compiled for kernel in args.attention.split(",") for kv in caches]
        for use_compile, kernel, kv in variants:
            label = name + ("+compile" if use_compile else "") + f" ({kernel} attention)"
            label += "" if kv == ("auto", "auto") else f" KV {kv[0]}/{kv[1]}"
            state = None
            torch.cuda.empty_cache() if dev == "cuda" else None
            state = target.new_state(1, max_len, kv)
            attention.KERNEL = kernel
            if use_compile and target.compiled_layer is None:
                target.compile_layers((1, 16))
                draft.compile_layers()
            for ctx in ctxs:
                if dev == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                prompt = torch.randint(0, cfg.vocab_size - 1, (ctx,), device=dev)
                draft.reset(0)
                prefill(target, state, prompt, 0, draft=draft)
                graphs = GraphCache(dev)
                tok = torch.tensor([5], device=dev)
                pos = torch.tensor([ctx], device=dev)
                bucket = bucket_for(ctx + 16, max_len)
                block = torch.randint(0, cfg.vocab_size - 1, (16,), device=dev)
                positions = torch.arange(ctx, ctx + 16, device=dev)
                ids = draft.cfg.target_layer_ids

                def decode_step():
                    return graphs.run(("plain", bucket, label), lambda t, p: plain_step(target, state, t, p, 0, bucket),
                                      [tok, pos])

                def verify_step():
                    return graphs.run(("verify", bucket, label),
                                      lambda b, p: target(b[None], p[None], state, 0, capture=ids, attn_len=bucket),
                                      [block, positions])

                def draft_step():
                    def fn(b, p):
                        h = draft(target.token_embedding(b), p, 0, None, bucket)  # the ring up to the bucket
                        return (argmax_rows(draft.compute_logits(h[1:], target.logits)),)
                    return graphs.run(("draft", label), fn, [block, positions])

                t_capture = time.perf_counter()
                for f in (decode_step, verify_step, draft_step):
                    f()
                capture_s = time.perf_counter() - t_capture
                iters = 30 if not args.tiny else 5
                ms_decode, ms_verify, ms_draft = (timed(f, iters, dev) for f in (decode_step, verify_step, draft_step))
                peak = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else 0.0
                row = dict(model=label, ctx=ctx, decode_ms=ms_decode, decode_tok_s=1e3 / ms_decode,
                           bandwidth_GBps=nbytes / (ms_decode * 1e-3) / 1e9, verify16_ms=ms_verify,
                           verify_over_decode=ms_verify / ms_decode, draft_ms=ms_draft, draft_over_decode=ms_draft / ms_decode,
                           peak_mem_GiB=peak, weight_GB=nbytes / 1e9, graph_capture_s=capture_s)
                lim = results.get("limits")
                if lim:
                    row["fraction_of_copy_bw"] = row["bandwidth_GBps"] / lim["copy_bandwidth_GBps"]
                    if name == "llama-3.1-8b":
                        row["decode_over_weight_ceiling"] = ms_decode / lim["weight_read_ceiling_ms_m1"]
                rows.append(row)
                log(f"{label} ctx {ctx}: decode {ms_decode:.3f} ms ({1e3 / ms_decode:.1f} tok/s, "
                    f"{row['bandwidth_GBps']:.0f} GB/s), verify16 {ms_verify:.3f} ms (x{row['verify_over_decode']:.3f}), "
                    f"draft {ms_draft:.3f} ms (x{row['draft_over_decode']:.3f}), peak {peak:.1f} GiB, "
                    f"capture {capture_s:.1f} s")
        log(f"{name}: setup {time.perf_counter() - t0:.1f} s")
        del target, draft
    results["synthetic"] = rows
    log("\n| model | ctx | decode ms | tok/s | GB/s | decode/ceiling | verify16/decode | draft/decode | peak GiB | capture s |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ceiling = f"{r['decode_over_weight_ceiling']:.3f}" if "decode_over_weight_ceiling" in r else "-"
        log(f"| {r['model']} | {r['ctx']} | {r['decode_ms']:.3f} | {r['decode_tok_s']:.1f} | {r['bandwidth_GBps']:.0f} | "
            f"{ceiling} | {r['verify_over_decode']:.3f} | {r['draft_over_decode']:.3f} | {r['peak_mem_GiB']:.1f} | "
            f"{r['graph_capture_s']:.1f} |")


def hf_model_from(target: Llama, device: str, dtype: torch.dtype):
    import transformers
    c = target.cfg
    common = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                  num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                  head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                  max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings)
    if c.arch == "qwen3":
        cfg = transformers.Qwen3Config(**common)
        cls = transformers.Qwen3ForCausalLM
    else:
        cfg = transformers.LlamaConfig(**common, rope_scaling=c.rope_scaling)
        cfg.max_position_embeddings = max(c.max_position_embeddings, 8192)
        cls = transformers.LlamaForCausalLM
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = cls(cfg).to(dtype)
    model.load_state_dict(target.state_dict(), strict=False)
    return model.eval()


def section_hf(args, results):
    dev, dtype = args.device, torch.bfloat16
    cfg = (TINY if args.tiny else SHAPES)["llama-3.1-8b"]
    target = random_target(cfg, dev, dtype)
    hf = hf_model_from(target, dev, dtype)
    prompt_len = 1024 if not args.tiny else 32
    ids = torch.randint(0, cfg.vocab_size - 1, (1, prompt_len), device=dev)
    new = 64 if not args.tiny else 8

    def gen(n, **kw):
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)

    def tok_s(**kw) -> float:
        for n in (1, new + 1):  # a static cache is sized by the request: warm (compile) each size first
            gen(n, **kw)
        t = []
        for n in (1, new + 1):  # the difference leaves the prefill out
            if dev == "cuda":
                torch.cuda.synchronize()
            s = time.perf_counter(); gen(n, **kw)
            if dev == "cuda":
                torch.cuda.synchronize()
            t.append(time.perf_counter() - s)
        return new / (t[1] - t[0])

    out = dict(prompt_len=prompt_len, new_tokens=new, hf_eager_tok_s=tok_s())
    log(f"\n== HF transformers generate, Llama-3.1-8B shape, {prompt_len}-token prompt: eager {out['hf_eager_tok_s']:.1f} tok/s")
    if args.hf_static:
        try:  # transformers compiles the forward itself when the cache is static
            out["hf_static_compile_tok_s"] = tok_s(cache_implementation="static")
            log(f"HF static cache + torch.compile: {out['hf_static_compile_tok_s']:.1f} tok/s")
        except Exception as e:
            out["hf_static_compile_error"] = repr(e)[:300]
            log(f"HF static cache + torch.compile failed: {e!r:.300}")
    del hf
    # flashdraft's baseline on the same weights and context: CUDA graphs, then graphs over compiled layers
    state = target.new_state(1, prompt_len + 512)
    prefill(target, state, ids[0], 0)
    graphs = GraphCache(dev)
    bucket = bucket_for(prompt_len + 1, state.max_len)
    tok, pos = torch.tensor([5], device=dev), torch.tensor([prompt_len], device=dev)
    for label in ("graphs", "graphs+compile") if dev == "cuda" else ("graphs",):
        if label == "graphs+compile":
            target.compile_layers((1, 16))
        ms = timed(lambda: graphs.run(("plain", bucket, label), lambda a, p: plain_step(target, state, a, p, 0, bucket),
                                      [tok, pos]), 30, dev)
        out[f"flashdraft_{label}_tok_s"] = 1e3 / ms
        out[f"ratio_{label}_over_hf_eager"] = (1e3 / ms) / out["hf_eager_tok_s"]
        log(f"flashdraft baseline ({label}): {1e3 / ms:.1f} tok/s (x{(1e3 / ms) / out['hf_eager_tok_s']:.1f} HF eager"
            + (f", x{(1e3 / ms) / out['hf_static_compile_tok_s']:.1f} HF static+compile)" if "hf_static_compile_tok_s" in out
               else ")"))
    results["hf"] = out


def section_zlab(args, results):
    import transformers
    import dflash.model as zl
    dev, dtype = args.device, torch.bfloat16
    if dev != "cuda":
        zl._cuda_time = time.perf_counter
    cfg = (TINY if args.tiny else SHAPES)["qwen3-8b"]
    target = random_target(cfg, dev, dtype)
    draft = draft_for(cfg, dev, dtype, args.tiny)
    hf = hf_model_from(target, dev, dtype)
    zcfg = transformers.Qwen3Config(**draft.cfg.to_hf())
    zcfg._attn_implementation = "sdpa"
    with torch.device(dev):
        ref = zl.DFlashDraftModel(zcfg).to(dtype)
    ref.load_state_dict(draft.state_dict())
    ref = ref.eval()
    prompt_len = 1024 if not args.tiny else 32
    ids = torch.randint(0, cfg.vocab_size - 1, (1, prompt_len), device=dev)
    n = 48 if not args.tiny else 8
    zl.dflash_generate(ref, hf, ids, 4, None, return_stats=True)
    spec = zl.dflash_generate(ref, hf, ids, n, None, return_stats=True)
    plain = zl.dflash_generate(ref, hf, ids, n, None, block_size=1, return_stats=True)
    cycle_ref = spec.time_per_output_token * spec.num_output_tokens / len(spec.acceptance_lengths)
    # flashdraft: one draft+verify cycle as graphs, plus the eager acceptance bookkeeping
    from flashdraft.engine.generate import SpecStats, decode
    from flashdraft.engine.sampling import SamplingParams
    from flashdraft.engine.steps import Steps
    draft.setup_cache(prompt_len + 256)
    if dev == "cuda" and args.compile:
        target.compile_layers((1, 16))
        draft.compile_layers()
    steps = Steps(target, target.new_state(1, prompt_len + 256), draft, dev)
    list(decode(steps, ids[0], SamplingParams(max_tokens=n)))
    stats = SpecStats()
    if dev == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = sum(len(x) for x in decode(steps, ids[0], SamplingParams(max_tokens=n), stats=stats))
    if dev == "cuda":
        torch.cuda.synchronize()
    total = time.perf_counter() - t
    t2 = time.perf_counter()
    list(decode(steps, ids[0], SamplingParams(max_tokens=1)))
    if dev == "cuda":
        torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t2
    cycle_ours = (total - prefill_s) / max(len(stats.acceptance_lengths), 1)
    results["zlab"] = dict(ref_ms_per_plain_step=1e3 * plain.time_per_output_token,
                           ref_ms_per_cycle=1e3 * cycle_ref, ours_ms_per_cycle=1e3 * cycle_ours,
                           ratio=cycle_ref / cycle_ours, ours_tokens=out,
                           ref_mean_acceptance=statistics.mean(spec.acceptance_lengths),
                           ours_mean_acceptance=statistics.mean(stats.acceptance_lengths))
    log(f"\n== z-lab dflash_generate (transformers backend), Qwen3-8B shape, random weights: "
        f"{1e3 * plain.time_per_output_token:.1f} ms per plain step, {1e3 * cycle_ref:.1f} ms per draft+verify cycle; "
        f"flashdraft {1e3 * cycle_ours:.2f} ms per cycle (x{cycle_ref / cycle_ours:.1f})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="limits,synthetic,hf,zlab")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke test of this script on CPU")
    ap.add_argument("--models", default="", help="comma-separated subset of the synthetic section's models")
    ap.add_argument("--ctxs", default="1024,16384", help="context lengths of the synthetic section")
    ap.add_argument("--compile", default="",
                    help="comma-separated model names measured a second time with torch.compile'd layers")
    ap.add_argument("--attention", default="split,matmul",
                    help="attention kernels of the few-token steps to compare: split (Triton split-K), matmul")
    ap.add_argument("--hf-static", action="store_true",
                    help="also time HF generate with a static cache (transformers then torch.compiles the forward)")
    ap.add_argument("--cache-types", default="auto/auto",
                    help="KV cache K/V type pairs of the synthetic section, comma-separated (e.g. auto/auto,q8_0/q8_0)")
    ap.add_argument("--out")
    args = ap.parse_args()
    results = dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__, device=args.device)
    if args.device == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
    with torch.inference_mode():
        for name in args.sections.split(","):
            try:
                globals()[f"section_{name}"](args, results)
            except Exception as e:  # keep the other sections' numbers
                log(f"section {name} failed: {type(e).__name__}: {e}")
                results[f"{name}_error"] = repr(e)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
