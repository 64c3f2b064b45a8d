#!/usr/bin/env bash
# The kernels on a CUDA machine in one go: their GPU tests, then each kernel timed alone.
#   bash benchmarks/kernels/gpu_kernels.sh [OUT_DIR]
# 1. pytest -k gpu over the kernel tests (GGUF kernels and every int8 mma kernel against the `gguf` package, split
#    attention over float and quantized caches, decode and verify rows bit for bit, the KV write kernels);
# 2. the int8 mma kernels (kernels/gguf_mma.py) beside the kernels gguf_matmul has without them, 1 and 16 rows;
# 3. the 8B shape's steps at 1k and 32k context over q4_1 (rotated blocks) and the table KV types (rows written by
#    kernels/kv_quantize.py, levels from polynomials in the split kernel) beside f16.
# Each step's log is kept in OUT_DIR.
set -u
out=${1:-.}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."
timeout 230 python3 -m pytest -q tests/test_gguf_kernels.py tests/test_split_attention.py tests/test_kv_quant.py \
  -k gpu > "$out/gpu-tests.log" 2>&1; tail -15 "$out/gpu-tests.log"
timeout 170 python3 benchmarks/kernels/gluon_mma.py --configs "128,4;64,4" > "$out/gluon-mma.log" 2>&1
grep -vE "relative error [0-9.e+-]*$" "$out/gluon-mma.log" | tail -30
timeout 300 python3 benchmarks/gpu.py --sections synthetic --models llama-3.1-8b --ctxs 1024,32768 --attention split \
  --cache-types f16/f16,q4_1/q4_1,iq4_nl/iq4_nl,turbo4/turbo4 > "$out/kv-types.log" 2>&1
grep -A8 "^| model" "$out/kv-types.log"
