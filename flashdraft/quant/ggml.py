"""GGUF matrices' bytes as the kernels keep them (stored_blocks): the file's blocks, the same bytes, reordered so that
every field is read with aligned loads."""
import torch
from torch import Tensor

# Q6_K's 210-byte blocks leave every other block only 2-byte aligned, so the kernels could read them only in 16-bit
# halves (half the GPU's bandwidth; docs/perf-history.md, 2026-12-04 H200): in memory each block gets two zero bytes
# after its 210 (+0.95%), so every block starts on a 4-byte word. The block's own bytes are unchanged.
PADDED_BLOCK_BYTES = {"Q6_K": (210, 212)}
# block bytes and the byte ranges of a block's fields in the order field_planes keeps them: values, fifth bits, scales
FIELD_PLANES = {"Q8_0": (34, ((2, 34), (0, 2))), "IQ4_XS": (136, ((8, 136), (0, 8))),
                "Q4_0": (18, ((2, 18), (0, 2))), "IQ4_NL": (18, ((2, 18), (0, 2))), "Q4_1": (20, ((4, 20), (0, 4))),
                "Q5_0": (22, ((6, 22), (2, 6), (0, 2))), "Q5_1": (24, ((8, 24), (4, 8), (0, 4)))}

# super-block bytes and where its 128 nibble bytes start, for the types lane_grouped keeps
LANE_GROUPED = {"Q4_K": (144, 16), "Q5_K": (176, 48)}
# the field_planes types whose values plane is regrouped by lane (by_lane's groups and piece bytes): IQ4_XS's eight
# 16-byte sub-blocks. Q8_0's blocks by lane (groups 8, bytes 8) took its verify products 2% off and its decode step
# 4.4% longer on an H100 (docs/perf-history.md, 2026-12-06 H100)
LANE_RUNS = {"IQ4_XS": (8, 4)}


def stored_blocks(raw: Tensor, qtype: str) -> Tensor:
    """A matrix's file bytes [rows, row bytes] as the kernels keep them: Q6_K's blocks padded to 212 bytes, the
    32-weight block types' and IQ4_XS's rows in planes by field (field_planes), IQ4_XS's nibbles then by lane
    (by_lane), Q4_K's and Q5_K's nibbles grouped by lane (lane_grouped); the other K-quants as in the file."""
    if qtype in FIELD_PLANES:
        size, fields = FIELD_PLANES[qtype]
        out = field_planes(raw, size, fields)
        if qtype in LANE_RUNS:  # (IQ4_XS rows are whole super-blocks)
            values = raw.shape[1] // size * (fields[0][1] - fields[0][0])  # the values plane's bytes
            out[:, :values] = by_lane(out[:, :values], *LANE_RUNS[qtype])
        return out
    if qtype in LANE_GROUPED:
        return lane_grouped(raw, *LANE_GROUPED[qtype])
    if qtype not in PADDED_BLOCK_BYTES:
        return raw
    size, padded = PADDED_BLOCK_BYTES[qtype]
    blocks = raw.reshape(raw.shape[0], -1, size)
    out = torch.zeros(raw.shape[0], blocks.shape[1], padded, dtype=raw.dtype, device=raw.device)
    out[:, :, :size] = blocks
    return out.view(raw.shape[0], -1)


def field_planes(raw: Tensor, size: int, fields: tuple[tuple[int, int], ...]) -> Tensor:
    """Rows [rows, size * blocks] -> the same bytes per row as one plane per field: every block's bytes
    fields[0] (its values), then every block's fields[1], ... The 32-weight types' 18-24-byte blocks and Q8_0's 34
    leave their values only 2-byte aligned, IQ4_XS's 136 8-byte aligned, so a kernel could read them only in
    16- or 64-bit pieces; in planes the values are aligned 16-byte runs, each block's fifth bits a word, its scales
    aligned halves, and the row's size is unchanged."""
    blocks = raw.reshape(raw.shape[0], -1, size)
    return torch.cat([blocks[:, :, a:b].reshape(raw.shape[0], -1) for a, b in fields], 1)


def lane_grouped(raw: Tensor, size: int, start: int) -> Tensor:
    """Each super-block's 128 nibble bytes (at `start`) from the file's [group g][piece p][8 bytes] to [p][g][8]: the
    int8 tensor-core kernels give lane p of a quad piece p of every group (kernels/gguf_mma.py), now 32 contiguous
    bytes, one load where there were four, each touching a cache line per row for 8 bytes (docs/perf-history.md,
    2026-12-05 H200). The same bytes, the same size; the other fields stay in place."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, size)
    out = blocks.clone()
    out[:, :, start:start + 128] = by_lane(blocks[:, :, start:start + 128].reshape(rows, -1), 4, 8).view(rows, -1, 128)
    return out.view(rows, -1)


def by_lane(values: Tensor, groups: int, width: int) -> Tensor:
    """Bytes [rows, n] in runs of [group][piece p of 4][width bytes] -> [p][group][width]: lane p of an int8 mma
    fragment's quad reads piece p of every group, now one run of groups * width bytes (16-byte loads, where there
    were `groups` loads of width bytes, each touching a cache line per row). The same bytes; n a multiple of the
    run."""
    rows = values.shape[0]
    return values.reshape(rows, -1, groups, 4, width).transpose(2, 3).reshape(rows, -1)
