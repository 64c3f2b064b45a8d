"""GGML blocks' values, vectorised in torch: a dequantiser per block type, and `dequantize` from a tensor's stored
bytes to floats."""
import math
from typing import Callable, Protocol

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from flashdraft.quant.iq4 import IQ4_NL_VALUES

QK_K = 256
# Bound on the float32 temporaries of one dequantisation step (elements), so a large embedding on a GPU
# does not need several full-size intermediates at once.
CHUNK_ELEMENTS = 1 << 24


def _f16(cols: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 values stored as byte columns [n, 2k] -> float32 [n, k]."""
    return cols.contiguous().view(torch.float16).float()


def _bits(x: torch.Tensor, shifts: range | list[int], mask: int) -> torch.Tensor:
    """Bit fields of the bytes [..., B] at each shift -> [..., len(shifts), B] (shift-major)."""
    return torch.stack([(x >> s) & mask for s in shifts], dim=-2)


def _low_bits_le(x: torch.Tensor) -> torch.Tensor:
    """Bytes [n, B] read as one little-endian bit string -> [n, 8B] of 0/1 (bit j = byte j//8, bit j%8)."""
    return torch.stack([(x >> s) & 1 for s in range(8)], dim=-1).reshape(x.shape[0], -1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    return b[:, 2:].contiguous().view(torch.int8).float() * d


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = _bits(b[:, 2:], [0, 4], 0xF).reshape(len(b), 32).to(torch.int8) - 8
    return d * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _bits(b[:, 4:], [0, 4], 0xF).reshape(len(b), 32).float()
    return d * q + m


def _q5(b: torch.Tensor) -> torch.Tensor:
    """The 5-bit values of a Q5_0/Q5_1 block tail: qh[4] then qs[16]."""
    ql = _bits(b[:, 4:], [0, 4], 0xF).reshape(len(b), 32)
    return ql | (_low_bits_le(b[:, :4]) << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    return d * (_q5(b[:, 2:]).to(torch.int8) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return d * _q5(b[:, 4:]).float() + m


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = len(b)
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0xF).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    q = _bits(qs.reshape(n, 2, 32), [0, 2, 4, 6], 3).reshape(n, 16, 16).float()
    return (dl * q - ml).reshape(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = len(b)
    hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = _f16(b[:, 108:110])
    low = _bits(scales[:, :8], [0, 4], 0xF).reshape(n, 16)
    high = _bits(scales[:, 8:], [0, 2, 4, 6], 3).reshape(n, 16)
    sc = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (d * sc).reshape(n, 16, 1)
    ql = _bits(qs.reshape(n, 2, 32), [0, 2, 4, 6], 3).reshape(n, 16, 16)
    qh = _bits(hmask.reshape(n, 1, 32), range(8), 1).reshape(n, 16, 16) ^ 1  # a set bit means no -4 offset
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q).reshape(n, QK_K)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins packed into 12 bytes (Q4_K, Q5_K)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 63, (md & 0xF) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = len(b)
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    q = _bits(b[:, 16:].reshape(n, 4, 32), [0, 4], 0xF).reshape(n, 8, 32).float()
    return ((d * sc).reshape(n, 8, 1) * q - (dmin * mn).reshape(n, 8, 1)).reshape(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = len(b)
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qh = _bits(b[:, 16:48].reshape(n, 1, 32), range(8), 1).reshape(n, 8, 32)
    ql = _bits(b[:, 48:].reshape(n, 4, 32), [0, 4], 0xF).reshape(n, 8, 32)
    q = (ql | (qh << 4)).float()
    return ((d * sc).reshape(n, 8, 1) * q - (dmin * mn).reshape(n, 8, 1)).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = len(b)
    sc = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[:, 208:210])
    ql = _bits(b[:, :128].reshape(n, 2, 64), [0, 4], 0xF).reshape(n, 8, 32)
    qh = _bits(b[:, 128:192].reshape(n, 2, 32), [0, 2, 4, 6], 3).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return ((d * sc).reshape(n, 16, 1) * q).reshape(n, QK_K)


IQ4_VALUES = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, :2])
    q = _bits(b[:, 2:], [0, 4], 0xF).reshape(len(b), 32)
    return d * IQ4_VALUES.to(b.device)[q.long()]


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = len(b)
    d = _f16(b[:, :2])
    scales_h = b[:, 2].long() | (b[:, 3].long() << 8)
    ib = torch.arange(8, device=b.device)
    low = (b[:, 4 + ib // 2].long() >> (4 * (ib % 2))) & 0xF
    high = (scales_h[:, None] >> (2 * ib)) & 3
    dl = d * ((low | (high << 4)) - 32).float()  # [n, 8]
    q = _bits(b[:, 8:].reshape(n, 8, 16), [0, 4], 0xF).reshape(n, 8, 32)
    return (dl[:, :, None] * IQ4_VALUES.to(b.device)[q.long()]).reshape(n, QK_K)


Q = GGMLQuantizationType
BLOCK_DEQUANTISERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1,
    Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k, Q.IQ4_NL: _iq4_nl, Q.IQ4_XS: _iq4_xs,
}
FLOAT_TYPES = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
SUPPORTED_TYPES = tuple(FLOAT_TYPES) + tuple(BLOCK_DEQUANTISERS)


def dequantize(raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...],
               dtype: torch.dtype = torch.float32, device: str | torch.device | None = None) -> torch.Tensor:
    """Stored bytes of one tensor (uint8, any shape) -> float tensor of `shape` in `dtype` on `device`."""
    qtype = GGMLQuantizationType(qtype)
    if qtype not in FLOAT_TYPES and qtype not in BLOCK_DEQUANTISERS:
        raise ValueError(f"unsupported GGUF tensor type {qtype.name} "
                         f"(supported: {', '.join(t.name for t in SUPPORTED_TYPES)})")
    raw = raw.contiguous().view(torch.uint8).reshape(-1).to(device=device if device is not None else raw.device)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    numel = math.prod(shape)
    if raw.numel() != numel // block_size * type_size or numel % block_size:
        raise ValueError(f"{qtype.name} data of {raw.numel()} bytes does not hold a tensor of shape {tuple(shape)}")
    if qtype in FLOAT_TYPES:
        return raw.view(FLOAT_TYPES[qtype]).to(dtype).reshape(shape)
    blocks = raw.reshape(-1, type_size)
    out = torch.empty(numel, dtype=dtype, device=raw.device)
    step = max(1, CHUNK_ELEMENTS // block_size)
    fn = BLOCK_DEQUANTISERS[qtype]
    for start in range(0, len(blocks), step):
        out[start * block_size:(start + step) * block_size] = fn(blocks[start:start + step]).reshape(-1)
    return out.reshape(shape)


class StoredTensor(Protocol):
    """A tensor as a file stores it (formats/gguf.GGUFTensor)."""
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


def tensor_bytes(t: StoredTensor) -> torch.Tensor:
    """A tensor's stored bytes as a fresh uint8 torch tensor (a copy: the mapping is read-only)."""
    return torch.from_numpy(np.ascontiguousarray(t.data).view(np.uint8).reshape(-1).copy())


def tensor_values(t: StoredTensor) -> np.ndarray:
    """A (small) tensor's values as float32."""
    return dequantize(tensor_bytes(t), t.qtype, t.shape, torch.float32).numpy()
