"""Times the int8 tensor-core kernels for verify widths (kernels/gguf_mma.py) beside the float tensor-core kernel,
after checking them against the `gguf` package; or, without a GPU, compiles them for sm_90 and reads the SASS.
    python benchmarks/kernels/gluon_mma.py [--types Q4_K,Q6_K] [--configs "64,4;32,4"]     BLOCK_N,warps
    python benchmarks/kernels/gluon_mma.py --configs 128,4 --rows 16,8 --layouts "4,rows;8,rows;8,tiled;4,tiled"
        each kernel also at these K_WIDTH and x layouts (the same bits as the first checked)
    python benchmarks/kernels/gluon_mma.py --sass
"""
import argparse
import sys
from pathlib import Path

import torch
import triton

from flashdraft.kernels import gguf_mma
from flashdraft.kernels.gguf_mma import KERNELS

def sass(qtype: str, block_n: int, num_warps: int) -> None:
    """Compile for sm_90 here (no GPU) and print the main loop's instruction counts, as sass_report does."""
    sys.path.insert(0, str(Path(__file__).parent.parent))  # benchmarks/, for its shared modules
    import sass_report as S
    from triton.experimental.gluon._runtime import GluonASTSource

    from flashdraft.kernels.gguf_matmul import chunk_bytes
    sig = {"xq_ptr": "*i8", "xds_ptr": "*i64", "w_ptr": "*u8", "out_ptr": "*fp32", "M": "i32", "N": "i32",
           "K": "i32", "sb_per_split": "i32", "stride_xq": "i32", "stride_xds": "i32", "stride_wn": "i32",
           "stride_os": "i32", "stride_om": "i32", "BLOCK_N": "constexpr", "NUM_WARPS": "constexpr",
           "PDL": "constexpr"}
    aligned = ("xq_ptr", "xds_ptr", "w_ptr", "out_ptr", "N", "K", "stride_xq", "stride_xds", "stride_wn",
               "stride_os", "stride_om")
    kernel, constants = KERNELS[qtype]
    const = dict(BLOCK_N=block_n, NUM_WARPS=num_warps, PDL=True, **constants)
    usage, code = S.compile_sm90(kernel, sig, const, aligned, num_warps, GluonASTSource)
    ops = S.main_loop(code)
    per_iter = block_n * chunk_bytes(qtype)  # one super-block of every row of the tile, as stored (sass_report's)
    total = sum(ops.values())
    regs = usage.split("REG:")[1].split()[0]
    print(f"Triton {triton.__version__}, {qtype}, BLOCK_N {block_n}, {num_warps} warps: {regs} registers; loop {total} "
          f"instructions per warp, {total * num_warps / per_iter:.3f} warp-instructions per weight byte; "
          f"{', '.join(f'{k} {v}' for k, v in ops.most_common(10))}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass", action="store_true")
    ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K,IQ4_XS,Q8_0")
    ap.add_argument("--configs", default="64,4;32,4;128,4;64,8", help="BLOCK_N,warps;...")
    ap.add_argument("--rows", default="1,16", help="rows of x timed (1: beside the integer decode kernel)")
    ap.add_argument("--layouts", default="", help="K_WIDTH,rows|tiled;... (default: each type's own)")
    args = ap.parse_args()
    layouts = [(int(w), x == "tiled") for w, x in (c.split(",") for c in filter(None, args.layouts.split(";")))]
    configs = [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")]
    types = args.types.split(",")
    if args.sass:
        for qtype in types:
            for bn, warps in configs:
                sass(qtype, bn, warps)
        return 0
    sys.path.insert(0, str(Path(__file__).parent.parent.parent / "tests"))
    sys.path.insert(0, str(Path(__file__).parent.parent))  # benchmarks/, for its shared modules
    from test_gguf_kernels import as_int8_rows, random_blocks, reference
    from gpu import graphed, timed
    from flashdraft.kernels import gguf_matmul as K
    from flashdraft.kernels.gguf_gemv import x_group
    from flashdraft.quant.ggml import stored_blocks
    eight_b = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # the 8B's four matrices
    shapes = {"Q6_K": [(128256, 4096), (4096, 14336)]}  # its LM head, a Q4_K_M down projection
    for qtype in types:
        for n, k in ((45, 512), (1000, 4096)):  # correctness: odd rows, one and several splits
            raw = random_blocks(qtype, n, k, 0)
            w = stored_blocks(torch.from_numpy(raw), qtype).cuda()
            want = reference(raw, qtype).double()
            for m in (1, 5, 16):
                x = torch.randn(m, k)  # float32: the output keeps x's dtype
                got = gguf_mma.matmul(x.cuda(), w, qtype, k).cpu().double()
                ref = as_int8_rows(x, x_group(qtype, k)).double() @ want.T
                err = ((got - ref).norm() / ref.norm()).item()
                print(f"{qtype} N={n} K={k} rows={m}: relative error {err:.2e}", flush=True)
                assert err < 1e-3, err
        matrices = shapes.get(qtype, eight_b)
        weights = {s: stored_blocks(torch.from_numpy(random_blocks(qtype, *s, 0)), qtype).cuda() for s in matrices}
        gbytes = sum(w.numel() for w in weights.values()) / 1e9
        for m in map(int, args.rows.split(",")):
            x = {s: torch.randn(m, s[1], device="cuda", dtype=torch.bfloat16) for s in matrices}
            gguf_mma.ENABLED = False  # the kernels gguf_matmul has without these
            ms = timed(graphed(lambda: [K.gguf_matmul(x[s], weights[s], qtype, s[1]) for s in weights], "cuda"), 20,
                       "cuda")
            gguf_mma.ENABLED = True
            today = "integer" if m <= 4 else "float tensor-core"
            print(f"{qtype} {today} kernel, {m} rows: {ms:.3f} ms ({gbytes / ms * 1e3:.0f} GB/s)", flush=True)
            kernel, own = KERNELS[qtype]
            for bn, warps in configs:
                gguf_mma.BLOCK_N, gguf_mma.NUM_WARPS = bn, warps
                first = None
                for k_width, tiled in layouts or [(own.get("K_WIDTH", 8), own["TILED"])]:
                    variant = dict(own, TILED=tiled) | ({"K_WIDTH": k_width} if "K_WIDTH" in own else {})
                    k_width = variant.get("K_WIDTH", 8)  # a kernel without the parameter has its own
                    KERNELS[qtype] = (kernel, variant)
                    outs = [gguf_mma.matmul(x[s], weights[s], qtype, s[1]) for s in weights]
                    first = first or outs
                    same = all(torch.equal(a, b) for a, b in zip(outs, first))
                    ms = timed(graphed(lambda: [gguf_mma.matmul(x[s], weights[s], qtype, s[1]) for s in weights],
                                       "cuda"), 20, "cuda")
                    print(f"{qtype} int8 mma kernel BLOCK_N {bn}, {warps} warps, k_width {k_width}, x "
                          f"{'tiled' if tiled else 'by rows'}, {m} rows: {ms:.3f} ms ({gbytes / ms * 1e3:.0f} GB/s)"
                          f"{'' if same else ', NOT the bits of the first layout'}", flush=True)
                KERNELS[qtype] = (kernel, own)
    return 0


if __name__ == "__main__":
    sys.exit(main())
