"""An experiment for verify widths (5-16 rows of x): Q4_K and Q6_K products on the int8 tensor cores with the
operands loaded straight into the `mma` fragments (Gluon: explicit layouts), llama.cpp's mmq shape.

Why: the float tensor-core kernel (kernels/gguf_matmul.py) runs a 16-row block at ~0.5 TB/s, bound by issue and
by its operands' trips through shared memory (docs/PERF.md, GGUF runs 6-10). Here each thread loads the 32-bit
words its `mma.m16n8k32.s8` fragment needs. Q4_K: four consecutive bytes of a nibble group are four consecutive
weights of sub-block 2g (low nibbles, one AND) and of 2g + 1 (high nibbles, a shift and an AND). Q6_K: a word of
ql bytes and one of qh bytes give four consecutive 6-bit values (a few LOP3s, signed by a bit trick); its scales
change every 16 weights, so each 32 weights are two mmas with the other half's weights zeroed. x is quantized to 8
bits per 32 values as the integer kernels take it (`gguf_gemv.quantize_rows`); each product is exact in int32 and
scaled in float32 (Q4_K: d * sc(row) * xd(token), minus dmin * m(row) * xs(token); Q6_K: d * sc(row) * xd(token)).

Not part of the package until it is measured on a GPU (Gluon has no interpreter: the CPU tests cannot run it).
    python benchmarks/gluon_mma.py                 # correctness against the `gguf` package, then timing
    python benchmarks/gluon_mma.py --sass          # compile for sm_90 without a GPU, read the SASS
"""
import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from flashdraft.kernels import gguf_gemv

TOKENS = gl.constexpr(16)  # the mma's N: rows of x, padded


@gluon.jit
def _scale_byte(a, b, c, J: gl.constexpr):
    """Q4_K's 6-bit scale and min of sub-block J (0..7) from the 12 scale bytes as words a, b, c (ggml's
    get_scale_min_k4), as float32."""
    if J < 4:
        sc = (a >> (8 * J)) & 63
        mn = (b >> (8 * J)) & 63
    else:
        sh: gl.constexpr = 8 * (J - 4)
        sc = ((c >> sh) & 15) | (((a >> sh) >> 6) & 3) << 4
        mn = ((c >> sh) >> 4 & 15) | (((b >> sh) >> 6) & 3) << 4
    return sc.to(gl.float32), mn.to(gl.float32)


@gluon.jit
def _half(bits):
    return (bits & 0xFFFF).to(gl.uint16).to(gl.float16, bitcast=True).to(gl.float32)


@gluon.jit
def _sub_block(acc, w, zero, a, b, s, d, dmin, b_ptr, b_ok, xds_ptr, toks, stride_xds, tok_ok, block0,
               J: gl.constexpr):
    """acc + sub-block J's product: the exact int32 mma of its 32 weights with x's 8-bit values, scaled."""
    xb = gl.load(b_ptr + 32 * J, mask=b_ok, other=0)
    prod = mma_v2(w, xb, zero)
    sc, mn = _scale_byte(a, b, s, J)
    pair = gl.load(xds_ptr + toks * stride_xds + block0 + J, mask=tok_ok, other=0)  # x's scale and sum, one load
    xd = pair.to(gl.int32).to(gl.float32, bitcast=True)
    xs = (pair >> 32).to(gl.int32).to(gl.float32, bitcast=True)
    return acc + prod.to(gl.float32) * ((d * sc)[:, None] * xd[None, :]) - (dmin * mn)[:, None] * xs[None, :]


@gluon.jit
def _q4k_mma_kernel(xq_ptr, xds_ptr, w_ptr, out_ptr, M, N, K, sb_per_split, stride_xq, stride_xds, stride_wn,
                    stride_os, stride_om, BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr):
    """xq_ptr: x's 8-bit values as bytes [M, K]; xds [M, K / 32] int64: each block's float32 scale (low half) and
    scaled sum (high half); w: Q4_K rows as bytes (144 per super-block); out [splits, M, N] float32 partial sums
    over this program's super-blocks."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4)
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    toks_l: gl.constexpr = gl.SliceLayout(0, mma)
    pid_n, split = gl.program_id(0), gl.program_id(1)
    first = split * sb_per_split
    last = gl.minimum(first + sb_per_split, K // 256)

    a_rows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_l))
    a_k = gl.arange(0, 32, layout=gl.SliceLayout(0, a_l))
    a_ptr = w_ptr + a_rows.to(gl.int64)[:, None] * stride_wn + 16 + a_k[None, :]
    a_ok = (a_rows < N)[:, None]

    b_k = gl.arange(0, 32, layout=gl.SliceLayout(1, b_l))
    b_t = gl.arange(0, TOKENS, layout=gl.SliceLayout(0, b_l))
    b_ptr = xq_ptr + b_t[None, :] * stride_xq + b_k[:, None]
    b_ok = (b_t < M)[None, :]

    rows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=rows_l)
    row_ok = rows < N
    s_ptr = w_ptr + rows.to(gl.int64) * stride_wn
    toks = gl.arange(0, TOKENS, layout=toks_l)
    tok_ok = toks < M

    acc = gl.zeros([BLOCK_N, TOKENS], gl.float32, layout=mma)
    zero = gl.zeros([BLOCK_N, TOKENS], gl.int32, layout=mma)
    for c in range(first, last):
        head = gl.load(s_ptr.to(gl.pointer_type(gl.int32)) + 36 * c, mask=row_ok, other=0)
        a = gl.load(s_ptr.to(gl.pointer_type(gl.int32)) + 36 * c + 1, mask=row_ok, other=0)
        b = gl.load(s_ptr.to(gl.pointer_type(gl.int32)) + 36 * c + 2, mask=row_ok, other=0)
        s = gl.load(s_ptr.to(gl.pointer_type(gl.int32)) + 36 * c + 3, mask=row_ok, other=0)
        d, dmin = _half(head), _half(head >> 16)
        for g in gl.static_range(4):
            q = gl.load(a_ptr + 144 * c + 32 * g, mask=a_ok, other=0)
            lo = gl.inline_asm_elementwise("and.b32 $0, $1, 0x0F0F0F0F;", "=r,r", [q], dtype=gl.int8,
                                           is_pure=True, pack=4)
            hi = gl.inline_asm_elementwise("{ .reg .b32 t; shr.b32 t, $1, 4; and.b32 $0, t, 0x0F0F0F0F; }", "=r,r",
                                           [q], dtype=gl.int8, is_pure=True, pack=4)
            acc = _sub_block(acc, lo, zero, a, b, s, d, dmin, b_ptr + 256 * c, b_ok, xds_ptr, toks, stride_xds,
                             tok_ok, 8 * c, 2 * g)
            acc = _sub_block(acc, hi, zero, a, b, s, d, dmin, b_ptr + 256 * c, b_ok, xds_ptr, toks, stride_xds,
                             tok_ok, 8 * c, 2 * g + 1)
    gl.store(out_ptr + split * stride_os + toks[None, :] * stride_om + rows[:, None], acc,
             mask=row_ok[:, None] & tok_ok[None, :])


def _q6_asm(nibble_shift: int, high_shift: int) -> str:
    """Four Q6_K values from a word of ql bytes ($1) and one of qh bytes ($2): the nibble at nibble_shift and the two
    bits at high_shift, as signed bytes q - 32 ((v & 31) | 0xE0 where bit 5 is clear)."""
    return f"""{{
.reg .b32 n, h, v, s;
shr.b32 n, $1, {nibble_shift};
and.b32 n, n, 0x0F0F0F0F;
shr.b32 h, $2, {high_shift};
and.b32 h, h, 0x03030303;
shl.b32 h, h, 4;
or.b32 v, n, h;
not.b32 s, v;
and.b32 s, s, 0x20202020;
mul.lo.u32 s, s, 7;
and.b32 v, v, 0x1F1F1F1F;
or.b32 $0, v, s;
}}"""


# value group q (0..3) of a 128-weight half: ql bytes 0-31 or 32-63 (q % 2), low or high nibble (q // 2), qh bits 2q
Q6_ASM0, Q6_ASM1, Q6_ASM2, Q6_ASM3 = (gl.constexpr(_q6_asm(4 * (q // 2), 2 * q)) for q in range(4))


@gluon.jit
def _q6_values(ql0, ql1, qh, Q: gl.constexpr):
    if Q == 0:
        v = gl.inline_asm_elementwise(Q6_ASM0, "=r,r,r", [ql0, qh], dtype=gl.int8, is_pure=True, pack=4)
    elif Q == 1:
        v = gl.inline_asm_elementwise(Q6_ASM1, "=r,r,r", [ql1, qh], dtype=gl.int8, is_pure=True, pack=4)
    elif Q == 2:
        v = gl.inline_asm_elementwise(Q6_ASM2, "=r,r,r", [ql0, qh], dtype=gl.int8, is_pure=True, pack=4)
    else:
        v = gl.inline_asm_elementwise(Q6_ASM3, "=r,r,r", [ql1, qh], dtype=gl.int8, is_pure=True, pack=4)
    return v


@gluon.jit
def _q6k_mma_kernel(xq_ptr, xds_ptr, w_ptr, out_ptr, M, N, K, sb_per_split, stride_xq, stride_xds, stride_wn,
                    stride_os, stride_om, BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Q6_K (kept padded to 212 bytes: ql 128, qh 64, 16 int8 scales, d): each 32 weights are one int8 mma per
    16-weight scale, the other half's weights zeroed, the two exact int32 products scaled in float32."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    b_l: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4)
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    toks_l: gl.constexpr = gl.SliceLayout(0, mma)
    pid_n, split = gl.program_id(0), gl.program_id(1)
    first = split * sb_per_split
    last = gl.minimum(first + sb_per_split, K // 256)

    a_rows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_l))
    a_k = gl.arange(0, 32, layout=gl.SliceLayout(0, a_l))
    a_ptr = w_ptr + a_rows.to(gl.int64)[:, None] * stride_wn + a_k[None, :]
    a_ok = (a_rows < N)[:, None]
    first_half = (a_k < 16)[None, :]

    b_k = gl.arange(0, 32, layout=gl.SliceLayout(1, b_l))
    b_t = gl.arange(0, TOKENS, layout=gl.SliceLayout(0, b_l))
    b_ptr = xq_ptr + b_t[None, :] * stride_xq + b_k[:, None]
    b_ok = (b_t < M)[None, :]

    rows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=rows_l)
    row_ok = rows < N
    s_ptr = (w_ptr + rows.to(gl.int64) * stride_wn).to(gl.pointer_type(gl.int32))
    toks = gl.arange(0, TOKENS, layout=toks_l)
    tok_ok = toks < M

    acc = gl.zeros([BLOCK_N, TOKENS], gl.float32, layout=mma)
    zero = gl.zeros([BLOCK_N, TOKENS], gl.int32, layout=mma)
    for c in range(first, last):
        d = _half(gl.load(s_ptr + 53 * c + 52, mask=row_ok, other=0))
        for h in gl.static_range(2):  # 128-weight halves
            ql0 = gl.load(a_ptr + 212 * c + 64 * h, mask=a_ok, other=0)
            ql1 = gl.load(a_ptr + 212 * c + 64 * h + 32, mask=a_ok, other=0)
            qh = gl.load(a_ptr + 212 * c + 128 + 32 * h, mask=a_ok, other=0)
            sw0 = gl.load(s_ptr + 53 * c + 48 + 2 * h, mask=row_ok, other=0)  # scales 8h .. 8h + 3
            sw1 = gl.load(s_ptr + 53 * c + 49 + 2 * h, mask=row_ok, other=0)  # scales 8h + 4 .. 8h + 7
            for q in gl.static_range(4):
                v = _q6_values(ql0, ql1, qh, q)
                xb = gl.load(b_ptr + 256 * c + 128 * h + 32 * q, mask=b_ok, other=0)
                prod_a = mma_v2(gl.where(first_half, v, 0), xb, zero)
                prod_b = mma_v2(gl.where(first_half, 0, v), xb, zero)
                sw = sw0 if q < 2 else sw1
                sc_a = ((sw << (24 - 16 * (q % 2))) >> 24).to(gl.float32)  # scale 2q, signed
                sc_b = ((sw << (16 - 16 * (q % 2))) >> 24).to(gl.float32)  # scale 2q + 1
                pair = gl.load(xds_ptr + toks * stride_xds + 8 * c + 4 * h + q, mask=tok_ok, other=0)
                xd = pair.to(gl.int32).to(gl.float32, bitcast=True)
                both = prod_a.to(gl.float32) * sc_a[:, None] + prod_b.to(gl.float32) * sc_b[:, None]
                acc += both * (d[:, None] * xd[None, :])
    gl.store(out_ptr + split * stride_os + toks[None, :] * stride_om + rows[:, None], acc,
             mask=row_ok[:, None] & tok_ok[None, :])


KERNELS = {"Q4_K": _q4k_mma_kernel, "Q6_K": _q6k_mma_kernel}


def mma_product(x: torch.Tensor, qweight: torch.Tensor, qtype: str, k: int, block_n: int = 64, num_warps: int = 4,
                target_programs: int = 1056) -> torch.Tensor:
    """x [M <= 16, K] @ dequantize(qweight)^T -> [M, N] float32 (qweight as layers/quantized.stored_blocks keeps
    it)."""
    m, n = x.shape[0], qweight.shape[0]
    xq, xd, xs = gguf_gemv.quantize_rows(x)
    sbs = k // 256
    per_split = triton.cdiv(sbs, max(1, min(sbs, target_programs // triton.cdiv(n, block_n))))
    splits = triton.cdiv(sbs, per_split)
    out = torch.empty(splits, m, n, device=x.device, dtype=torch.float32)
    xb = xq.view(torch.int8)
    xds = torch.stack([xd, xs], -1).view(torch.int64)[..., 0]
    KERNELS[qtype][(triton.cdiv(n, block_n), splits)](xb, xds, qweight, out, m, n, k, per_split, xb.stride(0),
                                                      xds.stride(0), qweight.stride(0), out.stride(0), out.stride(1),
                                                      BLOCK_N=block_n, NUM_WARPS=num_warps, num_warps=num_warps)
    return out.sum(0)


def sass(qtype: str, block_n: int, num_warps: int) -> None:
    """Compile for sm_90 here (no GPU) and print the main loop's instruction counts, as sass_report does."""
    sys.path.insert(0, str(Path(__file__).parent))
    import sass_report as S
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sig = {"xq_ptr": "*i8", "xds_ptr": "*i64", "w_ptr": "*u8", "out_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32",
           "sb_per_split": "i32", "stride_xq": "i32", "stride_xds": "i32", "stride_wn": "i32", "stride_os": "i32",
           "stride_om": "i32", "BLOCK_N": "constexpr", "NUM_WARPS": "constexpr"}
    aligned = ("xq_ptr", "xds_ptr", "w_ptr", "out_ptr", "N", "K", "stride_xq", "stride_xds", "stride_wn",
               "stride_os", "stride_om")
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = GluonASTSource(fn=KERNELS[qtype], signature=sig, constexprs=dict(BLOCK_N=block_n, NUM_WARPS=num_warps),
                         attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    usage = subprocess.run([f"{S.BIN}/cuobjdump", "--dump-resource-usage", f.name], capture_output=True, text=True)
    code = subprocess.run([f"{S.BIN}/cuobjdump", "--dump-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    ops = S.main_loop(code)
    per_iter = block_n * {"Q4_K": 144, "Q6_K": 210}[qtype]  # one super-block of every row of the tile
    total = sum(ops.values())
    regs = usage.stdout.split("REG:")[1].split()[0]
    print(f"Triton {triton.__version__}, {qtype}, BLOCK_N {block_n}, {num_warps} warps: {regs} registers; loop {total} "
          f"instructions per warp, {total * num_warps / per_iter:.3f} warp-instructions per weight byte; "
          f"{', '.join(f'{k} {v}' for k, v in ops.most_common(10))}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass", action="store_true")
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--configs", default="64,4;32,4;128,4;64,8", help="BLOCK_N,warps;...")
    args = ap.parse_args()
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")]
    types = args.types.split(",")
    if args.sass:
        for qtype in types:
            for bn, warps in configs:
                sass(qtype, bn, warps)
        return 0
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    sys.path.insert(0, str(Path(__file__).parent))
    from test_gguf_kernels import as_int8_rows, random_blocks, reference
    from gpu import graphed, timed
    from flashdraft.kernels import gguf_matmul as K
    from flashdraft.layers.quantized import stored_blocks
    shapes = {"Q4_K": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)],  # the 8B's four matrices
              "Q6_K": [(128256, 4096), (4096, 14336)]}  # its LM head, a Q4_K_M down projection
    for qtype in types:
        for n, k in ((45, 512), (1000, 4096)):  # correctness: odd rows, one and several splits
            raw = random_blocks(qtype, n, k, 0)
            w = stored_blocks(torch.from_numpy(raw), qtype).cuda()
            want = reference(raw, qtype).double()
            for m in (1, 5, 16):
                x = torch.randn(m, k).to(torch.bfloat16)
                got = mma_product(x.cuda(), w, qtype, k).cpu().double()
                ref = as_int8_rows(x).double() @ want.T
                err = ((got - ref).norm() / ref.norm()).item()
                print(f"{qtype} N={n} K={k} rows={m}: relative error {err:.2e}", flush=True)
                assert err < 1e-3, err
        weights = {s: stored_blocks(torch.from_numpy(random_blocks(qtype, *s, 0)), qtype).cuda() for s in shapes[qtype]}
        x = {s: torch.randn(16, s[1], device="cuda", dtype=torch.bfloat16) for s in shapes[qtype]}
        gbytes = sum(w.numel() for w in weights.values()) / 1e9
        ms = timed(graphed(lambda: [K.gguf_matmul(x[s], weights[s], qtype, s[1]) for s in weights], "cuda"), 20,
                   "cuda")
        print(f"{qtype} float tensor-core kernel, 16 rows: {ms:.3f} ms ({gbytes / ms * 1e3:.0f} GB/s)", flush=True)
        for bn, warps in configs:
            ms = timed(graphed(lambda: [mma_product(x[s], weights[s], qtype, s[1], bn, warps) for s in weights],
                               "cuda"), 20, "cuda")
            print(f"{qtype} int8 mma kernel BLOCK_N {bn}, {warps} warps, 16 rows: {ms:.3f} ms "
                  f"({gbytes / ms * 1e3:.0f} GB/s)", flush=True)
    return 0

if __name__ == "__main__":
    sys.exit(main())
