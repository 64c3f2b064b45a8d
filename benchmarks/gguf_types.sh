#!/usr/bin/env bash
# llama.cpp's side of the GGUF file-type table, in one call on a CUDA machine:
#   bash benchmarks/gguf_types.sh LLAMA_SRC.tar.gz WORK OUT [TYPES] [SHAPE]
# Builds llama-bench (CUDA, sm_90) from a llama.cpp source tarball in the background while
# `gguf_gpu.py make --random-quant TYPE` writes one file per type into WORK/m, then runs
# `llama-bench -ngl 99 -fa 1 -p 16,512 -n 128 -r 2` on each (tables in OUT/llama-bench-TYPE.md; pp16 is
# llama.cpp's 16-token batch, the peer of a verify step of 16: its step time is 16 / pp16).
# flashdraft's side on the same files: python3 benchmarks/gguf_gpu.py measure --files WORK/m/SHAPE-TYPE.gguf
# (with WAIT_FOR=PATH set, llama-bench starts only once PATH exists, so the two never share the GPU)
set -u
src=$1 work=$2 out=$3 types=${4:-Q4_K_S,Q5_K_M,Q6_K,Q8_0,IQ4_XS} shape=${5:-llama-3.1-8b}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$work/ll" "$work/m" "$out"
(
  tar xzf "$src" -C "$work/ll" && cd "$work/ll" &&
  cmake -S . -B b -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release && cmake --build b -j16 --target llama-bench
) > "$out/build.log" 2>&1 &
build=$!
for t in ${types//,/ }; do
  [ -f "$work/m/$shape-$t.gguf" ] || python3 "$here/gguf_gpu.py" make --random-quant "$t" --shape "$shape" \
    --out-dir "$work/m" > /dev/null || { echo "make $t failed"; exit 1; }
done
echo "files written: $(date +%T)"
wait $build || { tail -20 "$out/build.log"; exit 1; }
echo "llama-bench built: $(date +%T)"
while [ -n "${WAIT_FOR:-}" ] && [ ! -e "$WAIT_FOR" ]; do sleep 2; done  # the GPU to itself: after flashdraft's runs
for t in ${types//,/ }; do
  "$work/ll/b/bin/llama-bench" -m "$work/m/$shape-$t.gguf" -ngl 99 -fa 1 -p 16,512 -n 128 -r 2 -o md \
    > "$out/llama-bench-$t.md" 2> "$out/llama-bench-$t.err" || tail -5 "$out/llama-bench-$t.err"
  grep -E "pp16 |pp512|tg128" "$out/llama-bench-$t.md"
done
