"""`flashdraft make-data`: regenerate the responses to training prompts with the target itself.

Each prompt is rendered with the target's chat template and answered by the target (greedy by default),
in batches. A record is one JSON line: `input_ids` (prompt + response) and `loss_mask` (1 on the response
tokens only, the closing end-of-turn token included). The output is appended batch by batch, so an
interrupted run resumes by skipping the prompt ids already in the file.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from flashdraft.train.prompts import MBPP_TRAIN_IDS, TrainPrompt, load_prompts, parse_id_range, shuffled



@dataclass
class GenOptions:
    batch_size: int = 256
    max_new_tokens: int = 512
    max_prompt_len: int = 1024
    temperature: float = 0.0
    top_p: float = 1.0
    backend: str = "auto"  # auto (batched; hf for top-p), batched, hf, flashdraft
    time_budget_s: float | None = None
    system: str | None = None


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------
# Records on disk
# ---------------------------------------------------------------------------------------------------------


def open_text(path: Path, mode: str):
    return gzip.open(path, mode + "t", encoding="utf-8") if path.suffix == ".gz" else open(path, mode, encoding="utf-8")


def is_token_file(path: Path) -> bool:
    """Whether a --data file holds generated records (token ids) rather than prompts."""
    if path.suffix not in (".jsonl", ".gz"):
        return False
    with open_text(path, "r") as f:
        for line in f:
            if line.strip():
                try:
                    return "input_ids" in json.loads(line)
                except json.JSONDecodeError:
                    return False
    return False


def read_done_ids(path: Path) -> set[str]:
    """Prompt ids already answered in an output file. A torn last line (a run killed while writing) is cut off."""
    if not path.is_file():
        return set()
    done, good_bytes = set(), 0
    with open(path, "rb") as f:
        raw = gzip.decompress(f.read()) if path.suffix == ".gz" else f.read()
    for line in raw.splitlines(keepends=True):
        try:
            done.add(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError):
            break
        good_bytes += len(line)
    if good_bytes < len(raw) and path.suffix != ".gz":
        log(f"[make-data] {path}: dropping a partial last record")
        with open(path, "r+b") as f:
            f.truncate(good_bytes)
    return done


def load_records(paths: list[str | Path], max_length: int | None = None) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of every record in the files, cut to max_length tokens."""
    out = []
    for path in map(Path, paths):
        with open_text(path, "r") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    log(f"[train] {path}:{n}: skipping an unreadable line")
                    continue
                ids, mask = row["input_ids"], row["loss_mask"]
                if len(ids) != len(mask):
                    raise ValueError(f"{path}:{n}: input_ids and loss_mask differ in length")
                if max_length is not None:
                    ids, mask = ids[:max_length], mask[:max_length]
                out.append((ids, mask))
    return out


def make_record(prompt: TrainPrompt, prompt_ids: list[int], response: list[int], finish: str) -> dict:
    return dict(id=prompt.id, source=prompt.source, input_ids=prompt_ids + response,
                loss_mask=[0] * len(prompt_ids) + [1] * len(response), prompt_len=len(prompt_ids), finish=finish)


# ---------------------------------------------------------------------------------------------------------
# Generation backends: (prompt id lists) -> (response id lists, finish reasons)
# ---------------------------------------------------------------------------------------------------------

POOL_ROUNDS = 8
Generator = Callable[[list[list[int]]], list[tuple[list[int], str]]]


def cut_at_eos(tokens: list[int], eos: set[int]) -> tuple[list[int], str]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1], "stop"
    return tokens, "length"


def hf_model_from_target(target, device: str | torch.device, dtype: torch.dtype):
    """A transformers causal LM with the target's weights (they already carry HF names)."""
    import transformers

    from flashdraft.models.registry import family_for

    cfg = target.cfg
    hf_class = family_for(cfg.arch).hf_classes[cfg.arch]
    hf_cfg = transformers.AutoConfig.for_model(
        cfg.arch, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        rope_scaling=cfg.rope_scaling, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=cfg.o_bias, mlp_bias=cfg.mlp_bias,
        sliding_window=cfg.sliding_window, use_sliding_window=cfg.sliding_window is not None,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_ids or None)
    hf_cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = getattr(transformers, hf_class)(hf_cfg).to(dtype)
    state = {k: v for k, v in target.state_dict().items() if "rotary" not in k}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if "rotary" not in k and not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"target weights do not fit {hf_class}: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    return model.eval()


def hf_generator(target, eos: list[int], opts: GenOptions, device: str, dtype: torch.dtype) -> Generator:
    model = hf_model_from_target(target, device, dtype)
    pad = eos[0]
    eos_set = set(eos)

    @torch.inference_mode()
    def run(prompts: list[list[int]]) -> list[tuple[list[int], str]]:
        width = max(map(len, prompts))
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p):] = torch.tensor(p)
            attention[i, width - len(p):] = 1
        sampling = dict(do_sample=True, temperature=opts.temperature, top_p=opts.top_p, top_k=0) \
            if opts.temperature > 0 else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        out = model.generate(input_ids=ids.to(device), attention_mask=attention.to(device),
                             max_new_tokens=opts.max_new_tokens, eos_token_id=eos, pad_token_id=pad, **sampling)
        return [cut_at_eos(row, eos_set) for row in out[:, width:].tolist()]

    return run


def flashdraft_generator(target, eos: list[int], opts: GenOptions, device: str) -> Generator:
    """One prompt at a time through the engine's decode loop (a slow reference for the batched backends)."""
    from flashdraft.engine.generate import decode
    from flashdraft.engine.sampling import SamplingParams
    from flashdraft.engine.steps import Steps

    eos_set = set(eos)
    steps = Steps(target, target.new_state(1, opts.max_prompt_len + opts.max_new_tokens + 1), device=device)
    params = SamplingParams(temperature=opts.temperature, top_p=opts.top_p, max_tokens=opts.max_new_tokens)
    generator = torch.Generator(device=device).manual_seed(0) if opts.temperature > 0 else None

    def run(prompts: list[list[int]]) -> list[tuple[list[int], str]]:
        results = []
        for p in prompts:
            tokens: list[int] = []
            loop = decode(steps, torch.tensor(p, device=device), params, generator=generator)
            for new in loop:
                tokens += new
                if eos_set & set(new):
                    loop.close()
                    break
            results.append(cut_at_eos(tokens, eos_set))
        return results

    return run


def batched_generator(target, eos: list[int], opts: GenOptions, device: str) -> Generator:
    from flashdraft.train.batchgen import batch_generate

    eos_set = set(eos)

    def run(prompts: list[list[int]]) -> list[tuple[list[int], str]]:
        rows = -(-len(prompts) // POOL_ROUNDS)
        answers = batch_generate(target, prompts, opts.max_new_tokens, eos, rows, opts.temperature)
        return [cut_at_eos(a, eos_set) for a in answers]

    return run


def resolve_backend(opts: GenOptions) -> str:
    if opts.backend == "auto":
        return "batched" if opts.top_p >= 1.0 else "hf"
    return opts.backend


def make_generator(target, eos: list[int], opts: GenOptions, device: str, dtype: torch.dtype) -> Generator:
    backend = resolve_backend(opts)
    if backend == "batched":
        return batched_generator(target, eos, opts, device)
    if backend == "hf":
        return hf_generator(target, eos, opts, device, dtype)
    if backend == "flashdraft":
        return flashdraft_generator(target, eos, opts, device)
    raise ValueError(f"unknown generation backend {backend!r} (auto, batched, hf, flashdraft)")


# ---------------------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------------------


def render(tokenizer, prompt: TrainPrompt, system: str | None) -> list[int]:
    from flashdraft.formats.chat import chat_ids

    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt.text}]
    return chat_ids(tokenizer, messages)


def generate_records(target, tokenizer, prompts: list[TrainPrompt], out: Path, opts: GenOptions,
                     device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict:
    """Answer the prompts not yet in `out` and append their records; stops early at the time budget.
    Returns counts for the log."""
    start = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    done = read_done_ids(out)
    todo = []
    skipped_long = 0
    for p in prompts:
        if p.id in done:
            continue
        ids = render(tokenizer, p, opts.system)
        if len(ids) > opts.max_prompt_len:
            skipped_long += 1
            continue
        todo.append((p, ids))
    stats = dict(already=len(done), todo=len(todo), skipped_long=skipped_long, written=0, tokens=0, stopped_early=False)
    log(f"[make-data] {len(done)} records already in {out}; {len(todo)} prompts to answer"
        + (f" ({skipped_long} longer than {opts.max_prompt_len} tokens skipped)" if skipped_long else ""))
    if not todo:
        return stats
    if not tokenizer.eos_ids:
        raise ValueError("the tokenizer names no end-of-turn token; cannot tell where a response ends")
    generate = make_generator(target, list(tokenizer.eos_ids), opts, device, dtype)
    # The batched backend keeps a pool of batch_size rows busy over POOL_ROUNDS times as many prompts a call.
    rounds = POOL_ROUNDS if resolve_backend(opts) == "batched" else 1
    batch_size = opts.batch_size * rounds
    # Sort within windows of two batches: less padding, while the given order (priorities) mostly holds.
    window = batch_size * 2
    order = []
    for w in range(0, len(todo), window):
        order += sorted(todo[w:w + window], key=lambda item: len(item[1]))
    i, last_batch_s = 0, 0.0
    with open_text(out, "a") as f:
        while i < len(order):
            elapsed = time.perf_counter() - start
            if opts.time_budget_s is not None and elapsed + last_batch_s > opts.time_budget_s:
                stats["stopped_early"] = True
                log(f"[make-data] time budget reached after {elapsed:.0f} s; rerun to continue")
                break
            batch = order[i:i + batch_size]
            t0 = time.perf_counter()
            try:
                answers = generate([ids for _, ids in batch])
            except torch.cuda.OutOfMemoryError:
                if batch_size <= rounds:
                    raise
                batch_size = max(rounds, batch_size // 2)
                torch.cuda.empty_cache()
                log(f"[make-data] out of memory; batch size now {batch_size}")
                continue
            for (prompt, ids), (response, finish) in zip(batch, answers):
                f.write(json.dumps(make_record(prompt, ids, response, finish)) + "\n")
                stats["tokens"] += len(response)
            f.flush()
            i += len(batch)
            stats["written"] += len(batch)
            last_batch_s = time.perf_counter() - t0
            total = time.perf_counter() - start
            log(f"[make-data] {stats['written']}/{len(order)} prompts, {stats['tokens']} response tokens, "
                f"{total:.0f} s, {stats['tokens'] / max(total, 1e-9):.0f} tok/s")
    return stats


def add_generation_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("response regeneration")
    g.add_argument("--gen-batch-size", type=int, default=256, help="sequences decoded together (the batched backend refills a row as soon as its answer ends)")
    g.add_argument("--max-new-tokens", type=int, default=512)
    g.add_argument("--max-prompt-len", type=int, default=1024, help="skip longer prompts (tokens)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--gen-backend", choices=["auto", "batched", "hf", "flashdraft"], default="auto",
                   help="batched: own static-cache batched decoding (default); hf: transformers generate with the "
                        "target's weights (needed for --top-p); flashdraft: the engine's decode loop, one prompt "
                        "at a time")
    g.add_argument("--gen-time-budget-s", type=float, default=None, help="stop starting batches after this long")
    g.add_argument("--system", default=None, help="system message for every prompt (default: the template's)")
    g.add_argument("--limit", type=int, default=None, help="use at most this many prompts (after the seeded shuffle)")
    g.add_argument("--mbpp-task-ids", default=f"{MBPP_TRAIN_IDS[0]}-{MBPP_TRAIN_IDS[1]}",
                   help="MBPP task ids that may train (ids below 601 are evaluation data and refused)")


def gen_options(args: argparse.Namespace) -> GenOptions:
    return GenOptions(batch_size=args.gen_batch_size, max_new_tokens=args.max_new_tokens,
                      max_prompt_len=args.max_prompt_len, temperature=args.temperature, top_p=args.top_p,
                      backend=args.gen_backend, time_budget_s=args.gen_time_budget_s, system=args.system)


def collect_prompts(args: argparse.Namespace, files: list[str]) -> list[TrainPrompt]:
    prompts = load_prompts(files, parse_id_range(args.mbpp_task_ids))
    return shuffled(prompts, args.seed, args.limit)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="flashdraft make-data",
                                 description="Regenerate training responses with the target (token ids + loss mask).")
    ap.add_argument("-m", "--model", help="target: GGUF file, HF folder, or a named model")
    ap.add_argument("--data", nargs="+", required=True,
                    help="prompt files (JSON/JSONL: Alpaca, ShareGPT, GSM8K, MBPP, `prompt`), or `code` for the "
                         "built-in code instructions")
    ap.add_argument("--out", required=True, help="output JSONL (.jsonl or .jsonl.gz); appended to, resumable")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--export-prompts", action="store_true",
                    help="write the selected prompts as {id, source, prompt} JSONL to --out and stop (no model)")
    add_generation_args(ap)
    args = ap.parse_args(argv)

    prompts = collect_prompts(args, args.data)
    out = Path(args.out)
    if args.export_prompts:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open_text(out, "w") as f:
            for p in prompts:
                f.write(json.dumps(dict(id=p.id, source=p.source, prompt=p.text)) + "\n")
        log(f"[make-data] wrote {len(prompts)} prompts to {out}")
        return 0
    if not args.model:
        ap.error("-m/--model is required unless --export-prompts")
    from flashdraft.args import default_device
    from flashdraft.engine.engine import resolve_dtype
    from flashdraft.formats.loader import load_target

    device = default_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    t0 = time.perf_counter()
    target, tokenizer, _ = load_target(args.model, device, dtype)
    log(f"[make-data] target loaded in {time.perf_counter() - t0:.0f} s; {len(prompts)} prompts")
    generate_records(target, tokenizer, prompts, out, gen_options(args), device, dtype)
    return 0
