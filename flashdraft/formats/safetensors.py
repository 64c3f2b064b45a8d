"""HF model folders: config.json plus one or several *.safetensors files."""
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def read_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder}: no config.json (expected an HF model folder or a .gguf file)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from None


def safetensors_files(folder: Path) -> list[Path]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no model.safetensors, model.safetensors.index.json or *.safetensors weights")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"{folder}: safetensors shards listed in the index are missing: {', '.join(missing)}")
    return files


def iter_tensors(folder: Path, dtype: torch.dtype | None, device: str | torch.device = "cpu",
                 keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors one at a time, converted to dtype (None: the file's) on device, so only one extra tensor is alive
    at once; `keep`: only the names it accepts are read."""
    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if keep is None or keep(name):
                        yield name, f.get_tensor(name).to(device=device, dtype=dtype or None)
        except Exception as e:  # safetensors raises its own error types for truncated or corrupt files
            if isinstance(e, ValueError) and str(path) in str(e):
                raise
            raise ValueError(f"{path}: cannot read safetensors file ({e})") from None
