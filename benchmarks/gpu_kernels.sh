#!/usr/bin/env bash
# The kernels on a CUDA machine in one go: their GPU tests, then each kernel timed alone.
#   bash benchmarks/gpu_kernels.sh [OUT_DIR]
# 1. pytest -k gpu over the kernel tests (GGUF kernels and the int8 mma kernels against the `gguf` package, split
#    attention over float and quantized caches, decode and verify rows bit for bit, the KV write kernel);
# 2. the int8 mma kernels (kernels/gguf_mma.py) beside the float tensor-core kernel, 16 rows;
# 3. the integer decode kernels' tile sweep (BLOCK_N x SB), one row;
# 4. split attention at 1280 and 16640 keys, 16-row tiles (the default) beside 64-row ones.
set -u
out=${1:-.}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/.."
timeout 230 python3 -m pytest -q tests/test_gguf_kernels.py tests/test_split_attention.py tests/test_kv_quant.py \
  -k gpu > "$out/gpu-tests.log" 2>&1; tail -15 "$out/gpu-tests.log"
timeout 120 python3 benchmarks/gluon_mma.py > "$out/gluon-mma.log" 2>&1; tail -20 "$out/gluon-mma.log"
timeout 160 python3 benchmarks/gguf_kernels.py --types Q4_K,IQ4_XS,Q6_K --rows 1 --gemv-sweep \
  --out "$out/gemv-sweep.json" > "$out/gemv-sweep.log" 2>&1; grep -A8 "^| type" "$out/gemv-sweep.log"
timeout 60 python3 benchmarks/attention_kernel.py --configs "16,128,264,4,2;64,128,264,4,2" > "$out/attention.log" 2>&1
tail -10 "$out/attention.log"
