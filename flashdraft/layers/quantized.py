"""GGUF weights kept in their file's block format: a linear layer and a token embedding over the bytes, through
kernels/gguf_matmul.py. A model never learns about them: the loader swaps them in for `Linear` / `nn.Embedding`
where the file holds a quantized matrix (`swap_quantized`)."""
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from flashdraft.quant.ggml import stored_blocks

log = logging.getLogger("flashdraft")

FEW_ROWS = 64  # up to this many rows a product runs the fused kernel; more dequantize into a scratch buffer
GRAPH_SPLIT_SUMS = True  # under torch.compile, K's partial sums added by the graph (kernels/split_k.add_splits)


@dataclass
class QuantizedWeight:
    """One GGUF matrix as the file holds it: `data` uint8 [out_features, bytes per row] of `qtype` blocks, on the
    host (a view of the file's mapping: nothing copied yet) or on a device. GGUFLinear and GGUFEmbedding put the
    bytes on their device in the kernels' order (stored_blocks)."""
    data: Tensor
    qtype: str
    shape: tuple[int, int]  # (out_features, in_features)
    stored: Tensor | None = field(default=None, repr=False, compare=False)  # set by stored_on: a tied matrix's, shared
    # (file, byte offset) where `data`'s bytes lie as they are, read from there in place of the mapping (copied_to)
    source: tuple[str, int] | None = field(default=None, repr=False, compare=False)


def stored_on(parts: list[QuantizedWeight], device: torch.device | str) -> Tensor:
    """Parts of one type as one matrix on `device` in the kernels' order (stored_blocks; rows stacked): the matrix
    is allocated once and each part written into its rows as it arrives (file bytes to the device, reordered
    there), so the device never holds a matrix twice and loading leaves no freed holes between the weights (a
    24 GB card could not hold the Gemma 4 31B shape's parts beside their concatenation). A single matrix is
    stored once, however many modules read it (a tied embedding and output layer)."""
    if len(parts) == 1 and parts[0].stored is not None:
        return parts[0].stored
    first = stored_blocks(parts[0].data[:1].to("cpu", copy=True), parts[0].qtype)  # one row: the stored row size
    out = torch.empty(sum(p.data.shape[0] for p in parts), first.shape[1], dtype=torch.uint8, device=device)
    row = 0
    for p in parts:
        raw = copied_to(p.data, device, p.source)
        out[row:row + len(raw)] = stored_blocks(raw, p.qtype)
        row += len(raw)
    if len(parts) == 1:
        parts[0].stored = out
    return out


STAGING_BYTES = 64 << 20
_STAGING: list[tuple[Tensor, "torch.cuda.Event"]] = []  # two pinned buffers, each with the event of its last copy
READ_THREADS = 8
READ_PIECE = 8 << 20
_READERS: ThreadPoolExecutor | None = None
_FILES: dict[str, int] = {}  # open descriptors by path (a model's few files; kept for the process)


def read_file(out: Tensor, path: str, offset: int) -> None:
    """out (uint8, contiguous, on the host) = the file's bytes from offset, read by READ_THREADS threads with
    pread into out itself: where copying from the file's mapping faults every page in first (measured on a
    2-core CPU from the page cache: 7.3 GB/s with one thread against 4.2 through the mapping with two)."""
    global _READERS
    if _READERS is None:
        _READERS = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="read-weights")
    fd = _FILES.get(path)
    if fd is None:
        fd = _FILES[path] = os.open(path, os.O_RDONLY)
    view = memoryview(out.numpy())

    def read(start: int) -> None:
        end = min(start + READ_PIECE, len(view))
        while start < end:
            got = os.preadv(fd, [view[start:end]], offset + start)
            if got <= 0:
                raise OSError(f"{path}: the file ends at {offset + start:,} bytes, before the weights do")
            start += got
    list(_READERS.map(read, range(0, len(view), READ_PIECE)))


def copied_to(host: Tensor, device: torch.device | str, source: tuple[str, int] | None = None) -> Tensor:
    """A copy of `host` on `device` (a copy on the host too: a file's mapping is read-only). To a GPU through two
    pinned buffers in turn: one piece's bytes are read while the previous piece crosses to the GPU (also across
    calls: a matrix's copy overlaps the next one's), where a copy from pageable memory stages each piece through
    the driver's buffer and waits. source: (file, offset) holding host's bytes, read from there (read_file)."""
    device = torch.device(device)
    if device.type != "cuda" or host.dtype != torch.uint8:
        return host.to(device, copy=True)
    if not _STAGING:
        _STAGING.extend((torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True), torch.cuda.Event())
                        for _ in range(2))
    src = host.contiguous().view(-1)
    out = torch.empty(host.shape, dtype=torch.uint8, device=device)
    dst = out.view(-1)
    for i, start in enumerate(range(0, src.numel(), STAGING_BYTES)):
        buf, done = _STAGING[i % 2]
        n = min(STAGING_BYTES, src.numel() - start)
        done.synchronize()  # the buffer's previous piece has crossed
        if source is None:
            buf[:n].copy_(src[start:start + n])
        else:
            read_file(buf[:n], source[0], source[1] + start)
        dst[start:start + n].copy_(buf[:n], non_blocking=True)
        done.record()
    return out


def same_type_runs(parts: list[QuantizedWeight]) -> list[list[QuantizedWeight]]:
    """Neighbouring parts of one type grouped (each group one matrix: one kernel launch over more rows)."""
    runs = [[parts[0]]]
    for p in parts[1:]:
        if p.qtype == runs[-1][0].qtype:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


_SCRATCH: dict[tuple[torch.device, torch.dtype], Tensor] = {}
# A prefill's matrices are expanded this many values at a time (row slices), so the reused buffer stays small
# beside the weights: a whole fused gate/up matrix of the Gemma 4 31B shape would hold 462 MB for good.
SCRATCH_VALUES = 1 << 25


def scratch(numel: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """A buffer reused by every prefill dequantization on a device (grown to the largest slice)."""
    buf = _SCRATCH.get((device, dtype))
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[(device, dtype)] = torch.empty(numel, device=device, dtype=dtype)
    return buf


def expanded_product(rows: Tensor, w: Tensor, qtype: str, k: int) -> Tensor:
    """rows [M, k] times the quantized matrix w (stored rows) through cuBLAS: w expanded a slice of output rows at
    a time into the shared scratch buffer (SCRATCH_VALUES)."""
    from flashdraft.kernels.gguf_matmul import dequantize_gguf
    step = max(16, SCRATCH_VALUES // k // 16 * 16)
    outs = [F.linear(rows, dequantize_gguf(w[a:a + step], qtype, k, rows.dtype,
                                           scratch(min(step, w.shape[0] - a) * k, rows.device, rows.dtype)))
            for a in range(0, w.shape[0], step)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


class GGUFLinear(nn.Module):
    """A linear layer over one or more quantized row blocks (a fused q/k/v or gate/up keeps each part's own type:
    Q4_K_M files mix Q4_K and Q6_K). Few rows: the fused kernel per part; more: each part dequantized into a
    shared scratch buffer, then one cuBLAS product."""

    def __init__(self, parts: list[QuantizedWeight], bias: bool = False, device: torch.device | str | None = None):
        """device: where the weights go (default: where the parts' bytes are)."""
        super().__init__()
        self.in_features = parts[0].shape[1]
        if any(p.shape[1] != self.in_features for p in parts):
            raise ValueError("fused quantized parts must share in_features")
        runs = same_type_runs(parts)
        self.qtypes = [run[0].qtype for run in runs]
        self.sizes = [sum(p.shape[0] for p in run) for run in runs]
        self.out_features = sum(self.sizes)
        for i, run in enumerate(runs):
            data = stored_on(run, device or run[0].data.device)
            self.register_buffer(f"qweight{i}", data, persistent=False)  # not in state dicts
        self.bias = nn.Parameter(torch.empty(self.out_features, device="meta")) if bias else None

    def parts(self) -> list[tuple[Tensor, str]]:
        return [(getattr(self, f"qweight{i}"), q) for i, q in enumerate(self.qtypes)]

    def forward(self, x: Tensor) -> Tensor:
        return self._product(x, self.parts(), self.bias)

    def part(self, x: Tensor, start: int, stop: int) -> Tensor:
        """x times output rows [start, stop) only (one projection of a fused matrix, as layers.linear.Linear.part):
        each part's rows in the range, its stored rows being whole rows of blocks."""
        parts, first = [], 0
        for w, qtype in self.parts():
            a, b = max(start - first, 0), min(stop - first, w.shape[0])
            if a < b:
                parts.append((w[a:b], qtype))
            first += w.shape[0]
        return self._product(x, parts, None if self.bias is None else self.bias[start:stop])

    def _product(self, x: Tensor, parts: list[tuple[Tensor, str]], bias: Tensor | None) -> Tensor:
        from flashdraft.kernels import split_k
        from flashdraft.kernels.gguf_matmul import gguf_matmul, gguf_matmul_partials, gguf_matmul_parts
        rows = x.reshape(-1, self.in_features)
        k = self.in_features
        if rows.shape[0] <= FEW_ROWS and GRAPH_SPLIT_SUMS and torch.compiler.is_compiling():
            # the split-K sums as graph operations: fused into the kernel that reads the product
            outs = [split_k.add_splits(p, x.dtype) for p in
                    gguf_matmul_partials(rows, [w for w, _ in parts], ",".join(q for _, q in parts), k)]
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        elif rows.shape[0] <= FEW_ROWS and len(parts) == 1:
            out = gguf_matmul(rows, *parts[0], k)
        elif rows.shape[0] <= FEW_ROWS:
            out = gguf_matmul_parts(rows, [w for w, _ in parts], ",".join(q for _, q in parts), k)
        else:
            outs = [expanded_product(rows, w, q, k) for w, q in parts]
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        out = out if bias is None else out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtypes={self.qtypes}"


class GGUFEmbedding(nn.Module):
    """A token embedding over a quantized table: the rows of the step's tokens are gathered, then dequantized."""

    def __init__(self, weight: QuantizedWeight, device: torch.device | str | None = None):
        super().__init__()
        self.qtype, (self.num_embeddings, self.embedding_dim) = weight.qtype, weight.shape
        self.register_buffer("qweight", stored_on([weight], device or weight.data.device), persistent=False)
        self.dtype = torch.bfloat16

    def forward(self, ids: Tensor) -> Tensor:
        from flashdraft.kernels.gguf_matmul import dequantize_gguf
        rows = self.qweight[ids.reshape(-1)]
        return dequantize_gguf(rows, self.qtype, self.embedding_dim, self.dtype).reshape(*ids.shape, -1)


def kernel_types() -> tuple[str, ...]:
    from flashdraft.kernels.gguf_matmul import TYPES
    return tuple(TYPES)


def swap_quantized(model: nn.Module, quantized: dict[str, QuantizedWeight], dtype: torch.dtype,
                   device: torch.device | str | None = None) -> None:
    """Replace the model's Linear / Embedding modules whose weights `quantized` holds (HF names) by GGUF modules
    with their bytes on `device` (default: where they are). A fused projection (fuse_linears_on_load) takes its
    parts in order; the names taken are removed."""
    for module_name, module in list(model.named_modules()):
        for fused, parts in getattr(module, "fused_parts", {}).items():
            names = [f"{module_name}.{p}.weight" if module_name else f"{p}.weight" for p in parts]
            if all(n in quantized for n in names):
                old = getattr(module, fused)
                setattr(module, fused, GGUFLinear([quantized.pop(n) for n in names], old.bias is not None, device))
    for name in list(quantized):
        path = name.removesuffix(".weight")
        old = model.get_submodule(path)
        weight = quantized.pop(name)
        if isinstance(old, nn.Embedding):
            new = GGUFEmbedding(weight, device)
            new.dtype = dtype
        elif isinstance(old, nn.Linear):
            new = GGUFLinear([weight], old.bias is not None, device)
        else:
            raise ValueError(f"{name}: no quantized module for {type(old).__name__}")
        model.set_submodule(path, new)
