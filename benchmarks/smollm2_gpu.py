"""SmolLM2-135M-Instruct with its DFlash draft on one GPU: the guide's three prompts without and with
DFlash, acceptance on HumanEval and MT-Bench first turns, and z-lab's reference loop on the same draft.
Usage: python benchmarks/smollm2_gpu.py --model SmolLM2.gguf --draft DRAFT_DIR --data-dir DATA [--out F.json]
"""
import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from flashdraft.bench.prompts import SEED_NAMES, SEED_PROMPTS, load_prompts
from flashdraft.engine.engine import Engine, Request
from flashdraft.engine.sampling import SamplingParams
from flashdraft.formats.chat import chat_ids
from flashdraft.layers import attention
from gpu import hf_model_from  # benchmarks/gpu.py, beside this script


def log(*a):
    print(*a, flush=True)


def pooled_acceptance(lengths: list[list[int]]) -> float:
    steps = [a for run in lengths for a in run]
    return sum(steps) / max(len(steps), 1)


def run_set(engine, prompts: list[list[int]], max_tokens: int, speculative: bool, deadline: float):
    out = []
    for ids in prompts:
        if time.time() > deadline:
            break
        out.append(engine.generate(Request(prompt_ids=ids, params=SamplingParams(max_tokens=max_tokens),
                                           speculative=speculative)))
    return out


def zlab_check(engine, draft_dir: str, prompts: list[list[int]], max_tokens: int, deadline: float) -> dict:
    import transformers
    import dflash.model as zl
    device, dtype = engine.device, engine.target.lm_head.weight.dtype
    if device != "cuda":
        zl._cuda_time = time.perf_counter
    hf = hf_model_from(engine.target, device, dtype)
    dcfg = json.load(open(f"{draft_dir}/config.json"))
    zcfg = transformers.Qwen3Config(**dcfg)
    zcfg._attn_implementation = "sdpa"
    with torch.device(device):
        ref = zl.DFlashDraftModel(zcfg).to(dtype)
    ref.load_state_dict(engine.draft.state_dict())
    ref.eval()
    stop = list(engine.tokenizer.eos_ids)
    lengths, ours_lengths, tokens, seconds, same, per_prompt = [], [], 0, 0.0, 0, []
    ours_tokens, ours_seconds = 0, 0.0
    for ids in prompts:
        if time.time() > deadline:
            break
        x = torch.tensor([ids], device=device)
        r = zl.dflash_generate(ref, hf, x, max_tokens, stop, return_stats=True)
        lengths.append(r.acceptance_lengths)
        tokens += r.num_output_tokens
        seconds += r.time_per_output_token * r.num_output_tokens
        ours = engine.generate(Request(prompt_ids=ids, params=SamplingParams(max_tokens=max_tokens)))
        identical = ours.token_ids == r.output_ids[0, len(ids):].tolist()
        same += identical
        ours_lengths.append(ours.spec.acceptance_lengths)
        ours_tokens += len(ours.token_ids)
        ours_seconds += ours.timings.predicted_ms / 1e3
        per_prompt.append(dict(zlab=pooled_acceptance([r.acceptance_lengths]),
                               ours=pooled_acceptance([ours.spec.acceptance_lengths]), identical=identical))
        log(f"  z-lab {per_prompt[-1]['zlab']:.2f}, flashdraft {per_prompt[-1]['ours']:.2f}, identical {identical}")
    return dict(prompts=len(lengths), mean_acceptance_length=pooled_acceptance(lengths),
                ours_mean_acceptance_length=pooled_acceptance(ours_lengths),
                tok_s=tokens / seconds if seconds else 0.0,
                ours_tok_s=ours_tokens / ours_seconds if ours_seconds else 0.0,
                identical_outputs=same, per_prompt=per_prompt)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--adaptive", action="store_true", help="verify the width that pays best (--spec-dm-adaptive)")
    ap.add_argument("--seeds-only", action="store_true", help="only the guide's three prompts")
    ap.add_argument("--zlab-only", action="store_true", help="only the z-lab cross-check")
    ap.add_argument("--zlab-prompts", type=int, default=10, help="HumanEval and MT-Bench prompts each in the cross-check")
    ap.add_argument("--out")
    args = ap.parse_args()
    start = time.time()
    deadline = start + args.budget_s
    t = time.time()
    engine = Engine.load(args.model, args.draft, device=args.device, dtype="auto", ctx_size=4096, compile=args.compile,
                         adaptive=args.adaptive)
    res = dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__, device=args.device, compile=args.compile,
               adaptive=args.adaptive, attention=attention.KERNEL,
               gpu=torch.cuda.get_device_name() if args.device == "cuda" else None,
               load_and_warmup_s=time.time() - t, warmup_s=engine.startup_s.get("warmup"))
    log(f"loaded + warmed up in {res['load_and_warmup_s']:.1f} s")
    ids = lambda text: chat_ids(engine.tokenizer, [{"role": "user", "content": text}], reasoning="off")

    def save():
        if args.out:
            json.dump(res, open(args.out, "w"), indent=1)

    rows = []
    for name, text in zip(SEED_NAMES, SEED_PROMPTS) if not args.zlab_only else ():
        base, spec = (engine.generate(Request(prompt_ids=ids(text), params=SamplingParams(max_tokens=args.max_tokens),
                                              speculative=s)) for s in (False, True))
        s = spec.speculative_summary()
        rows.append(dict(prompt=name, tokens=len(spec.token_ids), base_tok_s=base.timings.to_dict()["predicted_per_second"],
                         dflash_tok_s=spec.timings.to_dict()["predicted_per_second"],
                         mean_acceptance_length=s["mean_acceptance_length"], acceptance_rate=s["acceptance_rate"],
                         identical=base.token_ids == spec.token_ids, lengths=spec.spec.acceptance_lengths,
                         tokens_sha1=hashlib.sha1(str(spec.token_ids).encode()).hexdigest()[:12]))
        r = rows[-1]
        log(f"{name}: {r['tokens']} tok, baseline {r['base_tok_s']:.1f} tok/s, DFlash {r['dflash_tok_s']:.1f} tok/s "
            f"(x{r['dflash_tok_s'] / r['base_tok_s']:.2f}), tau {r['mean_acceptance_length']:.2f}, identical {r['identical']}, "
            f"tokens {r['tokens_sha1']}")
    res["seed"] = rows
    res["seed_mean_acceptance_length"] = pooled_acceptance([r["lengths"] for r in rows])
    save()
    if args.seeds_only:
        return 0
    for set_name in ("humaneval", "mt-bench") if not args.zlab_only else ():
        prompts = [ids(p.turns[0]) for p in load_prompts(set_name, Path(args.data_dir), fetch=False)]
        done = run_set(engine, prompts, args.max_tokens, True, deadline - 60)
        res[set_name] = dict(prompts=len(done), of=len(prompts),
                             mean_acceptance_length=pooled_acceptance([c.spec.acceptance_lengths for c in done]),
                             dflash_tok_s=sum(len(c.token_ids) for c in done) / max(sum(c.timings.predicted_ms / 1e3 for c in done), 1e-9))
        log(f"{set_name}: {len(done)}/{len(prompts)} prompts, tau {res[set_name]['mean_acceptance_length']:.2f}, "
            f"{res[set_name]['dflash_tok_s']:.1f} tok/s")
        save()
    try:
        cross = [ids(t) for t in SEED_PROMPTS] + [
            ids(p.turns[0]) for name in ("humaneval", "mt-bench")
            for p in load_prompts(name, Path(args.data_dir), fetch=False)[:args.zlab_prompts]]
        res["zlab"] = zlab_check(engine, args.draft, cross, args.max_tokens, deadline)
        log(f"z-lab dflash_generate on the same draft: {res['zlab']}")
    except Exception as e:
        res["zlab_error"] = repr(e)
        log(f"z-lab cross-check failed: {e!r}")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
