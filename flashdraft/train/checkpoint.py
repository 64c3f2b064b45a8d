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

from flashdraft.draft import DFlashDraft, DraftConfig

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


def quantize_int8(tensors: dict[str, torch.Tensor], group: int = 32, min_size: int = 1 << 16) -> dict[str, torch.Tensor]:
    """Matrices of at least `min_size` elements as int8 with a float16 scale per `group` consecutive elements of a
    row (`<name>_scale`, [rows, columns / group]): about 0.53 of bf16's bytes, with a rounding error close to
    bf16's own. Other tensors are kept as they are."""
    out = {}
    for name, t in tensors.items():
        if t.dim() != 2 or t.numel() < min_size or t.shape[1] % group:
            out[name] = t
            continue
        blocks = t.float().unflatten(1, (-1, group))
        scale = (blocks.abs().amax(dim=2) / 127).clamp(min=1e-8).half()
        out[name] = (blocks / scale.float()[..., None]).round().clamp(-127, 127).to(torch.int8).flatten(1)
        out[f"{name}_scale"] = scale
    return out


def save_int8_draft(source: Path, folder: Path) -> None:
    """A copy of the draft folder `source` with its matrices stored as int8 with group scales (what the package ships:
    flashdraft reads it back to the other tensors' dtype; z-lab's loader does not know this format)."""
    from safetensors.torch import save_file

    from flashdraft.formats.safetensors import iter_tensors
    tensors = quantize_int8({k: v.contiguous() for k, v in iter_tensors(Path(source), None, "cpu")})
    config = json.loads((Path(source) / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "flashdraft-int8"}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors.tmp"), metadata={"format": "pt"})
    os.replace(folder / "model.safetensors.tmp", folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


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


def checkpoint_folder(out: Path) -> Path | None:
    """The folder of the checkpoint in `out`, or None without one."""
    for folder in (out / CHECKPOINT, out / (CHECKPOINT + ".old")):  # .old: a run killed between the two renames
        if (folder / "state.json").is_file():
            return folder
    return None


def read_checkpoint(out: Path) -> tuple[DraftConfig, dict, dict | None] | None:
    """(config, state, optimizer file contents or None) of the checkpoint in `out`, or None without one."""
    folder = checkpoint_folder(out)
    if folder is None:
        return None
    cfg = DraftConfig.from_hf(json.loads((folder / "config.json").read_text()))
    state = json.loads((folder / "state.json").read_text())
    state["folder"] = str(folder)
    optim = folder / "optimizer.pt"
    return cfg, state, (torch.load(optim, map_location="cpu", weights_only=False) if optim.is_file() else None)


def copy_draft_sharded(src: Path, dest: Path, max_shard_bytes: int) -> list[str]:
    """Copy a draft folder as safetensors shards of at most `max_shard_bytes` (plus the HF index), e.g.
    to pass a file-size limit; flashdraft and transformers load the sharded folder as they load the
    original. Returns the files written."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes - (1 << 16):  # leave room for the header
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    dest.mkdir(parents=True, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, str(dest / name), metadata={"format": "pt"})
        weight_map.update({t: name for t in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (dest / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    shutil.copy2(src / "config.json", dest / "config.json")
    return ["config.json", "model.safetensors.index.json", *names]
