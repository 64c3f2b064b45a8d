"""Quick acceptance check of a trained draft: greedy speculative decoding through flashdraft's engine on
a few evaluation prompts (the bench's seed prompts, HumanEval, MT-Bench first turns).

    python -m flashdraft.train.evaluate -m TARGET -md DRAFT --data-dir DIR [--per-set 8] [--time-budget-s 60]
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path

import torch

HUMANEVAL_FORMAT = ("Write a solution to the following problem and make sure that it passes the tests:\n"
                    "```python\n{prompt}\n```")  # as the bench words it


def _rows(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def eval_prompts(data_dir: Path | None, per_set: int) -> dict[str, list[str]]:
    """Up to `per_set` prompts of each set found: seed (from the bench, when present), humaneval, mt-bench."""
    sets: dict[str, list[str]] = {}
    try:
        from flashdraft.bench.prompts import SEED_PROMPTS
        sets["seed"] = list(SEED_PROMPTS)[:per_set]
    except ImportError:
        pass
    if data_dir is not None:
        for name in ("HumanEval.jsonl.gz", "HumanEval.jsonl"):
            if (data_dir / name).is_file():
                rows = _rows(data_dir / name)[:per_set]
                sets["humaneval"] = [HUMANEVAL_FORMAT.format(prompt=r["prompt"]) for r in rows]
                break
        if (data_dir / "mt_bench_question.jsonl").is_file():
            sets["mt-bench"] = [r["turns"][0] for r in _rows(data_dir / "mt_bench_question.jsonl")][:per_set]
    return sets


def spec_acceptance(target, tokenizer, draft, sets: dict[str, list[str]], device: str, max_new_tokens: int = 256,
                    time_budget_s: float | None = None, ctx_size: int = 2048) -> dict:
    """Mean acceptance length (bonus token included) per set, greedy; stops starting prompts at the budget
    (sets are interleaved so each gets some)."""
    from flashdraft.engine.engine import Engine, EngineConfig, Request
    from flashdraft.engine.sampling import SamplingParams
    from flashdraft.formats.chat import chat_ids

    engine = Engine(target, tokenizer, draft, EngineConfig(device=device, ctx_size=ctx_size))
    start = time.perf_counter()
    lengths: dict[str, list[int]] = {name: [] for name in sets}
    tokens: dict[str, int] = {name: 0 for name in sets}
    seconds: dict[str, float] = {name: 0.0 for name in sets}
    order = []
    for i in range(max(map(len, sets.values()), default=0)):
        order += [(name, prompts[i]) for name, prompts in sets.items() if i < len(prompts)]
    done = 0
    for name, prompt in order:
        if time_budget_s is not None and time.perf_counter() - start > time_budget_s:
            break
        ids = chat_ids(tokenizer, [{"role": "user", "content": prompt}])[-(ctx_size - max_new_tokens - 1):]
        result = engine.generate(Request(prompt_ids=ids, params=SamplingParams(max_tokens=max_new_tokens)))
        lengths[name] += result.spec.acceptance_lengths
        tokens[name] += len(result.token_ids)
        seconds[name] += result.timings.predicted_ms / 1e3
        done += 1
    report = {}
    for name in sets:
        steps = lengths[name]
        report[name] = dict(mean_acceptance_length=sum(steps) / len(steps) if steps else None,
                            verify_steps=len(steps), tokens=tokens[name],
                            tokens_per_second=tokens[name] / seconds[name] if seconds[name] else None)
    everything = [a for v in lengths.values() for a in v]
    report["all"] = dict(mean_acceptance_length=sum(everything) / len(everything) if everything else None,
                         prompts=done, seconds=time.perf_counter() - start)
    return report


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashdraft.train.evaluate", description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-md", "--draft", required=True)
    ap.add_argument("--data-dir", default=None, help="folder with HumanEval.jsonl.gz and mt_bench_question.jsonl")
    ap.add_argument("--per-set", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--time-budget-s", type=float, default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)
    from flashdraft.args import default_device
    from flashdraft.engine.engine import resolve_dtype
    from flashdraft.formats.loader import load_draft, load_target

    device = default_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    target, tokenizer, _ = load_target(args.model, device, dtype)
    draft = load_draft(args.draft, target, device, dtype)
    sets = eval_prompts(Path(args.data_dir) if args.data_dir else None, args.per_set)
    with torch.inference_mode():
        report = spec_acceptance(target, tokenizer, draft, sets, device, args.max_new_tokens, args.time_budget_s)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
