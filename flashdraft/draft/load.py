"""Loading a DFlash draft: z-lab's HF folder (or flashdraft's int8 one) through the shared safetensors reader,
and the checks that it fits its config and its target."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from flashdraft.draft.config import DRAFT2_ARCHITECTURE, DRAFT_ARCHITECTURE, DraftConfig
from flashdraft.draft.interface import LoadOptions
from flashdraft.draft.model import DFlashDraft
from flashdraft.formats.safetensors import iter_tensors
from flashdraft.layers.quantized import QuantizedWeight, swap_quantized

if TYPE_CHECKING:
    from flashdraft.draft.registry import DraftSource
    from flashdraft.formats.gguf import GGUFFile


def load_dflash(source: DraftSource, target, options: LoadOptions) -> DFlashDraft:
    """The DFlash drafter of a z-lab folder or a draft GGUF (draft/registry.py), checked against `target`."""
    cfg = target.cfg
    if source.gguf is None:
        draft = load_draft_folder(source.path, options.device, options.dtype)
    else:
        draft = load_draft_gguf(source.gguf, options.device, options.dtype, vocab_size=cfg.vocab_size,
                                num_target_layers=cfg.num_layers, quantized=options.quantized)
    check_compatible(draft.cfg, cfg.hidden_size, cfg.vocab_size, cfg.num_layers)
    if options.embed_scale is not None:
        draft.cfg.input_embedding_scale = options.embed_scale
    return draft.requires_grad_(False)  # for inference, as the target (training loads the folder itself)


def check_compatible(
    cfg: DraftConfig, target_hidden_size: int, target_vocab_size: int, target_num_layers: int
) -> None:
    """Raise ValueError naming what does not fit between a draft and a target."""
    if cfg.hidden_size != target_hidden_size:
        raise ValueError(
            f"draft hidden size {cfg.hidden_size} does not match the target's hidden size {target_hidden_size}"
        )
    if cfg.vocab_size != target_vocab_size:
        raise ValueError(f"draft vocabulary size {cfg.vocab_size} does not match the target's vocabulary size "
                         f"{target_vocab_size}")
    if cfg.mask_token_id is None:
        raise ValueError("draft config has no mask token id (dflash_config.mask_token_id)")
    if not 0 <= cfg.mask_token_id < target_vocab_size:
        raise ValueError(
            f"draft mask token id {cfg.mask_token_id} is outside the target's vocabulary (size {target_vocab_size})"
        )
    outside = [i for i in cfg.target_layer_ids if not 0 <= i < target_num_layers]
    if outside:
        raise ValueError(
            f"draft target layer ids {outside} are out of range for a target with {target_num_layers} layers"
        )


def _name_list(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def dequantize_int8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Int8 matrices stored with a scale per group of a row's elements (`<name>_scale` [rows, groups], as
    `train.checkpoint.quantize_int8` writes them) back to the dtype of the folder's other tensors."""
    scales = {name.removesuffix("_scale"): t for name, t in tensors.items() if name.endswith("_scale")}
    if not scales:
        return tensors
    dtype = next((t.dtype for n, t in tensors.items() if t.is_floating_point() and not n.endswith("_scale")),
                 torch.float32)

    def restore(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (q.float().unflatten(1, (scale.shape[1], -1)) * scale.float()[..., None]).flatten(1).to(dtype)

    return {name: restore(t, scales[name]) if name in scales else t
            for name, t in tensors.items() if not name.endswith("_scale")}


def load_draft_folder(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> DFlashDraft:
    """Load a z-lab HF draft folder (config.json + safetensors, sharded or not). dtype None keeps the file's."""
    folder = Path(path)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{folder}: no config.json, not a DFlash draft folder")
    config = json.loads(config_file.read_text())
    architectures = config.get("architectures") or []
    if not {DRAFT_ARCHITECTURE, DRAFT2_ARCHITECTURE} & set(architectures):
        raise ValueError(f"{folder}: architectures {architectures} is not {DRAFT_ARCHITECTURE!r} or "
                         f"{DRAFT2_ARCHITECTURE!r}")
    cfg = DraftConfig.from_hf(config)

    # BeeLlama's converter strips a `model.` prefix when present; accept checkpoints that have one.
    tensors = {name.removeprefix("model."): t
               for name, t in dequantize_int8(dict(iter_tensors(folder, None, device))).items()}
    return build_draft(cfg, tensors, folder, device, dtype)


def load_draft_gguf(path: str | Path | GGUFFile, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                    vocab_size: int | None = None, num_target_layers: int | None = None,
                    quantized: bool = False) -> DFlashDraft:
    """Load a draft GGUF (BeeLlama's dflash-draft or llama.cpp's dflash; formats/gguf_draft.py), by path or as
    read_gguf read it; block types are dequantized, or with `quantized` kept in their block format where the GPU
    kernels read them, as a target's. `vocab_size`, `num_target_layers`: the target's, which the files do not
    always say."""
    from flashdraft.formats.gguf import read_gguf
    from flashdraft.formats.gguf_draft import draft_hf_config, iter_draft_tensors
    g = read_gguf(path) if isinstance(path, (str, Path)) else path
    config = draft_hf_config(g)
    config["vocab_size"] = config["vocab_size"] or vocab_size
    config["num_target_layers"] = num_target_layers or config["num_target_layers"]
    return build_draft(DraftConfig.from_hf(config), dict(iter_draft_tensors(g, dtype, device, quantized)), g.path,
                       device, dtype)


def build_draft(cfg: DraftConfig, tensors: dict[str, Any], source: Path, device: torch.device | str,
                dtype: torch.dtype | None) -> DFlashDraft:
    """The draft of `cfg` holding `tensors` (z-lab names; a GGUF matrix may be a layers.quantized.QuantizedWeight,
    swapped in as the target's are), after checking they are exactly its tensors."""
    with torch.device("meta"):
        model = DFlashDraft(cfg)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        problems = []
        if missing:
            problems.append(f"missing tensors: {_name_list(missing)}")
        if unexpected:
            problems.append(f"unexpected tensors: {_name_list(unexpected)}")
        raise ValueError(f"{source}: checkpoint does not match its config; " + "; ".join(problems))
    wrong_shapes = [
        f"{name} {tuple(tensors[name].shape)} (expected {tuple(t.shape)})"
        for name, t in expected.items()
        if tensors[name].shape != t.shape
    ]
    if wrong_shapes:
        raise ValueError(f"{source}: tensors with wrong shapes: {_name_list(wrong_shapes)}")
    quantized = {name: t for name, t in tensors.items() if isinstance(t, QuantizedWeight)}
    tensors = {name: t if dtype is None else t.to(dtype) for name, t in tensors.items() if name not in quantized}
    swap_quantized(model, quantized, dtype or torch.float32, device)
    model.load_state_dict(tensors, assign=True)
    model.rotary.to_empty(device=device)  # the frequencies are recomputed on the real device in Rotary._apply
    return model.eval()
