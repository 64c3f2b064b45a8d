"""The GGUF kernels compiled for an H100/H200 (sm_90) on a machine without a GPU: registers, shared memory and the
SASS of the main loop (instructions per iteration, per byte of weights streamed, the instruction mix), read with
the cuobjdump that Triton's package carries. Arguments the JIT would specialise as multiples of 16 (torch's
pointers, the 8B's strides) are declared so, as at run time. The local Triton may be newer than the GPU machine's:
compare kernels with each other, not with ncu's absolute figures.

At full bandwidth an H200 SM streams ~14 bytes per cycle and issues 4 warp-instructions per cycle, so a streaming
kernel needs fewer than ~0.28 warp-instructions per weight byte, and fewer still to leave room for stalls.

Usage: python benchmarks/kernels/sass_report.py [--kernels gemv,dot,attention] [--types Q4_K,Q6_K] [--block-n 32]
           [--kv-types bf16,q4_1]
"""
import argparse
import collections
import itertools
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget

from flashdraft.kernels import gguf_gemv as G
from flashdraft.kernels import gguf_matmul as K

# conversions and special functions: 16 results per clock per SM on sm_90 (a quarter of the FMA pipe's rate) for
# I2F (8- and 16-bit sources), F2F and MUFU; I2FP (32-bit sources, sm_86 and newer) is counted with them, though
# it may issue faster
QUARTER_RATE = ("I2F", "I2FP", "F2I", "F2F", "MUFU")
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
BRANCH = re.compile(r"\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?BRA\s+0x([0-9a-f]+)")


def compile_sm90(fn, signature: dict, constexprs: dict, aligned: tuple, num_warps: int,
                 source=triton.compiler.ASTSource, num_stages: int = 3, maxnreg: int | None = None) -> tuple[str, str]:
    """(cuobjdump's resource usage, its SASS) of fn compiled for sm_90; source: Gluon kernels pass GluonASTSource;
    maxnreg: a register cap, as a launch's."""
    names = list(signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = source(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages, "maxnreg": maxnreg})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    usage = subprocess.run([f"{BIN}/cuobjdump", "--dump-resource-usage", f.name], capture_output=True, text=True)
    sass = subprocess.run([f"{BIN}/cuobjdump", "--dump-sass", f.name], capture_output=True, text=True)
    os.unlink(f.name)
    return usage.stdout, sass.stdout


def main_loop(sass: str) -> collections.Counter:
    """The instructions of the longest backward branch's body."""
    lines = sass.splitlines()
    best = (0, 0)
    for line in lines:
        m = BRANCH.match(line)
        if m and int(m.group(2), 16) < int(m.group(1), 16):
            start, end = int(m.group(2), 16), int(m.group(1), 16)
            best = max(best, (start, end), key=lambda r: r[1] - r[0])
    ops = collections.Counter()
    for line in lines:
        m = INSTRUCTION.match(line)
        if m and best[0] <= int(m.group(1), 16) <= best[1]:
            ops[m.group(2)] += 1
    return ops


def attention_cases(kv_types: list[str]):
    """The split attention kernel's partial program over each stored KV type (K = V), as the engine launches it for
    the 8B's heads (head size 128; a rotated type's q rotated inside): (label, fn, signature, constexprs, aligned,
    warps, compile options, K + V bytes per loop iteration)."""
    from flashdraft.kernels import split_attention as S
    from flashdraft.layers.kv_quant import kv_codecs
    for name in kv_types:
        codec = kv_codecs((name, name), torch.bfloat16)[0]
        row_type = S.ROW_TYPES.get(name, 0) if codec.packed else 0
        row = codec.row_size(128)
        cache = "*u8" if row_type else "*bf16"
        sig = {"q_ptr": "*bf16", "k_ptr": cache, "v_ptr": cache, "mask_ptr": "*u8", "acc_ptr": "*fp32",
               "m_ptr": "*fp32", "l_ptr": "*fp32", "signs_ptr": "*fp32", "pos_ptr": "*i64", "slots_ptr": "*i64"}
        sig |= {a: "i32" for a in ("stride_qb", "stride_qt", "stride_qh", "stride_ks", "stride_kh", "stride_vs",
                                   "stride_vh", "stride_mb", "stride_mt", "stride_pb", "L", "blocks_per_split",
                                   "max_splits", "grid_splits", "n_kv")}
        sig |= {"scale": "fp32", "softcap": "fp32", "window": "i32", "T": "i32", "G": "i32", "n_rows": "i32"}
        block_n, stages = (S.STORED_BLOCK_N, S.STORED_STAGES) if row_type else (S.BLOCK_N, S.NUM_STAGES)
        aligned = ("q_ptr", "k_ptr", "v_ptr", "mask_ptr", "acc_ptr", "m_ptr", "l_ptr", "signs_ptr", "stride_qt",
                   "stride_qh", "stride_kh", "stride_vh", "n_kv")
        per_iter = block_n * 2 * row * (1 if row_type else 2)
        tile_counts = sorted({1, S.STORED_TILES if row_type else S.FLOAT_TILES})  # a plain step's, a verify step's
        for tiles, bounded in itertools.product(tile_counts, (True, False)):  # positions given (the engine) or not
            const = dict(D=128, BLOCK_M=S.ROW_TILE, BLOCK_N=block_n, SOFTCAP=False, K_TYPE=row_type,
                         V_TYPE=row_type, K_ROW=row, V_ROW=row, K_PLANES=S.planes(row_type),
                         V_PLANES=S.planes(row_type), K_ROTATED=codec.rotates(128), TILES=tiles,
                         POSITIONS=bounded, SLOTS=False, MASK=True, WINDOW=False, PDL=True)
            yield (f"split attention over {name}, {block_n} keys, {tiles} row tiles{', positions' * bounded}",
                   S._partial_kernel,
                   sig | {k: "constexpr" for k in const}, const, aligned, S.NUM_WARPS, dict(num_stages=stages),
                   per_iter)


def cases(kernels: list[str], types: list[str], block_n: int, whole: bool = True):
    """(label, fn, signature, constexprs, aligned, warps, compile options (the integer kernels' register cap:
    TYPE_CONFIGS' maxnreg), weight bytes per loop iteration per program)."""
    for qtype in types:
        if "gemv" in kernels and qtype in ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ4_XS", *G.BLOCK32_IDS):
            block32 = qtype in G.BLOCK32_IDS
            cfg = G.TYPE_CONFIGS.get(qtype, G.CONFIG)
            sig = {"xq_ptr": "*i32", "xd_ptr": "*fp32", "xs_ptr": "*fp32", "w_ptr": "*i32"}
            if qtype in ("Q6_K", "Q8_0") or block32:
                sig["w16_ptr"] = "*i16"
            if qtype == "IQ4_XS" or block32:
                sig["lut_ptr"] = "*i32"
            sig |= {"out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32", "sb_per_split": "i32", "stride_xq": "i32",
                    "stride_xd": "i32", "stride_wu": "i32", "stride_os": "i32", "stride_om": "i32"}
            align = 1 if qtype == "Q6_K" else 4
            const = dict(BM=1, BLOCK_N=cfg["BLOCK_N"], SB=cfg["SB"], ROW_ALIGN=align, WHOLE=whole, EMULATE=False,
                         PDL=True)
            if qtype in ("Q4_K", "Q5_K"):
                const = dict(FIVE_BITS=qtype == "Q5_K", **const)
            if block32:
                const = dict(QTYPE=G.BLOCK32_IDS[qtype], **const)
            sig |= {k: "constexpr" for k in const}
            fn = G._block32_kernel if block32 else {"Q4_K": G._kquant_kernel, "Q5_K": G._kquant_kernel,
                                                    "Q6_K": G._q6_k_kernel, "Q8_0": G._q8_0_kernel,
                                                    "IQ4_XS": G._iq4_xs_kernel}[qtype]
            aligned = ("xq_ptr", "xd_ptr", "xs_ptr", "w_ptr", "out_ptr", "N", "K", "stride_os")
            per_iter = cfg["BLOCK_N"] * cfg["SB"] * K.chunk_bytes(qtype)
            yield (f"{qtype} integer kernel, 1 row", fn, sig, const, aligned, cfg["num_warps"],
                   dict(num_stages=3, maxnreg=cfg.get("maxnreg")), per_iter)
        if "dot" in kernels:
            sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "out_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32",
                   "chunks_per_split": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_os": "i32",
                   "stride_om": "i32", "QTYPE": "constexpr", "CHUNK_BYTES": "constexpr", "BLOCK_M": "constexpr",
                   "BLOCK_N": "constexpr"}
            const = dict(QTYPE=K.TYPE_IDS[qtype], CHUNK_BYTES=K.chunk_bytes(qtype), BLOCK_M=K.BLOCK_M, BLOCK_N=block_n)
            aligned = ("x_ptr", "w_ptr", "out_ptr", "N", "K", "stride_xm", "stride_wn", "stride_os", "stride_om")
            yield (f"{qtype} tensor-core kernel, {K.BLOCK_M} rows", K._matmul_kernel, sig, const, aligned, K.NUM_WARPS,
                   dict(num_stages=3), block_n * K.chunk_bytes(qtype))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", default="gemv,dot")
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--block-n", type=int, default=K.BLOCK_N)
    ap.add_argument("--split-tail", action="store_true",
                    help="the integer kernels compiled for splits ending inside an iteration (WHOLE off)")
    ap.add_argument("--kv-types", default="bf16,q8_0,q4_1,q5_0,iq4_nl,turbo4",
                    help="with --kernels attention: the split kernel over these KV cache types")
    args = ap.parse_args()
    print(f"Triton {triton.__version__}, sm_90\n")
    print("| kernel | registers | shared B | loop instructions (per warp) | warp-instructions per byte streamed | "
          "quarter-rate conversions (per warp) | loop's most frequent |\n|---|---|---|---|---|---|---|")
    kernels = args.kernels.split(",")
    all_cases = list(cases(kernels, args.types.split(","), args.block_n, not args.split_tail))
    if "attention" in kernels:
        all_cases += list(attention_cases(args.kv_types.split(",")))
    for label, fn, sig, const, aligned, warps, options, per_iter in all_cases:
        usage, sass = compile_sm90(fn, sig, const, aligned, warps, **options)
        regs, shared = re.search(r"REG:(\d+)", usage).group(1), re.search(r"SHARED:(\d+)", usage).group(1)
        ops = main_loop(sass)
        n = sum(ops.values())
        slow = sum(v for k, v in ops.items() if k in QUARTER_RATE)
        top = ", ".join(f"{k} {v}" for k, v in ops.most_common(8))
        spills = ops.get("STL", 0) + ops.get("LDL", 0)
        regs += f" ({spills} spill loads/stores in the loop)" if spills else ""
        print(f"| {label} | {regs} | {shared} | {n} | {n * warps / per_iter:.3f} | {slow} | {top} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
