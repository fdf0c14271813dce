#!/usr/bin/env bash
# One GPU-machine session's worth of checks: build the extension, run the GPU tests, run the benchmarks.
# Usage on the GPU machine (after carrying the wheels, see README "GPU kernels"):
#   bash benchmarks/device_run.sh [OUTDIR]      (default OUTDIR: $OUT, else ./device_out)
# Tables land in benchmarks/results/ (tarred into OUTDIR/results.tgz) and the whole log in OUTDIR/run.log.
set -uo pipefail
out=${1:-${OUT:-./device_out}}
mkdir -p "$out"
log="$out/run.log"
export PYTHONUNBUFFERED=1
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
step() { local t=$1; shift; echo "=== $* (limit ${t}s)" | tee -a "$log"; ( cd benchmarks; env -u OUT timeout "$t" "$@" ) >>"$log" 2>&1; echo "=== exit $?" | tee -a "$log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$log" 2>&1
( env -u OUT timeout 120 python3 -m surogate_hf.kernels.build >>"$log" 2>&1; echo "=== build exit $?" | tee -a "$log" )
( timeout 420 python3 -m pytest -q -m gpu tests/test_gpu_kernels.py -p no:cacheprovider >>"$log" 2>&1; echo "=== gpu tests exit $?" | tee -a "$log" )
tail -1 "$log"
step 45 python3 bench_overhead.py
step 200 python3 bench_shapes.py
step 100 python3 bench_linear.py
step 90 python3 bench_lora_dtype.py --formats fp8
step 160 python3 bench_e2e.py --setups "${E2E_SETUPS:-peft_bf16,bnb_nf4,ours_fp8,ours_nf4,full_bf16,full_fp8}"
tar czf "$out/results.tgz" benchmarks/results
grep -E "^=== |passed|failed" "$log" | tail -20
