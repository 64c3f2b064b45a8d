"""Draft folders and training checkpoints.

A draft folder is z-lab's format: config.json (`DraftConfig.to_hf()`) and model.safetensors (no `model.`
prefix). The output folder holds the exported draft (bf16 by default); its `checkpoint/` subfolder is
also a draft folder, in float32, plus `optimizer.pt` (optimizer and schedule) and `state.json` (step,
schedule length, data size) for `--resume`. Files are written next to their destination and renamed,
so a run killed mid-save leaves the previous checkpoint intact.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from flashdraft.draft.model import DFlashDraft, DraftConfig

CHECKPOINT = "checkpoint"


def save_draft(draft: DFlashDraft, folder: Path, dtype: torch.dtype | None = None) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu", dtype or t.dtype).contiguous() for name, t in draft.state_dict().items()}
    config = draft.cfg.to_hf()
    config["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    save_file(tensors, str(folder / "model.safetensors.tmp"), metadata={"format": "pt"})
    os.replace(folder / "model.safetensors.tmp", folder / "model.safetensors")
    (folder / "config.json.tmp").write_text(json.dumps(config, indent=2) + "\n")
    os.replace(folder / "config.json.tmp", folder / "config.json")


def save_checkpoint(out: Path, draft: DFlashDraft, optimizer, scheduler, state: dict) -> None:
    tmp = out / (CHECKPOINT + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_draft(draft, tmp, torch.float32)
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n")
    final, old = out / CHECKPOINT, out / (CHECKPOINT + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def read_checkpoint(out: Path) -> tuple[DraftConfig, dict, dict | None] | None:
    """(config, state, optimizer file contents or None) of the checkpoint in `out`, or None without one."""
    folder = out / CHECKPOINT
    if not (folder / "state.json").is_file():
        old = out / (CHECKPOINT + ".old")  # a run killed between the two renames
        if not (old / "state.json").is_file():
            return None
        folder = old
    cfg = DraftConfig.from_hf(json.loads((folder / "config.json").read_text()))
    state = json.loads((folder / "state.json").read_text())
    state["folder"] = str(folder)
    optim = folder / "optimizer.pt"
    return cfg, state, (torch.load(optim, map_location="cpu", weights_only=False) if optim.is_file() else None)
