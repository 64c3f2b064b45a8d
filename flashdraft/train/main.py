"""`flashdraft train-draft`: train a DFlash draft for a target (recipe: dflash.md section 4), or with
`--dflash2` a DFlash2 draft (speculators' objective, train/blocks.py).

Prompt files are first answered by the target (the make-data stage, resumable); files of generated
records are used as they are. The target stays frozen; its features are computed on the fly for every
batch; anchors are redrawn every step. The output folder is a z-lab draft folder.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from flashdraft.draft import DFlashDraft, DraftConfig, load_draft_folder
from flashdraft.train.blocks import Batch, StepOutput, all_anchors, blocks_step, collate, sample_anchors
from flashdraft.train.checkpoint import checkpoint_folder, read_checkpoint, save_checkpoint, save_draft
from flashdraft.train.data import (add_generation_args, collect_prompts, gen_options, generate_records,
                                   is_token_file, load_records, log)
from flashdraft.train.draft_config import DFLASH2_DEFAULTS, build_draft_config, parse_layer_ids
from flashdraft.train.features import target_features

Record = tuple[list[int], list[int]]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="flashdraft train-draft", description="Train a DFlash draft for a target.")
    ap.add_argument("-m", "--model", required=True, help="target: GGUF file, HF folder, or a named model")
    ap.add_argument("--data", nargs="+", required=True,
                    help="generated records (make-data JSONL) and/or prompt files (answered by the target first), "
                         "or `code` for the built-in code instructions")
    ap.add_argument("--out", required=True, help="output folder: the draft, checkpoint/, logs")
    ap.add_argument("--data-out", default=None, help="where regenerated records go (default OUT/data.jsonl)")
    d = ap.add_argument_group("draft")
    d.add_argument("--draft-layers", type=int, default=None, help="default: 1 to 5 by the target's size")
    d.add_argument("--block-size", type=int, default=None, help="default: 16 (DFlash2: 8)")
    d.add_argument("--dflash2", action="store_true",
                   help="a DFlash2 draft (local convolutions, candidate selector), trained as speculators does")
    d.add_argument("--conv-kernel-size", type=int, default=None, help="DFlash2 convolution taps (default 2)")
    d.add_argument("--conv-group-size", type=int, default=None, help="DFlash2 channels per dynamic coefficient (16)")
    d.add_argument("--selector-rank", type=int, default=None, help="DFlash2 selector rank (default 256)")
    d.add_argument("--selector-top-k", type=int, default=None, help="DFlash2 selector candidates (default 16)")
    d.add_argument("--target-layer-ids", default=None, help="comma-separated target layers to read features from")
    d.add_argument("--num-feature-layers", type=int, default=None,
                   help="without --target-layer-ids: this many layers spaced as the reference does "
                        "(default: one per draft layer)")
    d.add_argument("--mask-token-id", type=int, default=None, help="default: an unused row or special token")
    d.add_argument("--intermediate-size", type=int, default=None, help="default: the target's")
    d.add_argument("--init", default=None, help="start from this draft folder (its config wins)")
    t = ap.add_argument_group("training")
    t.add_argument("--num-anchors", type=int, default=512, help="blocks per sequence per step")
    t.add_argument("--gamma", type=float, default=None,
                   help="loss decay exp(-(k-1)/gamma); default 7 for block 16 (DFlash2: 4, speculators')")
    t.add_argument("--selector-loss-alpha", type=float, default=None,
                   help="DFlash2: weight of the selector loss (default 1)")
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--warmup-ratio", type=float, default=0.04)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--grad-clip", type=float, default=1.0)
    t.add_argument("--epochs", type=float, default=6.0)
    t.add_argument("--steps", type=int, default=None, help="total optimizer steps (overrides --epochs)")
    t.add_argument("--schedule-time-s", type=float, default=None,
                   help="size the schedule to this much training time, timed on the first batches "
                        "(overrides --epochs; kept on --resume)")
    t.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    t.add_argument("--max-length", type=int, default=3072, help="tokens per sequence (longer ones are cut)")
    t.add_argument("--loss-chunk", type=int, default=8192, help="supervised tokens per LM-head chunk")
    t.add_argument("--eval-records", type=int, default=32, help="records held out for the acceptance estimate")
    t.add_argument("--device", default=None)
    t.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="target weights and autocast (auto: bf16 on GPU, float32 on CPU); draft weights stay float32")
    t.add_argument("--dequantize", action="store_true", default=True,
                   help="GGUF target weights expanded to --dtype (always, for training: the draft's loss "
                        "backpropagates through the target's LM head, which the GGUF kernels cannot)")
    t.add_argument("--export-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint when there is one")
    t.add_argument("--save-every", type=int, default=1000, help="checkpoint every N steps")
    t.add_argument("--save-every-s", type=float, default=600.0, help="and at least every this many seconds")
    t.add_argument("--log-every", type=int, default=50)
    t.add_argument("--time-budget-s", type=float, default=None,
                   help="stop this run (with a checkpoint) before this many seconds of training")
    t.add_argument("--stop-after-steps", type=int, default=None,
                   help="stop this run (with a checkpoint) after this many steps; --resume continues")
    add_generation_args(ap)
    return ap


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def init_weights(draft: DFlashDraft, seed: int, std: float = 0.02) -> None:
    """As transformers initialises a fresh `DFlashDraftModel`: normal(0, 0.02) linears, unit norms; DFlash2's
    convolutions start as the identity (tap 0 one, no dynamic change), as speculators starts them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("base_kernel"):
                p.zero_()[:, 0] = 1.0
            elif name.endswith("kernel_projection.weight"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def has_anchor(record: Record, block_size: int) -> bool:
    """Some p <= len - B with both p and p + 1 supervised (as `anchor_candidates`)."""
    ids, mask = record
    return bytes(mask).find(b"\x01\x01", 0, len(ids) - block_size + 2) >= 0


def split_records(records: list[Record], block_size: int, eval_records: int, seed: int) -> tuple[list, list]:
    usable = [r for r in records if has_anchor(r, block_size)]
    random.Random(seed).shuffle(usable)
    n_eval = min(eval_records, len(usable) // 10)
    return usable[n_eval:], usable[:n_eval]


def to_device(batch: Batch, device: str) -> Batch:
    return Batch(batch.input_ids.to(device), batch.loss_mask.to(device), batch.lengths.to(device))


def batch_indices(step: int, n: int, batch_size: int, seed: int) -> list[int]:
    """Sequences of a step: epochs are seeded permutations, so a resumed run sees the same batches."""
    per_epoch = max(1, n // batch_size)
    epoch, index = divmod(step, per_epoch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch)).tolist()
    return order[index * batch_size:(index + 1) * batch_size]


def lr_factor(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def gamma_for(args: argparse.Namespace, block_size: int, dflash2: bool = False) -> float:
    if args.gamma is not None:
        return args.gamma
    return 4.0 if dflash2 else 7.0 * block_size / 16


class Trainer:
    def __init__(self, args: argparse.Namespace, target, draft: DFlashDraft, train: list[Record],
                 device: str, amp_dtype: torch.dtype | None):
        self.args, self.target, self.draft, self.train = args, target, draft, train
        self.device, self.amp_dtype = device, amp_dtype
        self.gamma = gamma_for(args, draft.cfg.block_size, draft.cfg.dflash2)
        self.selector_alpha = 1.0 if args.selector_loss_alpha is None else args.selector_loss_alpha
        self.pad_id = 0

    def autocast(self):
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=torch.device(self.device).type, dtype=self.amp_dtype)

    def forward(self, step: int):
        a = self.args
        idx = batch_indices(step, len(self.train), a.batch_size, a.seed)
        batch = to_device(collate([self.train[i] for i in idx], self.pad_id), self.device)
        gen = torch.Generator().manual_seed(a.seed * 1_000_003 + step)
        blocks = sample_anchors(batch.loss_mask, batch.lengths, a.num_anchors, self.draft.cfg.block_size, gen)
        return self.step(batch, blocks)

    def step(self, batch: Batch, blocks) -> StepOutput:
        """The objective on a batch: the target's features (and, for DFlash2, its final hidden states), then
        the draft's forward and loss."""
        cfg = self.draft.cfg
        found = target_features(self.target, batch.input_ids, cfg.target_layer_ids, final=cfg.dflash2)
        features, final = found if cfg.dflash2 else (found, None)
        with self.autocast():
            return blocks_step(self.draft, self.target, batch, features, blocks, self.gamma, self.args.loss_chunk,
                               final, self.selector_alpha)

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def time_steps(self, warmup: int = 2, timed: int = 4) -> float:
        """Seconds per step, measured on forward + backward without updating (for --schedule-time-s)."""
        for i in range(warmup + timed):
            if i == warmup:
                self.sync()
                t0 = time.perf_counter()
            self.forward(i).loss.backward()
            self.draft.zero_grad(set_to_none=True)
        self.sync()
        return (time.perf_counter() - t0) / timed

    @torch.no_grad()
    def evaluate(self, records: list[Record], batch_size: int = 1, max_anchors: int = 512) -> dict:
        """Teacher-forced metrics on held-out records with every candidate anchor: the acceptance estimate
        of greedy decoding on data like this (the records are the target's own greedy answers)."""
        if not records:
            return {}
        totals = dict(loss=0.0, accuracy=0.0, acceptance=0.0, blocks=0, tokens=0)
        for start in range(0, len(records), batch_size):
            batch = to_device(collate(records[start:start + batch_size], self.pad_id), self.device)
            blocks = all_anchors(batch.loss_mask, batch.lengths, self.draft.cfg.block_size, max_anchors)
            out = self.step(batch, blocks)
            totals["loss"] += float(out.loss) * out.tokens
            totals["accuracy"] += out.accuracy * out.tokens
            totals["acceptance"] += out.acceptance * out.blocks
            totals["blocks"] += out.blocks
            totals["tokens"] += out.tokens
        tokens = max(totals["tokens"], 1)
        return dict(loss=totals["loss"] / tokens, accuracy=totals["accuracy"] / tokens,
                    acceptance=totals["acceptance"] / max(totals["blocks"], 1), blocks=totals["blocks"],
                    records=len(records))


DFLASH2_FLAGS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "selector_loss_alpha")


def check_flags(args: argparse.Namespace, out: Path) -> None:
    """Flags that cannot apply as given, as a one-line ValueError naming the flag, before the target loads: the
    DFlash2 flags without --dflash2, --dflash2 on a DFlash draft (--init, or the checkpoint --resume continues),
    a convolution longer than the block (speculators: "kernel_size cannot exceed block_size")."""
    if not args.dflash2:
        given = [name for name in DFLASH2_FLAGS if getattr(args, name) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} is a DFlash2 flag: add --dflash2")
        return
    checkpoint = checkpoint_folder(out) if args.resume else None
    start = checkpoint or (Path(args.init) if args.init else None)
    if start is not None:
        config = start / "config.json"
        if config.is_file() and not DraftConfig.from_hf(json.loads(config.read_text())).dflash2:
            what = f"the checkpoint in {out} (--resume)" if checkpoint else f"--init {args.init}"
            raise ValueError(f"--dflash2: {what} is a DFlash draft, not a DFlash2 one")
        return
    block_size, kernel_size = new_block_size(args), args.conv_kernel_size or DFLASH2_DEFAULTS["conv_kernel_size"]
    if kernel_size > block_size:
        raise ValueError(f"--conv-kernel-size {kernel_size} exceeds the block size {block_size}: the convolution "
                         "mixes rows of one block")


def new_block_size(args: argparse.Namespace) -> int:
    """The block of a draft built fresh: --block-size, else 16 (DFlash2: 8)."""
    return args.block_size or (8 if getattr(args, "dflash2", False) else 16)


def load_or_build_draft(args: argparse.Namespace, target, tokenizer, out: Path, device: str):
    """(draft in float32, checkpoint state, optimizer state): from OUT/checkpoint with --resume, from --init,
    or fresh from the target's shape."""
    from flashdraft.draft import check_compatible

    checkpoint = read_checkpoint(out) if args.resume else None
    if args.resume and checkpoint is None:
        log(f"[train] --resume: no checkpoint in {out}; starting fresh")
    if checkpoint is not None:
        _, state, optim_state = checkpoint
        draft = load_draft_folder(state["folder"], device=device, dtype=torch.float32)
    elif args.init:
        draft, state, optim_state = load_draft_folder(args.init, device=device, dtype=torch.float32), {}, None
    else:
        dflash2 = getattr(args, "dflash2", False)
        block_size = new_block_size(args)
        conv = dict(conv_kernel_size=args.conv_kernel_size, conv_group_size=args.conv_group_size,
                    selector_rank=args.selector_rank, selector_top_k=args.selector_top_k) if dflash2 else None
        cfg = build_draft_config(target.cfg, tokenizer, args.draft_layers, block_size,
                                 parse_layer_ids(args.target_layer_ids), args.num_feature_layers,
                                 args.mask_token_id, args.intermediate_size, conv)
        draft, state, optim_state = DFlashDraft(cfg), {}, None
        init_weights(draft, args.seed)
        draft.to(device)
    check_compatible(draft.cfg, target.cfg.hidden_size, target.cfg.vocab_size, target.cfg.num_layers)
    return draft.train(), state, optim_state


def make_optimizer(args: argparse.Namespace, params: list, device: str, step: int, total: int, warmup: int,
                   optim_state: dict | None):
    """AdamW with warm-up + cosine, restored from a checkpoint's state when there is one."""
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay,
                                  fused=device.startswith("cuda"))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total, warmup))
    if optim_state is not None:
        optimizer.load_state_dict(optim_state["optimizer"])
        scheduler.load_state_dict(optim_state["scheduler"])
    elif step > 0:
        log("[train] the checkpoint has no optimizer state: fresh AdamW moments")
        for group in optimizer.param_groups:
            group["lr"] = args.lr * lr_factor(step, total, warmup)
        scheduler.last_epoch = step
    return optimizer, scheduler


def prepare_data(args: argparse.Namespace, target, tokenizer, device: str, dtype: torch.dtype) -> list[Record]:
    """Token files as they are; prompt files answered by the target into --data-out first."""
    token_files = [f for f in args.data if f != "code" and is_token_file(Path(f))]
    prompt_files = [f for f in args.data if f not in token_files]
    if prompt_files:
        data_out = Path(args.data_out or Path(args.out) / "data.jsonl")
        prompts = collect_prompts(args, prompt_files)
        generate_records(target, tokenizer, prompts, data_out, gen_options(args), device, dtype)
        token_files.append(str(data_out))
    records = load_records([f for f in token_files if Path(f).is_file()], args.max_length)
    if not records:
        raise ValueError("no training records (the make-data stage wrote none?)")
    return records


def run(args: argparse.Namespace, target=None, tokenizer=None) -> dict:
    """Train (or continue) a draft; returns the summary also written to OUT/train_summary.json.
    A loaded target/tokenizer may be passed in to skip loading."""
    from flashdraft.args import default_device
    from flashdraft.engine.engine import resolve_dtype

    out = Path(args.out)
    check_flags(args, out)
    device = default_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    if target is None:
        from flashdraft.formats.loader import load_target
        t0 = time.perf_counter()
        target, tokenizer, _ = load_target(args.model, device, dtype)
        log(f"[train] target loaded in {time.perf_counter() - t0:.0f} s")
    target.requires_grad_(False)
    records = prepare_data(args, target, tokenizer, device, dtype)

    draft, state, optim_state = load_or_build_draft(args, target, tokenizer, out, device)
    cfg = draft.cfg
    n_params = sum(p.numel() for p in draft.parameters())
    kind = (f"DFlash2 (conv {cfg.conv_kernel_size}, selector rank {cfg.selector_rank} top-{cfg.selector_top_k}) "
            if cfg.dflash2 else "")
    log(f"[train] draft: {kind}{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, target layers "
        f"{cfg.target_layer_ids}, block {cfg.block_size}, mask token {cfg.mask_token_id}, {n_params / 1e6:.2f} M "
        f"parameters ({n_params * 2 / 1e6:.1f} MB in bf16)")

    train, held_out = split_records(records, cfg.block_size, args.eval_records, args.seed)
    if not train:
        raise ValueError(f"no record has a response of at least {cfg.block_size + 1} tokens to anchor blocks in")
    amp_dtype = dtype if dtype != torch.float32 else None
    trainer = Trainer(args, target, draft, train, device, amp_dtype)
    per_epoch = max(1, len(train) // args.batch_size)

    start = time.perf_counter()  # the time budget covers the schedule calibration too
    step = int(state.get("step", 0))
    total = state.get("total_steps")
    if total is None:
        if args.steps is not None:
            total = args.steps
        elif args.schedule_time_s is not None:
            per_step = trainer.time_steps()
            total = max(1, int(args.schedule_time_s / per_step))
            log(f"[train] {per_step:.3f} s per step: {total} steps fit {args.schedule_time_s:.0f} s")
        else:
            total = max(1, int(args.epochs * per_epoch))
    total = int(total)
    warmup = max(1, int(args.warmup_ratio * total))
    if state.get("n_train") not in (None, len(train)):
        log(f"[train] warning: the checkpoint trained on {state['n_train']} records, now {len(train)}")
    log(f"[train] {len(train)} training records ({len(held_out)} held out), batch {args.batch_size}, "
        f"{per_epoch} steps per epoch; step {step} of {total} (warm-up {warmup})")

    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer, scheduler = make_optimizer(args, params, device, step, total, warmup, optim_state)

    history_file = out / "train_log.jsonl"
    last_save, first_step = time.perf_counter(), step
    window: list[dict] = []
    log_rows: list[dict] = []

    def snapshot() -> dict:
        return dict(step=step, total_steps=total, warmup_steps=warmup, n_train=len(train), seed=args.seed,
                    batch_size=args.batch_size, num_anchors=args.num_anchors, gamma=trainer.gamma,
                    lr=args.lr, max_length=args.max_length)

    def save(reason: str) -> None:
        nonlocal last_save
        save_checkpoint(out, draft, optimizer, scheduler, snapshot())
        save_draft(draft, out, torch_dtype(args.export_dtype))
        if log_rows:
            with open(history_file, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in log_rows)
            log_rows.clear()
        last_save = time.perf_counter()
        log(f"[train] saved step {step} ({reason})")

    try:
        from tqdm import tqdm
        bar = tqdm(total=total, initial=step, desc="train-draft", disable=None, dynamic_ncols=True)
    except ImportError:  # the periodic log lines carry the same numbers
        bar = None
    stopped = "done"
    last_resume = time.perf_counter()
    try:
        while step < total:
            elapsed = time.perf_counter() - start
            per_step = (time.perf_counter() - last_resume) / max(1, step - first_step)
            if args.time_budget_s is not None and step > first_step and elapsed + 1.5 * per_step > args.time_budget_s:
                stopped = "time budget"
                break
            if args.stop_after_steps is not None and step - first_step >= args.stop_after_steps:
                stopped = "step limit"
                break
            result = trainer.forward(step)
            result.loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, args.grad_clip))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            row = dict(step=step, loss=float(result.loss.detach()), accuracy=result.accuracy,
                       acceptance=result.acceptance, grad_norm=grad_norm, lr=scheduler.get_last_lr()[0])
            window.append(row)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['accuracy']:.3f}", tau=f"{row['acceptance']:.2f}")
            if step % args.log_every == 0 or step == total:
                mean = {k: sum(r[k] for r in window) / len(window)
                        for k in ("loss", "accuracy", "acceptance", "grad_norm")}
                rate = (time.perf_counter() - last_resume) / max(1, step - first_step)
                log(f"[train] step {step}/{total} loss {mean['loss']:.4f} acc {mean['accuracy']:.3f} "
                    f"tau {mean['acceptance']:.2f} grad {mean['grad_norm']:.2f} lr {row['lr']:.2e} {rate:.3f} s/step")
                log_rows.append(dict(mean, step=step, lr=row["lr"], s_per_step=rate))
                window.clear()
            if step % args.save_every == 0 or time.perf_counter() - last_save > args.save_every_s:
                save("periodic")
    except BaseException:
        optimizer.zero_grad(set_to_none=True)
        if step > first_step:
            save("interrupted")
        if bar is not None:
            bar.close()
        raise
    if bar is not None:
        bar.close()
    save(stopped)
    train_s = time.perf_counter() - start

    draft.eval()
    evaluation = trainer.evaluate(held_out)
    if evaluation:
        log(f"[train] held-out ({evaluation['records']} records, {evaluation['blocks']} blocks): loss "
            f"{evaluation['loss']:.4f}, top-1 {evaluation['accuracy']:.3f}, estimated acceptance length "
            f"{evaluation['acceptance']:.2f}")
    size = (out / "model.safetensors").stat().st_size
    summary = dict(snapshot(), finished=step >= total, stopped=stopped, train_seconds=train_s,
                   steps_this_run=step - first_step, held_out=evaluation, parameters=n_params,
                   export_bytes=size, target_layer_ids=cfg.target_layer_ids, mask_token_id=cfg.mask_token_id)
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"[train] {stopped}: step {step}/{total}, draft in {out} ({size / 1e6:.1f} MB)")
    return summary


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
