"""GGUF files: metadata -> HF-style config dict, tensors dequantised (quant/dequant.py), HF tensor names and layouts.

    g = read_gguf("model.gguf")
    config = gguf_to_hf_config(g)                      # like an HF config.json
    for name, tensor in iter_gguf_tensors(g, torch.bfloat16, "cuda"):
        ...                                            # HF names, dequantised one tensor at a time
"""
from __future__ import annotations

import math
import re
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from flashdraft.models.registry import Family, family_for_gguf
from flashdraft.quant.dequant import dequantize, tensor_bytes, tensor_values


@dataclass
class GGUFTensor:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # logical shape in torch order (out_features first)
    data: np.ndarray  # the stored bytes, memory-mapped (typed for F32/F16, uint8 otherwise)
    offset: int = -1  # where they start in the file


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "")


# GGUF value types (gguf.GGUFValueType): numeric scalars and array elements as little-endian numpy types
_NUMBERS = {0: np.dtype("<u1"), 1: np.dtype("<i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"), 4: np.dtype("<u4"),
            5: np.dtype("<i4"), 6: np.dtype("<f4"), 7: np.dtype("?"), 10: np.dtype("<u8"), 11: np.dtype("<i8"),
            12: np.dtype("<f8")}
_STRING, _ARRAY = 8, 9
_TYPED = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64}


class _Cursor:
    """Reads a GGUF header's values in order. The gguf package's GGUFReader builds numpy views for every element
    of a string array (a 262k-token vocabulary took seconds); here strings are sliced from one buffer."""

    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def number(self, kind: int):
        dtype = _NUMBERS[kind]
        value = np.frombuffer(self.buf, dtype, 1, self.pos)[0].item()
        self.pos += dtype.itemsize
        return value

    def string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + n
        if self.pos > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        return str(self.buf[start:self.pos], "utf-8")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            return self.number(kind)
        item, count = struct.unpack_from("<IQ", self.buf, self.pos)
        self.pos += 12
        if item == _STRING:
            return [self.string() for _ in range(count)]
        if item == _ARRAY:  # each element an array with its own type and count
            return [self.value(_ARRAY) for _ in range(count)]
        dtype = _NUMBERS[item]
        values = np.frombuffer(self.buf, dtype, count, self.pos)
        self.pos += dtype.itemsize * count
        return values.tolist()


def _parse(data: np.ndarray) -> tuple[dict[str, Any], list[tuple[str, GGMLQuantizationType, tuple[int, ...], int]],
                                      int]:
    """(metadata, tensors as (name, type, ggml dims, offset from the data section), the data section's start) of
    a GGUF file of version 2 or 3 mapped as `data` (uint8)."""
    cur = _Cursor(memoryview(data))
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", cur.buf, 4)  # after the magic, read_gguf's check
    if version & 0xFFFF == 0:
        raise ValueError("a big-endian GGUF file")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (2 and 3 are read)")
    cur.pos = 24
    metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
    for _ in range(n_kv):
        key = cur.string()
        (kind,) = struct.unpack_from("<I", cur.buf, cur.pos)
        cur.pos += 4
        metadata[key] = cur.value(kind)
    tensors = []
    for _ in range(n_tensors):
        name = cur.string()
        (n_dims,) = struct.unpack_from("<I", cur.buf, cur.pos)
        dims = struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.pos + 4)
        qtype, offset = struct.unpack_from("<IQ", cur.buf, cur.pos + 4 + 8 * n_dims)
        cur.pos += 16 + 8 * n_dims
        tensors.append((name, GGMLQuantizationType(qtype), dims, offset))
    align = metadata.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment {align!r} is not a power of two")
    return metadata, tensors, -(-cur.pos // align) * align


def _tensor_data(data: np.ndarray, start: int, qtype: GGMLQuantizationType, dims: tuple[int, ...]) -> np.ndarray:
    """A tensor's stored values as a view of the mapping: typed for the float and integer types, else bytes
    [..., row bytes] (ggml's dims reversed: torch order)."""
    block, size = GGML_QUANT_SIZES[qtype]
    shape = tuple(reversed(dims))
    if qtype in _TYPED:
        return data[start:start + math.prod(dims) * size].view(_TYPED[qtype]).reshape(shape)
    if dims[0] % block:
        raise ValueError(f"{qtype.name} rows of {dims[0]} values are not whole blocks of {block}")
    return data[start:start + math.prod(dims) // block * size].reshape(*shape[:-1], dims[0] // block * size)


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's metadata and tensor table; tensor data stays memory-mapped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path.name}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    size = path.stat().st_size
    data = np.memmap(path, mode="r").view(np.ndarray)  # a plain view: no memmap bookkeeping per slice
    try:
        metadata, table, start = _parse(data)
    except Exception as e:  # a damaged file fails in many ways; all of them mean the same
        raise ValueError(f"{path.name}: truncated or corrupt GGUF file (its {size:,} bytes do not parse)") from e
    tensors = {}
    for name, qtype, dims, offset in table:
        block, type_size = GGML_QUANT_SIZES[qtype]
        if start + offset + math.prod(dims) // block * type_size > size:
            raise ValueError(f"{path.name}: truncated GGUF file (tensor {name} ends past the end of the file)")
        if name in tensors:
            raise ValueError(f"{path.name}: tensor {name} appears twice")
        tensors[name] = GGUFTensor(name, qtype, tuple(int(d) for d in reversed(dims)),
                                   _tensor_data(data, start + offset, qtype, dims), start + offset)
    return GGUFFile(path, metadata, tensors)


# ---------------------------------------------------------------------------------------------- config

def gguf_to_hf_config(gguf: GGUFFile | Mapping[str, Any], tensors: Mapping[str, GGUFTensor] | None = None) -> dict:
    """An HF config.json-style dict for a GGUF file (pass the GGUFFile, or its metadata and tensors)."""
    if isinstance(gguf, GGUFFile):
        metadata, tensors = gguf.metadata, gguf.tensors
    else:
        metadata = gguf
        if tensors is None:
            raise TypeError("gguf_to_hf_config needs the tensor table too: pass read_gguf(path), or (metadata, tensors)")
    arch = metadata.get("general.architecture")
    model_type = _model_type(metadata)

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = get("attention.head_count_kv", heads)
    kv_heads = int(max(kv_heads) if isinstance(kv_heads, list) else kv_heads)
    head_dim = int(get("attention.key_length") or get("rope.dimension_count") or hidden // heads)
    # the embedding's rows are what the weights need; the vocab keys can be shorter (unpadded)
    embedding = tensors.get("token_embd.weight")
    vocab = embedding.shape[0] if embedding is not None else get("vocab_size") or len(metadata.get("tokenizer.ggml.tokens") or ())
    eos_ids = _unique(metadata.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom"))
    shared = {  # what every architecture's keys say alike
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
    }
    family = family_for_gguf(arch)
    if family.gguf_config is not None:  # the family reads its own keys (and rope_freqs) over the shared ones
        return family.gguf_config(metadata, tensors, shared)
    rope_theta = float(get("rope.freq_base", 10000.0))
    return {
        **shared,
        "architectures": [family.hf_classes[model_type]],
        "model_type": model_type,
        "num_key_value_heads": kv_heads,
        "hidden_act": "silu",
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(metadata, arch, tensors, rope_theta, head_dim),
        "attention_bias": model_type != "qwen2" and "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "sliding_window": get("attention.sliding_window"),
    }


def _model_type(metadata: Mapping[str, Any]) -> str:
    arch = metadata.get("general.architecture")
    family = family_for_gguf(arch)
    names = f"{metadata.get('general.name', '')} {metadata.get('general.basename', '')}".lower()
    if arch == "llama" and "mistral" in names:  # llama.cpp writes Mistral models as `llama`
        return "mistral"
    return family.gguf_architectures[arch]


def _unique(values) -> list[int]:
    out: list[int] = []
    for v in values:
        if v is not None and int(v) not in out:
            out.append(int(v))
    return out


def _rope_scaling(metadata: Mapping[str, Any], arch: str, tensors: Mapping[str, GGUFTensor],
                  theta: float, head_dim: int) -> dict | None:
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if "rope_freqs.weight" in tensors:  # llama3-style: the converter stores the per-frequency factors
        factors = tensor_values(tensors["rope_freqs.weight"])
        return _llama3_rope_scaling(factors, theta, head_dim, original)
    kind = metadata.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(metadata.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor}
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise ValueError(f"unsupported GGUF rope scaling type {kind!r}")


def llama3_rope_factors(theta: float, head_dim: int, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_context: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores as `rope_freqs` for HF's llama3 rope scaling."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    out = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < original_context / high_freq_factor, 1.0, out)
    return np.where(wavelen > original_context / low_freq_factor, factor, out)


def _llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int, original: int | None) -> dict:
    factor = float(factors.max())
    # Only the ratios low/original and high/original are observable, so any original context works.
    original = int(original or 8192)
    low, high = 1.0, 4.0
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    medium = (factors > 1 + 1e-4) & (factors < factor * (1 - 1e-4))
    if medium.sum() >= 2 and factor > 1:
        # In the smooth band 1/f = (1-s)/factor + s with s linear in original/wavelen: fit that line.
        s = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
        x = original * inv_freq[medium] / (2 * math.pi)
        slope, low = np.polyfit(s, x, 1)
        high = low + slope
        low, high = round(float(low), 4), round(float(high), 4)
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
               "original_max_position_embeddings": original}
    expected = llama3_rope_factors(theta, head_dim, factor, low, high, original)
    if expected.shape != factors.shape or not np.allclose(expected, factors, rtol=1e-3, atol=1e-4):
        raise ValueError("GGUF rope_freqs tensor does not match llama3 rope scaling; cannot express it as an HF config")
    return scaling


# ------------------------------------------------------------------------------------- tensor names

IGNORED = {"rope_freqs.weight"}  # folded into the config's rope_scaling
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)(?:\.(weight|bias))?")
_LAYER = re.compile(r"blk\.(\d+)\.")


def hf_name(gguf_name: str, family: Family) -> str | None:
    """The HF state-dict name of a GGUF tensor (None for tensors the model does not need), by the family's table."""
    if gguf_name in IGNORED:
        return None
    if m := _LAYER_TENSOR.fullmatch(gguf_name):
        layer, part, kind = m.groups()
        if kind is None:  # a bare parameter in the file too (qwen35's ssm_a)
            if part in family.gguf_layer_names:
                return f"model.layers.{layer}.{family.gguf_layer_names[part]}"
        elif f"{part}.{kind}" in family.gguf_layer_names:  # a bare parameter (no .weight in HF's name)
            return f"model.layers.{layer}.{family.gguf_layer_names[f'{part}.{kind}']}"
        elif part in family.gguf_layer_names:
            return f"model.layers.{layer}.{family.gguf_layer_names[part]}.{kind}"
    else:
        base, _, kind = gguf_name.rpartition(".")
        if base in family.gguf_global_names and kind in ("weight", "bias"):
            return f"{family.gguf_global_names[base]}.{kind}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


def keeps_quantized(t: GGUFTensor, kernel_types: tuple[str, ...]) -> bool:
    """Whether a tensor can stay in its block format: a matrix of a type the GPU kernels read."""
    if t.qtype.name not in kernel_types or len(t.shape) != 2:
        return False
    block = GGML_QUANT_SIZES[t.qtype][0]
    return t.shape[1] % block == 0


def stored_weight(t: GGUFTensor, raw: torch.Tensor, path: Path | None = None):
    """A matrix kept in its block format (keeps_quantized): its file bytes [rows, row bytes], left where they are
    (GGUFLinear / GGUFEmbedding put them on their device). path: the file, where raw is its bytes as they lie
    there (read from the file in place of the mapping)."""
    from flashdraft.layers.quantized import QuantizedWeight
    source = (str(path), t.offset) if path is not None and t.offset >= 0 else None
    return QuantizedWeight(raw.view(t.shape[0], -1), t.qtype.name, tuple(t.shape), source=source)


def mapped_bytes(t: GGUFTensor) -> torch.Tensor:
    """A tensor's stored bytes as a uint8 view of the file's read-only mapping (no copy: never write to it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch warns that the array is not writable
        return torch.from_numpy(np.asarray(t.data).view(np.uint8).reshape(-1))


def mtp_name(gguf_name: str, first: int, family: Family) -> str | None:
    """The name inside the family's MTP block of a tensor of the file's MTP layers (blk.N with N >= `first`, the
    model's layer count): its `nextn` parts by the family's table, the layer's own as in layer N - first."""
    m = _LAYER.match(gguf_name)
    rest = gguf_name[m.end():]
    if rest.startswith("nextn."):
        base, _, kind = rest.rpartition(".")
        name = family.gguf_mtp_names.get(base)
        return None if name is None else f"{name}.{kind}"
    name = hf_name(f"blk.{int(m[1]) - first}.{rest}", family)
    return None if name is None else name.replace("model.layers.", "layers.", 1)


def iter_gguf_tensors(gguf: GGUFFile | str | Path, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu", progress: bool = False,
                      keep_quantized: bool = False, mtp: bool = False,
                      names: Callable[[str], str | None] | None = None) -> Iterator[tuple[str, Any]]:
    """(HF name, tensor) pairs in HF layout, dequantised one at a time straight into `dtype` on `device`.
    keep_quantized: matrices of a type the GPU kernels read come as `layers.quantized.QuantizedWeight` (their
    file bytes in HF row order, still on the host: the module that reads them puts them on `device`); the rest
    are dequantised as before. mtp: only the file's MTP (nextn) layers, named as in the family's MTP block
    (`mtp_name`); otherwise they are left out. names: the HF name of each GGUF tensor (None: not read), where a
    file holds tensors beyond its family's table (a drafter's); default the family's (`hf_name`)."""
    from flashdraft.layers.quantized import kernel_types
    kept = kernel_types() if keep_quantized else ()
    if not isinstance(gguf, GGUFFile):
        gguf = read_gguf(gguf)
    config = gguf_to_hf_config(gguf)
    family = family_for_gguf(gguf.architecture)
    norm_shift = family.gguf_norm_shift.get(gguf.architecture, 0.0)
    permute_heads = {}
    if gguf.architecture in family.gguf_permuted_qk:
        permute_heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    items = list(gguf.tensors.values())
    if progress:
        from tqdm import tqdm
        items = tqdm(items, desc=f"loading {gguf.path.name}", unit="tensor")
    first_mtp = config["num_hidden_layers"]
    for t in items:
        in_mtp = (m := _LAYER.match(t.name)) is not None and int(m[1]) >= first_mtp  # the layers after the model's
        if in_mtp != mtp:
            continue
        name = mtp_name(t.name, first_mtp, family) if mtp else names(t.name) if names else hf_name(t.name, family)
        if name is None:
            continue
        convert = family.gguf_values(name) if family.gguf_values is not None else None
        kept_here = convert is None and keeps_quantized(t, kept)
        raw = mapped_bytes(t) if kept_here else tensor_bytes(t)
        part = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        permuted = part in permute_heads
        if permuted:
            raw = _unpermute(raw, t.shape[0], permute_heads[part])
        if kept_here:
            yield name, stored_weight(t, raw, None if permuted else gguf.path)
            continue
        shifted = name.endswith("norm.weight") and norm_shift != 0
        in_float32 = shifted or convert is not None
        try:
            tensor = dequantize(raw, t.qtype, t.shape, torch.float32 if in_float32 else dtype, device)
        except ValueError as e:
            raise ValueError(f"tensor {t.name}: {e}") from None
        if shifted:
            tensor = tensor - norm_shift
        if convert is not None:
            tensor = convert(tensor)
        yield name, tensor.to(dtype) if in_float32 else tensor


def _unpermute(raw: torch.Tensor, rows: int, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (made for its interleaved RoPE).

    Each head's rows are stored as (head_dim/2, 2) pairs instead of HF's (2, head_dim/2) halves.
    Quantisation blocks never span rows, so reordering the stored rows equals reordering the weight's rows."""
    per_row = raw.numel() // rows
    return raw.reshape(n_heads, rows // n_heads // 2, 2, per_row).transpose(1, 2).reshape(-1)


def load_gguf_state_dict(path: str | Path | GGUFFile, dtype: torch.dtype = torch.float32,
                         device: str | torch.device = "cpu", progress: bool = False) -> dict[str, torch.Tensor]:
    """The whole model as an HF-named state dict (tied models have no `lm_head.weight`)."""
    return dict(iter_gguf_tensors(path, dtype, device, progress))
