"""What the prompt cache saves an agent: a conversation of N turns (each turn appends the model's answer and a new
user message, as coding agents do), with cache_prompt on and off, on a real model with its chat template. Prints,
per turn, the prompt length, the tokens reused (timings.cache_n), the prefill time and whether both answers match.

  python benchmarks/prompt_cache.py [-m smollm2-135m] [--turns 6] [--max-tokens 48] [--device cpu] [--out FILE]
"""
import argparse
import json
import sys
import time
from pathlib import Path

from flashdraft.bench.prompts import SEED_PROMPTS
from flashdraft.engine.engine import Engine, EngineConfig, Request
from flashdraft.engine.sampling import SamplingParams
from flashdraft.formats.chat import chat_ids
from flashdraft.formats.named import default_draft, resolve_model

FOLLOW_UPS = ["Now add type hints everywhere.", "Add docstrings to every function.", "Rename the main class.",
              "Add a command line entry point.", "Write two more tests.", "Explain the design in three sentences.",
              "Make it thread safe.", "Add logging."]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out")
    args = ap.parse_args()
    model = resolve_model(args.model)
    engine = Engine.load(EngineConfig(str(model), draft=default_draft(model), device=args.device, ctx_size=4096,
                                      adaptive=False))
    messages = [{"role": "user", "content": SEED_PROMPTS[0]}]
    rows = []
    for turn in range(args.turns):
        ids = chat_ids(engine.tokenizer, messages)
        out = {}
        for cache in (True, False):
            t = time.perf_counter()
            c = engine.generate(Request(ids, SamplingParams(max_tokens=args.max_tokens), cache_prompt=cache))
            out[cache] = (c, time.perf_counter() - t)
        hit, miss = out[True][0], out[False][0]
        # the cached run went first, so the slot holds this turn for the next one again after the uncached run
        rows.append(dict(turn=turn + 1, prompt_tokens=len(ids), cache_n=hit.timings.cache_n,
                         prefill_ms_cached=hit.timings.prompt_ms, prefill_ms_uncached=miss.timings.prompt_ms,
                         same_answer=hit.token_ids == miss.token_ids))
        r = rows[-1]
        print(f"turn {r['turn']}: prompt {r['prompt_tokens']} tok, reused {r['cache_n']}, prefill "
              f"{r['prefill_ms_cached']:.0f} ms (cache_prompt false: {r['prefill_ms_uncached']:.0f} ms), "
              f"same answer {r['same_answer']}", flush=True)
        messages += [{"role": "assistant", "content": hit.text}, {"role": "user", "content": FOLLOW_UPS[turn]}]
    print("\n| turn | prompt tokens | reused (cache_n) | prefill ms, reused | prefill ms, cache_prompt false | same answer |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['turn']} | {r['prompt_tokens']} | {r['cache_n']} | {r['prefill_ms_cached']:.0f} | "
              f"{r['prefill_ms_uncached']:.0f} | {r['same_answer']} |")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(model=Path(model).name, device=args.device, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
