"""Load a target (HF folder, GGUF file or named model) and a DFlash draft onto a device."""
from pathlib import Path

import torch

from flashdraft.models.config import ModelConfig
from flashdraft.models.transformer import Transformer


def build_target(cfg: ModelConfig, tensors, device: str, dtype: torch.dtype) -> Transformer:
    """Assemble a Transformer from (name, tensor) pairs without allocating a second copy of the weights."""
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = set(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    seen = set()
    for name, tensor in tensors:
        if name not in expected:
            if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                continue
            raise ValueError(f"unexpected tensor {name!r} for a {cfg.arch} model")
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        want = getattr(module, attr).shape
        if tensor.shape != want:
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(want)}")
        setattr(module, attr, torch.nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False))
        seen.add(name)
    missing = sorted(expected - seen)
    if missing:
        raise ValueError(f"missing tensors: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def load_target(model: str, device: str = "cpu", dtype: torch.dtype = torch.float32, progress: bool = False):
    """Returns (Transformer, Tokenizer, resolved path)."""
    from flashdraft.formats.named import resolve_model
    from flashdraft.formats.tokenizer import Tokenizer

    path = Path(resolve_model(model))
    if path.is_dir():
        from flashdraft.formats.safetensors import iter_tensors, read_config
        hf = read_config(path)
        cfg = ModelConfig.from_hf(hf)
        tokenizer = Tokenizer.from_hf_folder(path)
        target = build_target(cfg, iter_tensors(path, dtype, device), device, dtype)
    elif path.is_file():
        from flashdraft.formats import gguf
        reader = gguf.read_gguf(path)
        cfg = ModelConfig.from_hf(gguf.gguf_to_hf_config(reader))
        tokenizer = Tokenizer.from_gguf(reader)
        tensors = gguf.iter_gguf_tensors(reader, dtype, device, progress=progress)
        target = build_target(cfg, tensors, device, dtype)
    else:
        raise FileNotFoundError(f"model not found: {model}")
    if not cfg.eos_token_ids:
        cfg.eos_token_ids = list(tokenizer.eos_ids)
    return target, tokenizer, path


def load_draft(path: str, target: Transformer, device: str = "cpu", dtype: torch.dtype = torch.float32):
    from flashdraft.draft.model import check_compatible, load_draft_folder
    from flashdraft.formats.named import resolve_model

    folder = Path(resolve_model(path))
    if not folder.is_dir():
        raise ValueError(f"{path}: a DFlash draft must be a z-lab HF folder (config.json + safetensors)")
    draft = load_draft_folder(folder, device=device, dtype=dtype)
    cfg = target.cfg
    check_compatible(draft.cfg, cfg.hidden_size, cfg.vocab_size, cfg.num_layers)
    return draft
