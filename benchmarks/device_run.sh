#!/usr/bin/env bash
# One GPU-machine session's checks and measurements, in device calls of under 10 minutes each (the device tool's
# per-call limit). Usage on the GPU machine, after installing the carried wheels (README "GPU kernels"):
#   bash benchmarks/device_run.sh tests     [OUTDIR]   # build the extension, GPU tests of what changed last (~6 min)
#   bash benchmarks/device_run.sh bench     [OUTDIR]   # eager end-to-end benchmarks of the open targets (~6 min)
#   bash benchmarks/device_run.sh compiled  [OUTDIR]   # compiled layers: CUDA graphs, the casts as one op (~9 min)
# OUTDIR defaults to $OUT, else ./device_out. Each step's log goes to OUTDIR/<step>.log, tables to OUTDIR/results/.
# Set BENCH_COMMIT=<git hash> first (the machine gets the tree without .git): the tables print it.
# The convergence benchmark needs its assets (benchmarks/convergence.py --prepare) carried separately; run it with
#   python3 benchmarks/convergence.py --jobs 3 --setups ... --out $OUT/convergence
set -uo pipefail
what=${1:-tests}
out=${2:-${OUT:-./device_out}}
mkdir -p "$out/results"
export PYTHONUNBUFFERED=1
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
step() {  # step NAME LIMIT_S COMMAND...: run, keep the log, print the verdict
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s)"
    ( env -u OUT timeout "$limit" "$@" ) >"$out/$name.log" 2>&1
    local rc=$?
    echo "=== $name exit $rc"
    grep -E "passed|failed|skipped|error|tok/s|^E " "$out/$name.log" | grep -v Warning | tail -12
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
case "$what" in
  tests)
    step build 150 python3 -m surogate_hf.kernels.build
    step gpu_kernels 200 python3 -m pytest -q -m gpu tests/kernels/test_gpu_kernels.py -k "not shapes_table" \
        -p no:cacheprovider -p no:logging --tb=short
    step gpu_recipes 240 python3 -m pytest -q -m gpu tests/recipes/test_gpu_recipes.py tests/integrations/test_loftq.py \
        -p no:cacheprovider -p no:logging --tb=short
    ;;
  bench)
    cd benchmarks
    step e2e_qlora 150 python3 bench_e2e.py --name e2e_qlora_qwen3_1.7b \
        --setups peft_bf16,ours_nf4_stock_norms,ours_nf4,ours_fp8,ours_fp8_fp8_hybrid
    step e2e_full 150 python3 bench_e2e.py --name e2e_full_qwen3_1.7b \
        --setups full_bf16,full_bf16_fused_norms,full_fp8,full_fp8_blockwise
    step e2e_small 90 python3 bench_e2e.py --name e2e_recipes_smollm2 --shape smollm2-135m --batch 8 \
        --setups full_bf16,full_bf16_fused_norms,full_fp8,full_fp8_skip_small
    step host_calls 60 python3 bench_host_calls.py --cprofile
    cp results/*.md "$out/results/" 2>/dev/null
    ;;
  compiled)
    cd benchmarks
    step e2e_cudagraphs 270 python3 bench_e2e.py --name e2e_cudagraphs_qwen3_1.7b --compile-mode reduce-overhead \
        --setups full_bf16_compiled,full_fp8_compiled,full_torchao_compiled
    step e2e_traced_cast 270 python3 bench_e2e.py --name e2e_traced_cast_qwen3_1.7b --traced-cast op \
        --setups full_bf16_compiled,full_fp8_compiled,full_torchao_compiled
    cp results/*.md "$out/results/" 2>/dev/null
    ;;
  *) echo "usage: device_run.sh tests|bench|compiled [OUTDIR]"; exit 2 ;;
esac
