"""Load a target (HF folder, GGUF file or named model) and a drafter onto a device."""
import logging
from pathlib import Path

import torch

from flashdraft.layers.quantized import QuantizedWeight, swap_quantized
from flashdraft.models.registry import Family, family_for, read_config
from flashdraft.models.tp import rank_and_world, shard_tensor

log = logging.getLogger("flashdraft")


def build_target(cfg, tensors, device: str, dtype: torch.dtype, rank: int = 0, world_size: int = 1,
                 family: Family | None = None):
    """Assemble a target model from (HF name, tensor) pairs; each tensor is converted once and kept (under tensor
    parallelism, only rank `rank`'s share of it)."""
    family = family or family_for(cfg.arch)
    with torch.device("meta"):
        model = family.model_class(cfg, rank, world_size)

    def shard(name: str, tensor: torch.Tensor) -> torch.Tensor:
        return shard_tensor(name, tensor, cfg.vocab_size, rank, world_size, family.tp_row_split,
                            family.tp_column_split)

    state, quantized = {}, {}
    for name, tensor in tensors:
        if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        if isinstance(tensor, QuantizedWeight):  # kept in its block format (one rank only: see load_target)
            quantized[name] = tensor
            continue
        state[name] = shard(name, tensor).to(device=device, dtype=dtype)
    if cfg.tie_word_embeddings and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = shard("lm_head.weight", state["model.embed_tokens.weight"])
    if cfg.tie_word_embeddings and "model.embed_tokens.weight" in quantized:
        quantized["lm_head.weight"] = quantized["model.embed_tokens.weight"]  # the same bytes, read by both
    load_into(model, state, quantized, dtype, device, f"a {cfg.arch} model")
    if cfg.tie_word_embeddings and world_size == 1 and isinstance(model.lm_head, torch.nn.Linear):
        model.lm_head.weight = model.model.embed_tokens.weight
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def load_into(module: torch.nn.Module, state: dict, quantized: dict, dtype: torch.dtype, device: str,
              what: str) -> None:
    """Fill a module built on the meta device: `quantized` (HF name -> QuantizedWeight) become GGUF modules, the
    rest is assigned; ValueError naming the first missing or unexpected tensors."""
    swap_quantized(module, quantized, dtype, device)
    try:
        missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:  # size mismatches
        raise ValueError(str(e).splitlines()[-1].strip()) from None
    if unexpected:
        raise ValueError(f"unexpected tensors for {what}: {', '.join(sorted(unexpected)[:5])}")
    if missing:
        raise ValueError(f"missing tensors for {what}: {', '.join(sorted(missing)[:5])}"
                         f"{' ...' if len(missing) > 5 else ''}")


def model_config(path: Path, gguf_file=None):
    """(family, config) of a target's HF folder or GGUF file (`gguf_file`: the file as read_gguf read it), from its
    config or metadata alone."""
    if path.is_dir():
        from flashdraft.formats.safetensors import read_config as read_hf_config
        return read_config(read_hf_config(path))
    from flashdraft.formats import gguf
    return read_config(gguf.gguf_to_hf_config(gguf_file or gguf.read_gguf(path)))


def load_target(model: str, device: str = "cpu", dtype: torch.dtype = torch.float32, progress: bool = False,
                quantized: bool = False):
    """Returns (model, Tokenizer, resolved path). Under torch.distributed, this rank's share of the target.
    quantized: a GGUF file's matrices stay in their block format (layers/quantized.py), where kernels read
    their type; under tensor parallelism they are dequantised (a rank's share would cut through blocks)."""
    from flashdraft.formats.named import resolve_model
    from flashdraft.formats.tokenizer import Tokenizer

    path = Path(resolve_model(model))
    if path.is_dir():
        from flashdraft.formats.safetensors import iter_tensors
        family, cfg = model_config(path)
        tokenizer = Tokenizer.from_hf_folder(path)
        tensors = iter_tensors(path, dtype, device)
    elif path.is_file():
        from flashdraft.formats import gguf
        reader = gguf.read_gguf(path)
        family, cfg = model_config(path, reader)
        tokenizer = Tokenizer.from_gguf(reader)
        rank, world_size = rank_and_world()
        if quantized and world_size > 1:
            log.warning("tensor parallelism: the GGUF weights are dequantised to %s", dtype)
        tensors = gguf.iter_gguf_tensors(reader, dtype, device, progress=progress,
                                         keep_quantized=quantized and world_size == 1)
    else:
        raise FileNotFoundError(f"model not found: {model}")
    target = build_target(cfg, tensors, device, dtype, *rank_and_world(), family=family)
    if not cfg.eos_token_ids:
        cfg.eos_token_ids = list(tokenizer.eos_ids)
    return target, tokenizer, path


def load_draft(path: str, target, device: str = "cpu", dtype: torch.dtype = torch.float32, quantized: bool = False,
               embed_scale: float | None = None, params: dict | None = None, spec_type: str | None = None):
    """The drafter (draft/interface.py) of a draft folder or file, of the kind its files name (draft/registry.py),
    checked against the target. quantized: a GGUF draft's matrices kept in their block format, as load_target's
    (under tensor parallelism too, every rank holding the whole draft). `params`: the kind's own settings by name.
    `spec_type`: the --spec-type given with it, whose kind the files must be (a one-line error before the weights
    are read)."""
    from flashdraft.draft import registry
    from flashdraft.draft.interface import LoadOptions
    from flashdraft.formats.named import resolve_model

    source = Path(resolve_model(path))
    if not source.exists():
        raise FileNotFoundError(f"draft not found: {path} (a DFlash or DFlash2 draft or a Gemma 4 assistant: an HF "
                                "folder or a GGUF file)")
    return registry.load(source, target, LoadOptions(device, dtype, quantized, embed_scale, dict(params or {})),
                         spec_type)


def make_drafter(spec_type: str | None, draft: str | None, target, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, quantized: bool = False, params: dict | None = None,
                 embed_scale: float | None = None, source: str | Path | None = None):
    """The drafter a command line asks for (None: plain decoding): a draft file's (-md), a kind without a draft
    file (--spec-type ngram-mod, mtp), or a chain (--spec-type ngram-mod,draft-dflash: lookups, then the draft
    file's drafter or the last kind's)."""
    from flashdraft.draft import registry
    from flashdraft.draft.interface import LoadOptions

    chained = spec_type is not None and "," in spec_type
    if draft:
        model = load_draft(draft, target, device, dtype, quantized=quantized, embed_scale=embed_scale, params=params,
                           spec_type=spec_type)
    elif spec_type:
        last = spec_type.split(",")[-1].strip() if chained else spec_type
        model = create_drafter(last, target, device, dtype, params, source=source, quantized=quantized)
    else:
        return None
    if not chained:
        return model
    options = LoadOptions(device, dtype, quantized, params=dict(params or {}))
    return registry.chain(spec_type, model, target, options)


def create_drafter(spec_type: str, target, device: str = "cpu", dtype: torch.dtype = torch.float32,
                   params: dict | None = None, source: str | Path | None = None, quantized: bool = False):
    """The drafter of a kind that needs no draft file (draft/registry.py), chosen by its --spec-type name: the
    n-gram lookup, or the target checkpoint's MTP block (read from `source`, the target's file or folder).
    `params`: the kind's own settings by name."""
    from flashdraft.draft import registry
    from flashdraft.draft.interface import LoadOptions

    return registry.create(spec_type, target, LoadOptions(device, dtype, quantized, params=dict(params or {}),
                                                          target_source=None if source is None else Path(source)))
