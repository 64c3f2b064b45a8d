"""llama.cpp's IQ4 value table (kvalues_iq4nl: a nibble indexes 16 int8 levels, quant/iq4.IQ4_NL_VALUES) in the
forms the kernels use:
- `iq4_table(device)`: the int8 tensor (its four int32 words are the byte-permute lookup's operands);
- `iq4_nibbles`: eight nibbles of a word looked up at once by byte permutes (PRMT), for the integer kernels;
- `iq4_value`: one nibble per element as float32 by a degree-4 polynomial rounded to the nearest integer, exact
  for all 16 levels (the fit's largest residual is 0.476), for the kernels that expand values into floats: a
  few FMAs instead of a gather from memory per value;
- `IQ4_EIGHT`: IQ4_PAIRS for the int8 mma kernel's tiles (eight int8 at a time, the table as immediates).
"""
import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from flashdraft.quant.iq4 import IQ4_NL_VALUES as IQ4_VALUES

# least squares over n - 7.5 (np.polyfit, degree 4), rounded to float32; checked below
_C4, _C3, _C2, _C1, _C0 = (0.0013247202150523663, 0.08095842599868774, -0.12571197748184204, 11.431296348571777,
                           -4.274739742279053)


def _horner32(n: int) -> float:
    m, v = np.float32(n - 7.5), np.float32(0)
    for c in (_C4, _C3, _C2, _C1, _C0):
        v = np.float32(v * m + np.float32(c))
    return float(v)


assert all(abs(_horner32(n) - v) < 0.49 for n, v in enumerate(IQ4_VALUES)), "iq4_value's polynomial"
C4, C3, C2, C1, C0 = (tl.constexpr(c) for c in (_C4, _C3, _C2, _C1, _C0))


@triton.jit
def iq4_value(nib):
    """Nibbles (an integer tensor, 0..15) -> their IQ4 levels as float32."""
    m = nib.to(tl.float32) - 7.5
    v = (((C4 * m + C3) * m + C2) * m + C1) * m + C0
    return tl.floor(v + 0.5)


_TABLES: dict[torch.device, Tensor] = {}


def iq4_table(device: torch.device) -> Tensor:
    """IQ4_VALUES as an int8 tensor on `device` (cached)."""
    if device not in _TABLES:
        _TABLES[device] = torch.tensor(IQ4_VALUES, dtype=torch.int8, device=device)
    return _TABLES[device]


# A word of eight nibbles -> the table values of nibbles 0-3 and of nibbles 4-7 (four int8 each, in nibble order:
# byte 0's low and high nibble, then byte 1's). The word itself is the PRMT selector (bit 3 of each nibble
# cleared): one PRMT per half of the table looks up four nibbles at once and a third picks each byte's half by the
# nibble's bit 3 (llama.cpp's get_int_from_table_16, less its two permutes back into low and high nibbles: x is
# quantized in this order instead, gguf_gemv.quantize_rows(..., IQ4_ORDER)).
def _lookup_asm(t0: str, t1: str, t2: str, t3: str) -> str:
    """The word $2 of eight nibbles -> $0, $1: the table values of nibbles 0-3 and 4-7; t0..t3: the table's four
    words as operands."""
    return f"""{{
.reg .b32 s0, s1, sel, a, b;
and.b32 s0, $2, 0x77777777;
shr.b32 s1, s0, 16;
and.b32 sel, $2, 0x88888888;
shr.b32 sel, sel, 1;
or.b32 sel, sel, 0x32103210;
prmt.b32 a, {t0}, {t1}, s0;
prmt.b32 b, {t2}, {t3}, s0;
prmt.b32 $0, a, b, sel;
shr.b32 sel, sel, 16;
prmt.b32 a, {t0}, {t1}, s1;
prmt.b32 b, {t2}, {t3}, s1;
prmt.b32 $1, a, b, sel;
}}"""


# The integer kernels': the table's four words come in as registers ($3-$6, loaded once); as immediates, Triton 3.6
# re-materialised them before every PRMT there.
IQ4_PAIRS = tl.constexpr(_lookup_asm("$3", "$4", "$5", "$6"))
# The same for Gluon's int8 tiles taken eight at a time (pack=8: two registers an operand): the word of four bytes
# $2 ($3, the tile's other four bytes, unused) -> the levels of its eight nibbles as int8, $0 those of bytes 0 and 1
# and $1 those of bytes 2 and 3, each byte's low nibble first (x quantized in IQ4_ORDER meets them), the table's
# words as immediates.
IQ4_EIGHT = tl.constexpr(_lookup_asm(*(f"{int(w):#010x}" for w in np.array(IQ4_VALUES, dtype=np.int8).view(np.uint32))))


@triton.jit
def _table_entry(table, nib):
    """Entry nib (0..15) of the table's four words, zero-extended (a byte)."""
    return (tl.load(table + (nib >> 2)) >> (8 * (nib & 3))) & 0xFF


@triton.jit
def iq4_table_words(table):
    """The table's four int32 words (table: IQ4_VALUES as int32 words, iq4_table(...).view(torch.int32)), loaded
    once per program, before its loop (the loop's waits on the kernel before keep loads in it from being hoisted)."""
    return tl.load(table), tl.load(table + 1), tl.load(table + 2), tl.load(table + 3)


@triton.jit
def iq4_nibbles(words, table, t0, t1, t2, t3, EMULATE: tl.constexpr):
    """int32 words of nibbles -> (table values of nibbles 0-3, of nibbles 4-7), each a word of four int8
    (kvalues_iq4nl), nibble 2i being byte i's low nibble and 2i + 1 its high one. table: IQ4_VALUES as four int32
    words in memory, t0..t3: the same words loaded (`iq4_table_words`)."""
    if EMULATE:
        lo, hi = tl.zeros_like(words), tl.zeros_like(words)
        for i in tl.static_range(4):
            lo = lo | (_table_entry(table, (words >> (4 * i)) & 15) << (8 * i))
            hi = hi | (_table_entry(table, (words >> (16 + 4 * i)) & 15) << (8 * i))
    else:
        lo, hi = tl.inline_asm_elementwise(IQ4_PAIRS, "=r,=r,r,r,r,r,r", [words, t0, t1, t2, t3],
                                           dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    return lo, hi
