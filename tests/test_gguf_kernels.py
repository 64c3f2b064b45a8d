"""The GGUF kernels (kernels/gguf_matmul.py) under Triton's interpreter on the CPU, against the `gguf` package's
dequantisation: the dequantize kernel bit for bit, the fused matrix product against dequantize + an fp32
matmul for every type, several row counts, odd output sizes, with and without bias (for the integer kernels'
row counts, x rounded to 8 bits per 32 or per 256 values first, as they take it: gguf_gemv.x_group)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from test_split_attention import INTERPRETER

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]


def random_blocks(qtype: str, rows: int, k: int, seed: int) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from test_gguf import random_blocks as blocks
    return blocks(GGMLQuantizationType[qtype], rows, k, np.random.default_rng(seed))


def reference(raw: np.ndarray, qtype: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants
    return torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[qtype]).astype(np.float32))


def as_int8_rows(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x rounded to 8 bits per `block` values with a float scale (absmax / 127), as the integer kernels take it."""
    blocks = x.float().reshape(x.shape[0], -1, block)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / torch.where(d > 0, d, 1), 0)
    return (torch.floor(blocks * inv + 0.5).clamp(-127, 127) * d).reshape(x.shape)


def check(device: str, dtype: torch.dtype = torch.float32, tol: float = 1e-5) -> None:
    """dtype, tol: of x and the product (float32 under the interpreter; bf16 on a GPU, as the engine runs)."""
    from flashdraft.kernels.gguf_gemv import covers, quantize_rows_paired, quantize_rows_tiled, x_group
    from flashdraft.kernels.gguf_matmul import dequantize_gguf, gguf_matmul
    from flashdraft.quant.ggml import stored_blocks
    gen = torch.Generator().manual_seed(0)
    # x tiled for the int8 mma kernels: the values and scale pairs of x by rows, each block's rows side by side
    x = torch.randn(5, 512, generator=gen).to(device, dtype)
    q, pairs = quantize_rows_paired(x)
    tiled_q, tiled_pairs = quantize_rows_tiled(x)
    assert torch.equal(tiled_q[:, :5].cpu(), q.view(torch.int8).view(5, 16, 32).transpose(0, 1).cpu())
    assert torch.equal(tiled_pairs[:, :5].cpu(), pairs.T.cpu())
    # 45 rows: not a multiple of the kernels' row tiles; the older types' rows may end inside a 256 chunk; rows of an
    # odd count (544 / 32) of 18-, 22- or 34-byte blocks are not whole words and take the tensor-core kernel
    cases = [(t, 512 if t.endswith("_K") or t == "IQ4_XS" else 576) for t in TYPES] + [(t, 544) for t in
                                                                                      ("Q8_0", "Q4_0", "Q5_0")]
    cases.append(("Q8_0", 512))  # rows of whole 256-groups: x rounded per 256 (gguf_gemv.x_group)
    for i, (qtype, k) in enumerate(cases):
        n = 45
        raw = random_blocks(qtype, n, k, seed=i)
        want = reference(raw, qtype)
        qweight = stored_blocks(torch.from_numpy(raw), qtype).to(device)
        got = dequantize_gguf(qweight, qtype, k, torch.float32).cpu()
        exact = device == "cpu"  # a GPU may fuse the scale's multiply-add
        assert torch.equal(got, want) if exact else torch.allclose(got, want, rtol=1e-6, atol=1e-7), \
            f"{qtype}: dequantize differs by {(got - want).abs().max()}"
        bias = torch.randn(n, generator=gen)
        for rows in (1, 2, 5, 16, 21):  # 21: 16 at a time where the exact kernels take the type
            x = torch.randn(rows, k, generator=gen)
            for b in (None, bias):
                x = x.to(dtype)
                out = gguf_matmul(x.to(device), qweight, qtype, k, None if b is None else b.to(device)).cpu()
                xr = as_int8_rows(x, x_group(qtype, k)) if covers(qtype, k) else x  # more rows: 16 at a time
                ref = xr.double() @ want.double().T + (0 if b is None else b.double())
                err = ((out.double() - ref).norm() / ref.norm()).item()
                assert err < tol, f"{qtype}, {rows} rows, bias {b is not None}: relative error {err}"
        # a row's result does not depend on how many rows share the call, whichever kernels take them (a decoded
        # row and the same row verified in a block, or in a batch of blocks: greedy speculation is lossless)
        x = torch.randn(21, k, generator=gen).to(device, dtype)
        alone = gguf_matmul(x[:1], qweight, qtype, k)[0]
        for many in (2, 5, 16, 21):
            assert torch.equal(alone, gguf_matmul(x[:many], qweight, qtype, k)[0]), f"{qtype}: 1 row against {many}"
    # integer kernels whose splits end inside an iteration (2 super-blocks an iteration, 3 in the row): the
    # super-blocks past the end are read again (no masks) and must weigh nothing
    if device == "cpu":
        from flashdraft.kernels import gguf_gemv
        interpreted = gguf_gemv.INTERPRETED
        gguf_gemv.INTERPRETED = dict(interpreted, SB=2)
        try:
            for i, qtype in enumerate(("Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q8_0", "Q4_1")):
                k = 768
                raw = random_blocks(qtype, 9, k, seed=50 + i)
                qweight = stored_blocks(torch.from_numpy(raw), qtype)
                x = torch.randn(2, k, generator=gen)
                ref = as_int8_rows(x, x_group(qtype, k)).double() @ reference(raw, qtype).double().T
                err = ((gguf_matmul(x, qweight, qtype, k).double() - ref).norm() / ref.norm()).item()
                assert err < tol, f"{qtype}, a split ending inside an iteration: relative error {err}"
        finally:
            gguf_gemv.INTERPRETED = interpreted
        # the sums are exact (kernels/split_k.py: fixed point), so a row has the same bits however K is split and
        # tiled: what lets the int8 mma kernels (other splits, other order) match these on a GPU
        for i, qtype in enumerate(("Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q8_0", "Q4_1")):
            k = 2048
            raw = random_blocks(qtype, 8, k, seed=70 + i)
            qweight = stored_blocks(torch.from_numpy(raw), qtype)
            x = torch.randn(3, k, generator=gen)
            outs = []
            for programs, sb in ((1, 1), (4, 2), (64, 1)):
                gguf_gemv.INTERPRETED = dict(interpreted, target_programs=programs, SB=sb)
                try:
                    outs.append(gguf_matmul(x, qweight, qtype, k))
                finally:
                    gguf_gemv.INTERPRETED = interpreted
            assert all(torch.equal(outs[0], o) for o in outs[1:]), f"{qtype}: the bits depend on K's splits"
        # under torch.compile a layer leaves the split-K sums to the graph (split_k.add_splits): the same bits as the
        # sum launches, for the integer kernels (1 row) and the tensor-core kernel (5 rows), one part and two
        from flashdraft.kernels.gguf_matmul import split_counts
        from flashdraft.layers.quantized import GGUFLinear, QuantizedWeight
        weights = [QuantizedWeight(torch.from_numpy(random_blocks(q, n, 512, seed=7)), q, (n, 512))
                   for q, n in (("Q4_K", 45), ("Q6_K", 20))]
        graphs = []

        def backend(gm, example_inputs):
            graphs.append([str(node.target) for node in gm.graph.nodes])
            return gm.forward
        for layer in (GGUFLinear(weights[:1]), GGUFLinear(weights)):
            for rows in (1, 5):
                x = torch.randn(rows, 512, generator=gen)
                assert max(split_counts(x, [w for w, _ in layer.parts()], layer.qtypes, 512)) > 1
                torch._dynamo.reset()
                got = torch.compile(layer, backend=backend, fullgraph=True)(x)
                assert any("gguf_matmul_partials" in t for t in graphs[-1]), graphs[-1]
                assert torch.equal(got, layer(x)), f"{layer}, {rows} rows: the graph's sums differ from the launches"
    # a fused matrix whose parts differ in type (Q4_K_M's q/k/v): each part's columns of one output
    from flashdraft.kernels.gguf_matmul import gguf_matmul_parts
    k, types, sizes = 512, ["Q4_K", "Q6_K", "IQ4_XS", "Q8_0"], [45, 17, 33, 8]
    raws = [random_blocks(t, n, k, seed=100 + i) for i, (t, n) in enumerate(zip(types, sizes))]
    want = torch.cat([reference(r, t) for r, t in zip(raws, types)])
    parts = [stored_blocks(torch.from_numpy(r), t).to(device) for r, t in zip(raws, types)]
    for rows in (1, 3, 16, 20):  # 20: 16 at a time
        x = torch.randn(rows, k, generator=gen).to(dtype)
        out = gguf_matmul_parts(x.to(device), parts, ",".join(types), k).cpu()
        ref = torch.cat([as_int8_rows(x, x_group(t, k)).double()
                         @ reference(r, t).double().T for r, t in zip(raws, types)], -1)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < tol, f"parts {types}, {rows} rows: relative error {err}"
        one = torch.cat([gguf_matmul(x.to(device), w, t, k) for w, t in zip(parts, types)], -1).cpu()
        assert torch.equal(out, one), f"parts {types}, {rows} rows: not the bits of the parts one at a time"
    # a prefill's rows (more than FEW_ROWS): each part expanded a slice of 16 output rows at a time (a scratch of
    # 16 rows here, so the 45-row part takes three slices, the last cut short)
    from flashdraft.layers import quantized
    from flashdraft.layers.quantized import GGUFLinear, QuantizedWeight
    kept, quantized.SCRATCH_VALUES = quantized.SCRATCH_VALUES, 16 * k
    try:
        layer = GGUFLinear([QuantizedWeight(torch.from_numpy(r), t, (n, k)) for r, t, n in zip(raws, types, sizes)],
                           device=device)
        x = torch.randn(quantized.FEW_ROWS + 3, k, generator=gen).to(dtype)
        out = layer(x.to(device)).cpu()
        ref = x.double() @ want.double().T
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < tol, f"parts {types}, {len(x)} rows in slices: relative error {err}"
    finally:
        quantized.SCRATCH_VALUES = kept


@pytest.mark.skipif(INTERPRETER is not None, reason=str(INTERPRETER))
def test_gguf_kernels_interpreted_match_gguf_reference():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, "cpu"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow  # about 9 minutes: SmolLM2's 30 layers and 49k-row LM head through the interpreter
@pytest.mark.skipif(INTERPRETER is not None, reason=str(INTERPRETER))
def test_smollm2_quantized_logits_interpreted(smollm2_gguf):
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, "smollm2"], env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gguf_kernels_on_gpu_match_gguf_reference(tmp_path):
    check("cuda", torch.bfloat16, 1e-2)
    check_engine(str(tmp_path), "cuda")  # the kernels inside CUDA graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_compiled_steps_with_pdl_on_gpu(tmp_path):
    """torch.compile's kernels launched with PDL beside ours (kernels/pdl.compile_options) inside CUDA graphs: the
    same tokens as with them launched the plain way, and speculative decoding equal to plain decoding."""
    from pathlib import Path

    import torch._dynamo

    from flashdraft.engine.engine import Engine, EngineConfig, Request
    from flashdraft.engine.sampling import SamplingParams
    from flashdraft.kernels import pdl
    if not pdl.launch(torch.empty(0, device="cuda"))["PDL"] or not pdl.compile_options():
        pytest.skip("programmatic dependent launch for torch.compile's kernels needs a Hopper GPU and torch's option")
    gguf_file, draft = tiny_engine_files(Path(tmp_path))
    saved = pdl.INDUCTOR
    runs = {}
    try:
        for inductor in (False, True):
            pdl.INDUCTOR = inductor
            torch._dynamo.reset()
            engine = Engine.load(EngineConfig(model=str(gguf_file), draft=str(draft), device="cuda", ctx_size=128,
                                              weights="quantized", compile=True))
            params = SamplingParams(max_tokens=24, ignore_eos=True)
            plain = engine.generate(Request([5, 6, 7, 8, 9, 10], params, speculative=False)).token_ids
            spec = engine.generate(Request([5, 6, 7, 8, 9, 10], params, block_size=8))
            assert spec.token_ids == plain and spec.spec.draft_steps, inductor
            runs[inductor] = plain
    finally:
        pdl.INDUCTOR = saved
        torch._dynamo.reset()
    assert runs[True] == runs[False]


def test_kernels_wait_before_they_start_dependents():
    """Every kernel waits for the kernels before it before it lets the next be placed (kernels/pdl.py: torch.compile's
    kernels read early what the kernel just before them did not write, which is safe only then): each
    start_dependents (or Gluon's launch_dependents) has a statement before it, in its own block, that waits."""
    import ast
    from pathlib import Path

    from flashdraft.kernels import pdl

    def calls(node, name: str, asm: str) -> bool:
        return any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == name
                   or isinstance(n, ast.Constant) and isinstance(n.value, str) and asm in n.value
                   for n in ast.walk(node))

    checked = 0
    for path in sorted(Path(pdl.__file__).parent.glob("*.py")):
        if path.name == "pdl.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            for block in (getattr(node, "body", None), getattr(node, "orelse", None)):
                if not isinstance(block, list):
                    continue
                for i, stmt in enumerate(block):
                    if not isinstance(stmt, ast.Expr) or not calls(stmt, "start_dependents",
                                                                   "griddepcontrol.launch_dependents"):
                        continue
                    assert any(calls(before, "wait_for_inputs", "griddepcontrol.wait") for before in block[:i]), \
                        f"{path.name}:{stmt.lineno} starts its dependents before it waits"
                    checked += 1
    assert checked >= 12, checked
    assert pdl.compile_options() in ({}, {"triton.enable_pdl": True})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_int8_mma_kernels_on_gpu_match_gguf_reference():
    """kernels/gguf_mma.py (Gluon: no interpreter) for MIN_ROWS-16 rows of each type it has a kernel for (through
    gguf_matmul for the types it takes, directly for those not yet timed), x rounded to 8 bits as they take
    it; a token's result the same bits for one row (the integer kernels), MIN_ROWS, 5 and 16 rows."""
    from flashdraft.kernels import gguf_gemv, gguf_mma
    from flashdraft.kernels.gguf_matmul import gguf_matmul
    from flashdraft.quant.ggml import stored_blocks
    gen = torch.Generator().manual_seed(0)
    enabled, gguf_mma.ENABLED = gguf_mma.ENABLED, True
    try:
        for i, qtype in enumerate(gguf_mma.KERNELS):
            for n, k in ((45, 512), (300, 4096)):
                raw = random_blocks(qtype, n, k, seed=i)
                want = reference(raw, qtype).double()
                w = stored_blocks(torch.from_numpy(raw), qtype).cuda()
                x = torch.randn(16, k, generator=gen)
                product = gguf_matmul if qtype in gguf_mma.TIMED else gguf_mma.matmul
                for rows in (gguf_mma.MIN_ROWS, 5, 16):
                    out = product(x[:rows].cuda(), w, qtype, k).cpu().double()
                    ref = as_int8_rows(x[:rows], gguf_gemv.x_group(qtype, k)).double() @ want.T
                    err = ((out - ref).norm() / ref.norm()).item()
                    assert err < 1e-3, f"{qtype} {n}x{k}, {rows} rows: relative error {err}"
                xb = x.cuda().to(torch.bfloat16)
                for rows in (gguf_mma.MIN_ROWS, 5):
                    assert torch.equal(product(xb[:rows], w, qtype, k)[0], product(xb, w, qtype, k)[0])
                if qtype in gguf_mma.TIMED:  # a slot decoding alone and the same slot in a batch: the same bits
                    batch = product(xb[:gguf_mma.MIN_ROWS], w, qtype, k)
                    assert torch.equal(gguf_matmul(xb[:1], w, qtype, k)[0], batch[0])
    finally:
        gguf_mma.ENABLED = enabled


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_dependent_launches_in_a_graph_match_plain_launches():
    """kernels/pdl.py: integer products each reading the one before (x rounded, the product, its split-K sum),
    captured in a CUDA graph with programmatic dependent launch, give the bits of plain launches when replayed on
    a new input (a kernel that read its input before the one before it had written it would read the values the
    last replay left there)."""
    from flashdraft.kernels import pdl
    from flashdraft.kernels.gguf_matmul import gguf_matmul
    from flashdraft.quant.ggml import stored_blocks
    if not pdl.launch(torch.empty(0, device="cuda"))["PDL"]:
        pytest.skip("programmatic dependent launch needs a Hopper or newer GPU")
    k, wide = 4096, 14336  # the 8B's up and down shapes: a down projection's K is split in decode steps too
    shapes = [(wide, k), (k, wide)] * 3
    weights = [(stored_blocks(torch.from_numpy(random_blocks(t, n, kk, seed=i)), t).cuda(), t, kk)
               for i, (t, (n, kk)) in enumerate(zip(["Q4_K", "IQ4_XS", "Q6_K", "Q8_0", "Q5_K", "Q4_0"], shapes))]

    def chain(x: torch.Tensor) -> torch.Tensor:
        for i, (w, t, kk) in enumerate(weights):
            x = gguf_matmul(x, w, t, kk)
            if i % 2:  # two products back to back, then back to unit size
                x = x / x.float().norm()
        return x

    gen = torch.Generator().manual_seed(0)
    enabled = pdl.ENABLED
    try:
        for rows in (1, 16):  # the integer decode kernels, the int8 mma kernels
            first, second = (torch.randn(rows, k, generator=gen).cuda().to(torch.bfloat16) for _ in range(2))
            pdl.ENABLED = False
            want = [chain(first), chain(second)]
            pdl.ENABLED = True
            x = first.clone()
            chain(x)  # compile outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = chain(x)
            for inp, ref in zip((first, second, first) * 3, (want + want[:1]) * 3):
                x.copy_(inp)
                graph.replay()
                assert torch.equal(out, ref), rows
    finally:
        pdl.ENABLED = enabled


def test_int8_mma_launches_bind_and_compile_for_sm90(monkeypatch):
    """The Gluon int8 mma kernels have no CPU interpreter, so a launch that no longer fits its kernel would show only
    on a GPU. Here each type's launch, as gguf_mma makes it, binds to its kernel's parameters (none missing, none
    unknown) and the kernel compiles for sm_90, ptxas included, with the launch's constants."""
    gguf_mma = pytest.importorskip("flashdraft.kernels.gguf_mma")
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from flashdraft.kernels import split_k
    launches = []

    class Recorded:  # stands in for kernel[grid](...)
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))

    monkeypatch.setattr(gguf_mma, "KERNELS", {q: (Recorded(k), c) for q, (k, c) in gguf_mma.KERNELS.items()})
    monkeypatch.setattr(gguf_mma, "_rounded", lambda x, tiled, group, order: (
        torch.zeros(1, dtype=torch.int8), torch.zeros(1, dtype=torch.int64), 0 if tiled else 512, 0 if tiled else 16))
    monkeypatch.setattr(split_k, "finish", lambda partial, out: None)
    for qtype in gguf_mma.KERNELS:
        gguf_mma.matmul(torch.zeros(16, 4096, dtype=torch.bfloat16), torch.zeros(1024, 4096, dtype=torch.uint8), qtype,
                        4096)
    assert len(launches) == len(gguf_mma.KERNELS)
    codes = {torch.int8: "*i8", torch.int64: "*i64", torch.uint8: "*u8", torch.float32: "*fp32",
             torch.bfloat16: "*bf16"}
    for kernel, args, kwargs in launches:
        num_warps = kwargs.pop("num_warps")
        bound = inspect.signature(kernel.fn).bind(*args, **kwargs)  # TypeError: a missing or unknown argument
        constexprs = {p.name for p in kernel.params if p.is_constexpr}
        signature = {name: "constexpr" if name in constexprs else codes[v.dtype] if isinstance(v, torch.Tensor)
                     else "i32" for name, v in bound.arguments.items()}
        source = GluonASTSource(fn=kernel, signature=signature,
                                constexprs={(list(signature).index(n),): bound.arguments[n] for n in constexprs})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
        assert compiled.asm["cubin"], kernel.fn.__name__


def run_ptx(asm: str, inputs: list[int], outputs: int) -> list[int]:
    """A reading of the few PTX instructions the IQ4 lookups use (mov, and, or, shr, shl, prmt in its default mode,
    sign replication included) on 32-bit values: an independent check of the inline assembly that no CPU can run."""
    regs = {f"${outputs + i}": v & 0xFFFFFFFF for i, v in enumerate(inputs)}
    value = lambda a: regs[a] if a in regs else int(a, 0) & 0xFFFFFFFF  # noqa: E731
    for line in asm.strip("{}\n").splitlines():
        op, args = line.rstrip(";").split(None, 1)
        if op.startswith(".reg"):
            continue
        d, *src = [a.strip() for a in args.split(",")]
        v = [value(a) for a in src]
        if op == "mov.b32":
            r = v[0]
        elif op == "and.b32":
            r = v[0] & v[1]
        elif op == "or.b32":
            r = v[0] | v[1]
        elif op == "shr.b32":
            r = v[0] >> v[1]
        elif op == "shl.b32":
            r = v[0] << v[1]
        elif op == "not.b32":
            r = ~v[0]
        elif op == "mul.lo.u32":
            r = v[0] * v[1]
        elif op == "prmt.b32":  # selector nibble: bits 0-2 pick a byte; bit 3 set gives its sign bit in all 8
            pool = (v[0] | v[1] << 32).to_bytes(8, "little")
            sel = [(v[2] >> 4 * i) & 15 for i in range(4)]
            r = int.from_bytes(bytes(pool[n & 7] if n < 8 else (0xFF if pool[n & 7] & 0x80 else 0) for n in sel),
                               "little")
        else:
            raise AssertionError(f"no reading of {op}")
        regs[d] = r & 0xFFFFFFFF
    return [regs[f"${i}"] for i in range(outputs)]


def test_integer_kernel_tiles_fit_the_row_length():
    """gguf_gemv.fit_tile: a K whose blocks the type's tile covers with little padding keeps the tile; Gemma 4's K of
    5376 (21 super-blocks) and SmolLM2's 576 and 1536 (18 and 48 blocks of 32) take fewer super-blocks an iteration
    and more output rows, so that an iteration re-reads few blocks past the row's end (the bits do not change: the
    test above); Q6_K and IQ4_XS keep the tiles swept for them."""
    from flashdraft.kernels import gguf_gemv
    from flashdraft.kernels.gguf_gemv import CONFIG, TYPE_CONFIGS, fit_tile
    tile = lambda k, block32=False: (fit_tile(CONFIG, k, block32)["BLOCK_N"], fit_tile(CONFIG, k, block32)["SB"])  # noqa: E731
    assert (CONFIG["BLOCK_N"], CONFIG["SB"]) == (4, 16)
    assert tile(4096) == tile(8192) == (4, 16)  # 16, 32 super-blocks: whole iterations
    assert tile(5376) == (8, 8)  # 21: an 8-wide iteration pads 3 (16: 11)
    assert tile(14336) == (8, 8) and tile(21504) == (16, 4)  # 56, 84: no padding
    assert tile(576, True) == (16, 1) and tile(1536, True) == (16, 2)  # 18 blocks: 3 iterations of 8; 48: 3 of 16
    assert tile(4096, True) == (4, 16)
    for k in (576, 1536, 5376, 21504, 4096, 14336):
        for block32 in (False, True):
            units = k // 32 if block32 else -(-k // 256)
            step = tile(k, block32)[1] * (8 if block32 else 1)
            assert -(-units // step) * step - units <= 0.25 * units or step == (8 if block32 else 1)
    if not gguf_gemv._emulate():
        assert gguf_gemv.config("Q6_K", 5376) == TYPE_CONFIGS["Q6_K"]
        assert gguf_gemv.config("Q4_K", 5376) == fit_tile(CONFIG, 5376, False)


def test_iq4_byte_permute_lookups_give_the_table():
    """iq4.IQ4_EIGHT (the int8 mma kernel's) and IQ4_PAIRS (the integer kernels') read as PTX: every nibble of
    random words comes out as its kvalues_iq4nl level, in the documented order (byte b's low nibble, then its high),
    the same for both."""
    from flashdraft.kernels.iq4 import IQ4_EIGHT, IQ4_PAIRS, IQ4_VALUES
    table = np.array(IQ4_VALUES, dtype=np.int8).view(np.uint32).tolist()
    signed = lambda word: np.array([word], dtype=np.uint32).view(np.int8).tolist()  # noqa: E731
    for word in np.random.default_rng(0).integers(0, 2 ** 32, 300).tolist() + [0, 0xFFFFFFFF, 0x76543210]:
        nibbles = [(word >> (4 * i)) & 15 for i in range(8)]  # byte b: nibbles 2b (low) and 2b + 1 (high)
        want = [IQ4_VALUES[n] for n in nibbles]
        lo, hi = run_ptx(IQ4_PAIRS.value, [word, *table], 2)
        assert signed(lo) + signed(hi) == want
        lo, hi = run_ptx(IQ4_EIGHT.value, [word, 0xDEADBEEF], 2)  # $3: the tile's other four bytes, unused
        assert signed(lo) + signed(hi) == want



def test_k_quant_mma_unpacking_reads_as_documented():
    """gguf_mma's Q5_K and Q6_K unpacking assembly read as PTX: Q5_K's sub-block J takes the low (even J) or high
    nibbles plus bit J of each qh byte as 16; Q6_K's a nibble plus two high bits, as a signed q - 32."""
    pytest.importorskip("triton.experimental.gluon")
    from flashdraft.kernels.gguf_mma import Q5_ASM, _q6_asm
    rng = np.random.default_rng(1)
    for q, qh in rng.integers(0, 2 ** 32, (200, 2)).tolist():
        qb, hb = q.to_bytes(4, "little"), qh.to_bytes(4, "little")
        for j in range(8):
            got = run_ptx(Q5_ASM.value, [q, qh, j * 0x01010101], 1)[0].to_bytes(4, "little")
            assert list(got) == [((b >> 4 * (j % 2)) & 15) | ((h >> j) & 1) << 4 for b, h in zip(qb, hb)]
        for group in range(4):
            got = run_ptx(_q6_asm(4 * (group // 2), 2 * group), [q, qh], 1)[0].to_bytes(4, "little")
            want = [((b >> 4 * (group // 2)) & 15 | ((h >> 2 * group) & 3) << 4) - 32 for b, h in zip(qb, hb)]
            assert np.array(list(got), dtype=np.uint8).view(np.int8).tolist() == want


def test_gguf_weights_stay_quantized_by_default_on_cuda_only(monkeypatch):
    """EngineConfig.weights "auto": quantized on CUDA (target and GGUF draft), expanded on the CPU; --quantized on the
    CPU without Triton's interpreter is a clear error, not a crash in a kernel launch."""
    from flashdraft.engine.engine import EngineConfig, keep_quantized
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert keep_quantized(EngineConfig("m.gguf", device="cuda")) and keep_quantized(EngineConfig("m", device="cuda:1"))
    assert not keep_quantized(EngineConfig("m.gguf", device="cpu"))
    assert not keep_quantized(EngineConfig("m.gguf", device="cuda", weights="dequantized"))
    with pytest.raises(ValueError, match="--quantized: the GGUF kernels run on CUDA"):
        keep_quantized(EngineConfig("m.gguf", device="cpu", weights="quantized"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert keep_quantized(EngineConfig("m.gguf", device="cpu", weights="quantized"))


def test_unknown_type_and_bad_shapes_are_clear_errors():
    pytest.importorskip("triton")
    from flashdraft.kernels.gguf_matmul import gguf_matmul
    with pytest.raises(ValueError, match="no GGUF kernel for IQ2_XS"):
        gguf_matmul(torch.zeros(1, 256), torch.zeros(4, 66, dtype=torch.uint8), "IQ2_XS", 256)
    with pytest.raises(ValueError, match="Q4_K needs in_features divisible by 256"):
        gguf_matmul(torch.zeros(1, 100), torch.zeros(4, 66, dtype=torch.uint8), "Q4_K", 100)




def check_smollm2_logits() -> None:
    """SmolLM2's real Q4_1 file with its matrices kept quantized (the GPU path, interpreted): last-token logits
    close to the dequantized model's, the same top token."""
    from test_smollm2 import PROMPT
    from tiny import forward1

    from flashdraft.formats.chat import chat_ids
    from flashdraft.formats.loader import load_target
    from flashdraft.formats.named import resolve_model
    from flashdraft.layers.quantized import GGUFEmbedding, GGUFLinear
    path = str(resolve_model("smollm2-135m"))
    dense, tokenizer, _ = load_target(path)
    quant, _, _ = load_target(path, quantized=True)
    kinds = {type(m) for m in quant.modules()}
    assert GGUFLinear in kinds and GGUFEmbedding in kinds and torch.nn.Linear not in kinds
    ids = torch.tensor(chat_ids(tokenizer, PROMPT))
    logits = []
    for target in (dense, quant):
        state = target.new_state(1, 128)
        with torch.no_grad():
            logits.append(forward1(target, state, ids, torch.arange(len(ids)), fresh=True, logits_at="last")[0])
    # The last token's rows take the integer kernels, which round x to 8 bits per 32 values as llama.cpp's mmvq
    # does: 4.2e-3 measured on 2026-12-04 (1e-4 held before those kernels; the same argmax either way).
    err = ((logits[1] - logits[0]).norm() / logits[0].norm()).item()
    assert err < 1e-2 and int(logits[1].argmax()) == int(logits[0].argmax()), err


def check_engine(folder: str, device: str = "cpu") -> None:
    """The engine over a tiny random GGUF of mixed older types kept quantized (interpreted): greedy speculative
    decoding token-identical to its own plain decoding for several block sizes, on the default kernel routes (a
    decoded row and a verified block give a row the same bits)."""
    from pathlib import Path
    check_engine_blocks(Path(folder), device)


def tiny_engine_files(root) -> tuple:
    """(a tiny random GGUF target of mixed older types, a DFlash draft folder for it) under root."""
    from test_gguf import tiny_hf_state, write_tiny_gguf
    from tiny import make_draft

    from gguf import GGMLQuantizationType as Q
    sd = tiny_hf_state("llama", layers=2, hidden=64, ffn=128, vocab=96, tied=False)
    sd = {k: v * 0.3 for k, v in sd.items()}
    gguf_file = write_tiny_gguf(root / "tiny.gguf", "llama", sd, quantise=[Q.Q8_0, Q.Q4_0, Q.Q5_1, Q.Q4_1, Q.Q5_0])
    (root / "t").mkdir(exist_ok=True)
    (root / "t" / "config.json").write_text(json.dumps(dict(num_hidden_layers=2, hidden_size=64, vocab_size=96)))
    return gguf_file, make_draft(root / "d", root / "t", block_size=8)


def check_engine_blocks(root, device: str) -> None:
    from flashdraft.engine.engine import Engine, EngineConfig, Request
    from flashdraft.engine.sampling import SamplingParams
    from flashdraft.layers.quantized import GGUFEmbedding, GGUFLinear
    gguf_file, draft = tiny_engine_files(root)
    engine = Engine.load(EngineConfig(model=str(gguf_file), draft=str(draft), device=device, ctx_size=128,
                                      weights="quantized"))
    assert {type(m) for m in engine.target.modules()} >= {GGUFLinear, GGUFEmbedding}
    memory = engine.memory  # start-up's and /props' figures; on CUDA also what graphs and workspaces hold
    assert memory["weights"] > 0 and memory["kv_cache"] > 0 and ("workspace" in memory) == (device == "cuda")
    prompt = [5, 6, 7, 8, 9, 10]
    plain = engine.generate(Request(prompt, SamplingParams(max_tokens=12, ignore_eos=True), speculative=False))
    for block in (3, 8):
        spec = engine.generate(Request(prompt, SamplingParams(max_tokens=12, ignore_eos=True), block_size=block))
        assert spec.token_ids == plain.token_ids and spec.spec.draft_steps
    # the draft as a Q8_0 GGUF (BeeLlama's layout) follows the target's rule: its matrices stay quantized
    from tiny import write_beellama_draft_gguf

    from flashdraft.draft.load import load_draft_folder, load_draft_gguf
    draft_gguf = write_beellama_draft_gguf(root / "draft-q8_0.gguf", load_draft_folder(draft), "Q8_0")
    engine = Engine.load(EngineConfig(model=str(gguf_file), draft=str(draft_gguf), device=device, ctx_size=128,
                                      weights="quantized"))
    assert GGUFLinear in {type(m) for m in engine.draft.modules()}
    spec = engine.generate(Request(prompt, SamplingParams(max_tokens=12, ignore_eos=True), block_size=8))
    assert spec.token_ids == plain.token_ids and spec.spec.draft_steps
    # its fused q/k/v's k and v rows alone (the context append) against the same file expanded
    dense = load_draft_gguf(draft_gguf, device=device, vocab_size=96, num_target_layers=2)
    quant, expanded = engine.draft.layers[0].self_attn.qkv_proj, dense.layers[0].self_attn.qkv_proj
    start = engine.draft.layers[0].self_attn.q_size
    assert isinstance(quant, GGUFLinear) and not isinstance(expanded, GGUFLinear)
    for rows in (3, 70):  # the integer kernel (x rounded to 8 bits), the dequantized product
        x = torch.randn(rows, quant.in_features, generator=torch.Generator().manual_seed(rows)).to(device)
        got, want = quant.part(x, start, quant.out_features), expanded.part(x, start, expanded.out_features)
        err = ((got - want).norm() / want.norm()).item()
        assert got.shape == (rows, quant.out_features - start) and err < (2e-2 if rows <= 4 else 1e-5), (rows, err)


@pytest.mark.skipif(INTERPRETER is not None, reason=str(INTERPRETER))
def test_engine_with_quantized_weights_interpreted(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, "engine", str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr


if __name__ == "__main__":
    if sys.argv[1] == "engine":
        check_engine(sys.argv[2])
    elif sys.argv[1] == "smollm2":
        check_smollm2_logits()
    else:
        check(sys.argv[1] if len(sys.argv) > 1 else "cpu")




def test_quantized_loading_stores_each_matrix_once(tmp_path):
    """A GGUF's matrices go to their modules in the kernels' order, each written once: a fused projection's parts
    into one matrix (the bytes of stored_blocks over their concatenation), a tied embedding and output layer
    sharing one copy, and no buffer left pointing into the file's read-only mapping."""
    from gguf import GGMLQuantizationType as Q
    from test_gguf import tiny_hf_state, write_tiny_gguf

    from flashdraft.formats import gguf
    from flashdraft.formats.loader import build_target
    from flashdraft.layers.quantized import GGUFEmbedding, GGUFLinear
    from flashdraft.models.registry import read_config
    from flashdraft.quant.dequant import tensor_bytes
    from flashdraft.quant.ggml import stored_blocks
    sd = tiny_hf_state("qwen2", layers=1, hidden=64, ffn=128, vocab=96, tied=True)
    path = write_tiny_gguf(tmp_path / "t.gguf", "qwen2", sd, quantise=[Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_0])
    reader = gguf.read_gguf(path)
    _, cfg = read_config(gguf.gguf_to_hf_config(reader))
    model = build_target(cfg, gguf.iter_gguf_tensors(reader, torch.float32, keep_quantized=True), "cpu",
                         torch.float32)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, GGUFLinear)
    files = {n: reader.tensors[f"blk.0.attn_{n}.weight"] for n in "qkv"}
    runs, start = [], 0
    for qtype, size in zip(qkv.qtypes, qkv.sizes):  # neighbours of one type are one matrix
        names = []
        while sum(files[n].shape[0] for n in names) < size:
            names.append("qkv"[start + len(names)])
        raw = torch.cat([tensor_bytes(files[n]).view(files[n].shape[0], -1) for n in names])
        runs.append(stored_blocks(raw, qtype))
        start += len(names)
    assert len(runs) == 2 and all(torch.equal(w, want) for (w, _), want in zip(qkv.parts(), runs))
    embed = model.model.embed_tokens
    assert isinstance(embed, GGUFEmbedding) and isinstance(model.lm_head, GGUFLinear)
    assert model.lm_head.qweight0.data_ptr() == embed.qweight.data_ptr()  # tied: one copy
    mapped = {gguf.mapped_bytes(t).data_ptr() for t in reader.tensors.values()}
    assert all(b.data_ptr() not in mapped and b.is_contiguous() for b in model.buffers())
