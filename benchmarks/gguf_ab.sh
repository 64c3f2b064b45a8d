#!/usr/bin/env bash
# Two versions of the package on the same GGUF files in one lease, on a CUDA machine:
#   bash benchmarks/gguf_ab.sh BASE_TREE WORK OUT [TYPES] [SHAPE] [MEASURE_ARGS...]
# BASE_TREE: another copy of the repository (e.g. `git archive COMMIT flashdraft benchmarks tests | tar -x -C DIR`).
# 1. this tree's GPU tests (pytest -k gpu over the kernel tests; about 5 minutes; TESTS=0 skips them);
# 2. one random-weight file per type (`gguf_gpu.py make --random-quant TYPE`, kept in WORK/m between calls);
# 3. `gguf_gpu.py measure` from this tree and from BASE_TREE in turn (base, this, base, this), so drift over the
#    lease shows in the repeats instead of in the ratio (REPEATS=1 for one each). Tables in
#    OUT/ab-TYPE-{base,this}-RUN.log. An 8B measure with --compile takes 1-2 minutes: one or two types per call.
set -u
base=$1 work=$2 out=$3 types=${4:-Q4_K_M} shape=${5:-llama-3.1-8b}
shift $(( $# < 5 ? $# : 5 ))
measure_args=("$@")
[ ${#measure_args[@]} -gt 0 ] || measure_args=(--ctxs 1024 --compile)
here=$(cd "$(dirname "$0")/.." && pwd)
base=$(cd "$base" && pwd)
mkdir -p "$work/m" "$out"
cd "$here"
if [ "${TESTS:-1}" != 0 ]; then
  timeout 300 python3 -m pytest -q tests/test_gguf_kernels.py tests/test_split_attention.py tests/test_kv_quant.py \
    -k gpu > "$out/gpu-tests.log" 2>&1
  tail -3 "$out/gpu-tests.log"
fi
for t in ${types//,/ }; do
  [ -f "$work/m/$shape-$t.gguf" ] || python3 benchmarks/gguf_gpu.py make --random-quant "$t" --shape "$shape" \
    --out-dir "$work/m" > /dev/null || { echo "make $t failed"; exit 1; }
done
for t in ${types//,/ }; do
  for run in $(seq "${REPEATS:-2}"); do
    for side in base this; do
      tree=$here
      [ "$side" = base ] && tree=$base
      (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" python3 benchmarks/gguf_gpu.py measure --files "$work/m/$shape-$t.gguf" \
        "${measure_args[@]}") > "$out/ab-$t-$side-$run.log" 2>&1
      echo "$t $side run $run:"
      grep -E "^\| $shape" "$out/ab-$t-$side-$run.log" || tail -3 "$out/ab-$t-$side-$run.log"
    done
  done
done
