"""Plain against DFlash decoding of one chat prompt through the Engine on the CPU (SmolLM2 + shipped draft).
Usage: python benchmarks/cpu_spec.py [--max-tokens 64]"""
import argparse

from flashdraft.engine.engine import Engine, Request
from flashdraft.engine.sampling import SamplingParams
from flashdraft.formats.chat import chat_ids
from flashdraft.formats.named import default_draft

ap = argparse.ArgumentParser()
ap.add_argument("--max-tokens", type=int, default=64)
args = ap.parse_args()
engine = Engine.load("smollm2-135m", default_draft("smollm2-135m"), device="cpu")
ids = chat_ids(engine.tokenizer, [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}])
for speculative in (False, True):
    c = engine.generate(Request(prompt_ids=ids, params=SamplingParams(max_tokens=args.max_tokens), speculative=speculative))
    tau = f", mean acceptance length {c.speculative_summary()['mean_acceptance_length']:.2f}" if speculative else ""
    print(f"{'DFlash' if speculative else 'plain '}: {c.timings.to_dict()['predicted_per_second']:.1f} tok/s{tau}")
