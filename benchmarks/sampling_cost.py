"""The sampled path's cost beside the greedy one on a GPU, per call as the decode loop makes it, for one row (a plain
step) and a 16-row verify block, vocabularies 262144 and 49152:
- `argmax eager`: greedy_tokens launched eagerly (the greedy path before the captured sampler);
- `greedy graph`, `guide graph`, ...: the captured sampler (Steps.sample: the inputs copied into its buffers, one
  graph replay; engine/sampling.DeviceSampler), greedy and for the settings below;
- `guide eager`: the same sampler's operations launched eagerly (the race in its Triton kernel).
Settings: guide = the README's (temperature 0.7, top-k 64, top-p 0.95, min-p 0); issue = issue 44's (temperature
0.7, top-k 40, top-p 0.95, min-p 0.05); +pen = issue with repeat penalty 1.1 over 64 tokens and a logit_bias;
temp = temperature 0.8 alone (the race over the whole vocabulary); top-p = temperature 0.8, top-p 0.95 (a sort of
the vocabulary). Times are medians of CUDA-event spans (microseconds), which include the launches' host time where
the GPU waits for them, as the decode loop does.
Usage: python benchmarks/sampling_cost.py [--vocab 262144,49152] [--iters 200] [--device cuda]
(--device cpu: a dry run of the same calls, eager, for checking the script; its times mean nothing)"""
import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu import timed  # noqa: E402

from flashdraft.engine.graphs import GraphCache  # noqa: E402
from flashdraft.engine.sampling import SamplingParams, greedy_tokens  # noqa: E402
from flashdraft.engine.steps import Steps  # noqa: E402

GUIDE = SamplingParams(temperature=0.7, top_k=64, top_p=0.95, min_p=0.0)
ISSUE = SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05)
SETTINGS = {"greedy": SamplingParams(), "guide": GUIDE, "issue": ISSUE,
            "issue+pen": SamplingParams(**{**ISSUE.__dict__, "repeat_penalty": 1.1, "repeat_last_n": 64,
                                           "logit_bias": {5: 2.0, 7: float("-inf")}}),
            "temp": SamplingParams(temperature=0.8), "top-p": SamplingParams(temperature=0.8, top_p=0.95)}
BLOCK = 16


def sampler_call(vocab: int, rows: int, p: SamplingParams, graphs: bool, device: str):
    """A closure making one Steps.sample call as decode does (a one-row call commits its token for the penalties;
    a block passes its drafted tokens), on a Steps whose sampler serves one slot of a 4096-token context."""
    state = SimpleNamespace(max_len=4096, layers=[])  # no target: only the sampler's part of Steps runs
    steps = Steps(None, state, SimpleNamespace(block_size=BLOCK, target_layers=()), device)
    if not graphs:
        steps.graphs = GraphCache("cpu")  # the same operations on CUDA tensors, launched eagerly
    prompt = torch.randint(0, vocab, (200,), device=device)
    steps.sampler(0, vocab).begin(p, 1234, prompt)
    logits = torch.randn(rows, vocab, device=device) * 3
    positions = torch.arange(199, 199 + rows, device=device)
    drafted = torch.randint(0, vocab, (rows - 1,), device=device) if rows > 1 else None
    return lambda: steps.sample(0, logits, positions, drafted, commit=rows == 1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", default="262144,49152")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = args.device
    graphed = list(SETTINGS)
    name = torch.cuda.get_device_name() if dev == "cuda" else dev
    print(f"# {name}, torch {torch.__version__}")
    print("| vocab | rows | argmax eager | " + " | ".join(f"{n} graph" for n in graphed) + " | guide eager |")
    print("|---|---|---|" + "---|" * len(graphed) + "---|")
    for vocab in map(int, args.vocab.split(",")):
        for rows in (1, BLOCK):
            logits = torch.randn(rows, vocab, device=dev) * 3
            cells = [timed(lambda: greedy_tokens(logits), args.iters, dev)]
            cells += [timed(sampler_call(vocab, rows, SETTINGS[n], True, dev), args.iters, dev) for n in graphed]
            cells.append(timed(sampler_call(vocab, rows, GUIDE, False, dev), args.iters, dev))
            print(f"| {vocab} | {rows} | " + " | ".join(f"{ms * 1e3:.1f}" for ms in cells) + " |")
    print("(microseconds a call; the sampled path's extra cost a token is `guide graph` - `greedy graph`)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
