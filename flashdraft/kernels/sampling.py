"""The sampler's race in Triton, for CUDA: one launch draws a token per row from its filtered candidates, with the
noise computed in the kernel from a counter-based generator, so a draw needs no generator state, no host round trip
and no [rows, V] noise tensor. engine/sampling.py holds the definition (`race_reference`, the same arithmetic in
torch operations, which the CPU runs) and the filters' semantics.

Noise: Philox4x32-10 (Random123's, as tl.philox computes it) with key = the request's 64-bit seed and counter =
(vocabulary id / 4, token position, 0, 0); its word id % 4, r, gives u = (2 (r >> 9) + 1) / 2^24 in (0, 1) (every
value exact in float32, never 0 or 1), then Gumbel noise g = -log(-log u). A row's token is the kept candidate with the
largest v / T + g (the Gumbel-max trick: the same distribution as torch.multinomial over the filtered softmax,
as the exponential race it replaces). The noise of a token depends only on (seed, position, id): not on the row's
place in a batch, nor on the order the candidates come in, nor on what was drawn before.

Two launches:
- `race_sorted`: candidates sorted descending (top-k's or a sort's), one program per row, walked in blocks: top-p by
  the cumulative softmax mass (two passes: the normaliser, then the scan), min-p against the first candidate.
- `race_chunks`: a whole unsorted row (no top-k, no top-p), split into chunks across programs (one program per
  row would leave a 262k-token row to one SM); each chunk's best (score, id), the best chunk picked by torch.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

CHUNK = 4096  # race_chunks: ids a program covers


@triton.jit
def _gumbel(r):
    """Gumbel(0, 1) float32 of 32-bit words r: 23 bits as u = (2 r' + 1) / 2^24 in (0, 1), then -log(-log u)."""
    u = ((r >> 9).to(tl.float32) * 2.0 + 1.0) * 5.9604644775390625e-08
    return -tl.log(-tl.log(u))


@triton.jit
def gumbel_noise(seed, ids, position):
    """Gumbel noise [BLOCK] float32 of vocabulary `ids` [BLOCK] (int) at token `position` (an int64 scalar) under
    `seed` (an int64 scalar in [0, 2^63)): word id % 4 of Philox4x32-10(key = seed, counter = (id / 4, position,
    0, 0))."""
    c0 = (ids >> 2).to(tl.uint32)
    c1 = c0 * 0 + position.to(tl.uint32)
    zero = c0 * 0
    w0, w1, w2, w3 = tl.philox(seed, c0, c1, zero, zero)
    word = ids & 3
    return _gumbel(tl.where(word == 0, w0, tl.where(word == 1, w1, tl.where(word == 2, w2, w3))))


@triton.jit
def gumbel_run(seed, start, position, BLOCK: tl.constexpr):
    """gumbel_noise of the ids start, start + 1, ..., start + BLOCK - 1 (start a multiple of 4): one Philox call a
    counter, its four words for four ids."""
    c0 = (start // 4 + tl.arange(0, BLOCK // 4)).to(tl.uint32)
    c1 = c0 * 0 + position.to(tl.uint32)
    zero = c0 * 0
    w0, w1, w2, w3 = tl.philox(seed, c0, c1, zero, zero)
    return _gumbel(tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [BLOCK]))  # w0[0], w1[0], w2[0], ...


@triton.jit
def _race_sorted_kernel(values_ptr, ids_ptr, settings_ptr, seeds_ptr, positions_ptr, out_ptr, C, stride_v, stride_i,
                        stride_seed, position_offset, TOP_P: tl.constexpr, MIN_P: tl.constexpr,
                        HAS_IDS: tl.constexpr, BLOCK: tl.constexpr):
    """One row's token from its C candidates, sorted descending (ids[i] the vocabulary id of values[i], or i)."""
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(settings_ptr)
    top_p = tl.load(settings_ptr + 1)
    log_min_p = tl.load(settings_ptr + 2)
    seed = tl.load(seeds_ptr + row * stride_seed)
    position = tl.load(positions_ptr + row) + position_offset
    values = values_ptr + row * stride_v
    ids_row = ids_ptr + row * stride_i
    first = tl.load(values).to(tl.float32)  # the largest candidate
    total = 0.0
    if TOP_P:  # the softmax's normaliser over the candidates, before the temperature (llama.cpp's order)
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, C, BLOCK):
            at = start + tl.arange(0, BLOCK)
            v = tl.load(values + at, mask=at < C, other=float("-inf")).to(tl.float32)
            acc += tl.exp(v - first)
        total = tl.sum(acc, 0)
    mass = 0.0  # top-p: the softmax mass of the blocks before
    best = -float("inf")
    best_at = 0
    nans = 0
    for start in range(0, C, BLOCK):
        at = start + tl.arange(0, BLOCK)
        inside = at < C
        v = tl.load(values + at, mask=inside, other=float("-inf")).to(tl.float32)
        nans += tl.sum((v != v).to(tl.int32), 0)
        keep = inside
        if TOP_P:  # kept while the mass before it is below top_p; the first always
            p = tl.exp(v - first) / total
            before = tl.cumsum(p, 0) + mass - p
            keep = keep & ((before < top_p) | (at == 0))
            mass += tl.sum(p, 0)
        if MIN_P:
            keep = keep & (v >= first + log_min_p)
        if HAS_IDS:
            ids = tl.load(ids_row + at, mask=inside, other=0)
        else:
            ids = at
        score = tl.where(keep, v / temperature + gumbel_noise(seed, ids, position), float("-inf"))
        block_best = tl.max(score, 0)
        better = block_best > best  # strictly: the first block holding the maximum wins
        best_at = tl.where(better, start + tl.argmax(score, 0), best_at)
        best = tl.where(better, block_best, best)
    if HAS_IDS:
        token = tl.load(ids_row + best_at).to(tl.int64)
    else:
        token = best_at.to(tl.int64)
    # nothing to draw: a NaN, or the largest candidate +inf (softmax is NaN) or -inf (every token banned)
    bad = (nans > 0) | (first != first) | (first == float("inf")) | (first == -float("inf"))
    tl.store(out_ptr + row, tl.where(bad, -1, token))


@triton.jit
def _race_chunks_kernel(values_ptr, settings_ptr, seeds_ptr, positions_ptr, threshold_ptr, best_ptr, at_ptr, V,
                        stride_v, stride_seed, position_offset, n_chunks, MIN_P: tl.constexpr, CHUNK: tl.constexpr,
                        BLOCK: tl.constexpr):
    """The best (score, id) of ids [chunk * CHUNK, (chunk + 1) * CHUNK) of one unsorted row."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature = tl.load(settings_ptr)
    seed = tl.load(seeds_ptr + row * stride_seed)
    position = tl.load(positions_ptr + row) + position_offset
    threshold = tl.load(threshold_ptr + row)
    values = values_ptr + row * stride_v
    best = -float("inf")
    best_at = chunk * CHUNK
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        at = start + tl.arange(0, BLOCK)
        inside = at < V
        v = tl.load(values + at, mask=inside, other=float("-inf")).to(tl.float32)
        keep = inside
        if MIN_P:
            keep = keep & (v >= threshold)
        score = tl.where(keep, v / temperature + gumbel_run(seed, start, position, BLOCK), float("-inf"))
        block_best = tl.max(score, 0)
        better = block_best > best
        best_at = tl.where(better, start + tl.argmax(score, 0), best_at)
        best = tl.where(better, block_best, best)
    tl.store(best_ptr + row * n_chunks + chunk, best)
    tl.store(at_ptr + row * n_chunks + chunk, best_at)


def race(values: Tensor, ids: Tensor | None, settings: Tensor, seeds: Tensor, positions: Tensor, *,
         sorted_: bool, top_p: bool, min_p: bool, position_offset: int = 0) -> Tensor:
    """tokens [R] int64 (-1: nothing to draw) of candidates `values` [R, C] (float32): with `sorted_` sorted
    descending, their vocabulary ids `ids` [R, C] (None: the column itself); else a whole row in vocabulary order
    (ids None, top_p off). settings: float32 [>= 3] (temperature, top_p, log(min_p)) on the device; seeds: int64 [R]
    or [1] (every row); positions: int64 [R], each row's token at positions[r] + position_offset.
    Fixed shapes, no host synchronisation: it runs inside a captured CUDA graph."""
    rows, c = values.shape
    values = values.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=values.device)
    stride_seed = 0 if seeds.numel() == 1 else 1
    if sorted_:
        if ids is not None:
            ids = ids.contiguous()
        block = min(max(triton.next_power_of_2(c), 16), 1024)
        _race_sorted_kernel[(rows,)](values, values if ids is None else ids, settings, seeds, positions, out, c,
                                     values.stride(0), 0 if ids is None else ids.stride(0), stride_seed,
                                     position_offset, TOP_P=top_p, MIN_P=min_p, HAS_IDS=ids is not None,
                                     BLOCK=block, num_warps=4 if block >= 512 else 2 if block >= 128 else 1)
        return out
    assert ids is None and not top_p, "an unsorted race covers a whole row in vocabulary order, without top-p"
    largest = values.amax(-1)  # NaN where a row holds one
    threshold = largest + settings[2] if min_p else largest
    chunk = min(CHUNK, max(triton.next_power_of_2(c), 16))  # a multiple of 4: gumbel_run's runs
    n_chunks = triton.cdiv(c, chunk)
    best = torch.empty(rows, n_chunks, dtype=torch.float32, device=values.device)
    at = torch.empty(rows, n_chunks, dtype=torch.int32, device=values.device)
    block = min(chunk, 1024)
    _race_chunks_kernel[(rows, n_chunks)](values, settings, seeds, positions, threshold, best, at, c,
                                          values.stride(0), stride_seed, position_offset, n_chunks, MIN_P=min_p,
                                          CHUNK=chunk, BLOCK=block, num_warps=4)
    pick = at.gather(-1, best.argmax(-1, keepdim=True))[:, 0].long()  # the first chunk holding the maximum
    return torch.where(largest.isfinite(), pick, -1)
