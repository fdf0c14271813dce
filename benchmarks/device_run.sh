#!/usr/bin/env bash
# One GPU-machine session's checks and measurements, in device calls of under 10 minutes each (the device tool's
# per-call limit). Usage on the GPU machine, after installing the carried wheels (README "GPU kernels"):
#   bash benchmarks/device_run.sh tests     [OUTDIR]   # build the extension, GPU tests of what changed last (~6 min)
#   bash benchmarks/device_run.sh bench     [OUTDIR]   # eager end-to-end benchmarks of the open targets (~6 min)
#   bash benchmarks/device_run.sh compiled  [OUTDIR]   # compiled layers: CUDA graphs, the casts as one op (~9 min)
#   bash benchmarks/device_run.sh rows      [OUTDIR]   # QLoRA on the shapes.md rows below 2B, eager (~5 min)
#   bash benchmarks/device_run.sh large_m   [OUTDIR]   # the weight-only route's GPU tests (decode, the mixed-input
#                                                      # kernel, the module route), then bench_large_m (~8 min)
#   bash benchmarks/device_run.sh few       [OUTDIR]   # the few-token op (mma kernel; WGMMA K-split for large weights
#                                                      # from 40 tokens): GPU tests, determinism stress, bench (~5 min)
#   bash benchmarks/device_run.sh large_m_e2e [OUTDIR] # 4-bit QLoRA steps (Qwen3-1.7B), decode + cuBLAS against
#                                                      # the opted-in register-operand mixed-input kernel (~5 min)
#   bash benchmarks/device_run.sh nograph   [OUTDIR]   # SmolLM2-135M compiled whole without CUDA graphs, PEFT / nf4 /
#                                                      # nvfp4 (NOGRAPH_SETUPS; ours_nf4_compiled_model_explicit: nf4
#                                                      # with every operand in the graph), five rounds, models kept
#                                                      # (~9 min)
#   bash benchmarks/device_run.sh trainer   [OUTDIR]   # SmolLM2-135M QLoRA through the HF Trainer with CUDA graphs,
#                                                      # PEFT / nf4 / mxfp4 (TRAINER_SETUPS), each Trainer trained
#                                                      # again round by round (~9 min)
#   bash benchmarks/device_run.sh registered [OUTDIR]  # the registered-operands route: its GPU tests, then the Trainer
#                                                      # with CUDA graphs, PEFT / nf4 / nf4 with every operand in the
#                                                      # graph (TRAINER_SETUPS), rounds (~9 min)
#   bash benchmarks/device_run.sh trainer_profile [OUTDIR] # the decoded-linear GPU tests, then one Trainer run each
#                                                      # of nf4 and PEFT (TRAINER_SETUPS) with CUDA graphs, profiled
#                                                      # (torch.profiler tables, the trace with the Trainer's phases
#                                                      # and trace_gaps.py's GPU-idle report, cProfile's functions;
#                                                      # ~8 min)
# The QLoRA rows of small models are host-bound: run them with nothing else on the machine (not beside a job on
# the other GPU; measured: a busy host read SmolLM2-360M nf4 at 0.52x instead of 0.76x), with the extension built.
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
    grep -E "passed|failed|skipped|error|tok/s|TOTAL|^E " "$out/$name.log" | grep -v Warning | tail -12
    return $rc
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
  rows)
    step build 150 python3 -m surogate_hf.kernels.build
    cd benchmarks
    for r in smollm2-135m smollm2-360m qwen2.5-0.5b qwen3-0.6b gemma-3-1b llama-3.2-1b qwen2.5-1.5b; do
      step "row_$r" 110 python3 bench_e2e.py --shape "$r" --steps 5 --name "e2e_row_$r" \
          --setups peft_bf16,ours_fp8,ours_nf4,ours_nvfp4,ours_mxfp4
    done
    cp results/e2e_row_*.md "$out/results/" 2>/dev/null
    ;;
  large_m)
    step build 150 python3 -m surogate_hf.kernels.build
    # the mixed-input kernel in a process of its own: a crash there must not cost the other results
    step gpu_weight_only 200 python3 -m pytest -q tests/kernels/test_gpu_decoded_linear.py \
        tests/integrations/test_decoded_route.py tests/kernels/test_gpu_kernels.py \
        -k "test_gpu_decoded_linear or test_decoded_route or modules_match_cpu" \
        -p no:cacheprovider -p no:logging --tb=short
    step gpu_mixed_rs 150 python3 -m pytest -q tests/kernels/test_gpu_kernels.py -k "mixed_input" \
        -p no:cacheprovider -p no:logging --tb=short -x
    rs_rc=$?
    cd benchmarks
    step large_m 200 python3 bench_large_m.py --name large_m --models Llama-3.1-8B,Qwen3-1.7B,SmolLM2-135M \
        --tokens 2048,8192 $([ $rs_rc -eq 0 ] || echo --skip-rs)
    cp results/large_m.md "$out/results/" 2>/dev/null
    ;;
  few)
    step build 150 python3 -m surogate_hf.kernels.build
    step gpu_few 200 python3 -m pytest -q tests/kernels/test_gpu_kernels.py \
        -k "few_token_kernel_over or (mixed_input and few)" -p no:cacheprovider -p no:logging --tb=short
    step stress 120 python3 benchmarks/stress_determinism.py --repeat 30
    cd benchmarks
    step few_tokens 200 python3 bench_large_m.py --name few_tokens --tokens 1,16,40,64
    cp results/few_tokens.md "$out/results/" 2>/dev/null
    ;;
  large_m_e2e)
    step build 150 python3 -m surogate_hf.kernels.build
    cd benchmarks
    step e2e_4bit_default 150 python3 bench_e2e.py --name e2e_qlora_4bit_default \
        --setups peft_bf16,ours_nvfp4,ours_mxfp4,ours_nf4
    step e2e_4bit_mixed_rs 150 env SUROGATE_HF_MIXED_INPUT=1 SUROGATE_HF_MIXED_INPUT_KERNEL=rs python3 bench_e2e.py \
        --name e2e_qlora_4bit_mixed_rs --setups peft_bf16,ours_nvfp4,ours_mxfp4,ours_nf4
    cp results/e2e_qlora_4bit_*.md "$out/results/" 2>/dev/null
    ;;
  trainer)
    # the Trainer waits for the GPU every step (its loss's isnan check), so host work between that wait and the next
    # forward's graph replay is exposed: each setup's Trainer built and compiled once, then trained in turn, rounds
    step build 150 python3 -m surogate_hf.kernels.build
    cd benchmarks
    step e2e_trainer 500 python3 bench_trainer.py --shape smollm2-135m --use-cache --torch-compile-mode reduce-overhead \
        --qlora "${TRAINER_SETUPS:-peft,nf4,mxfp4}" --rounds 5 --warmup 3 --steps 20 --name trainer_135m_rounds
    cp results/trainer_135m_rounds.md "$out/results/" 2>/dev/null
    ;;
  registered)
    # the registered-operands route (a compiled graph takes each quantized linear's codes alone): its GPU tests, then the
    # Trainer with CUDA graphs against PEFT and against the explicit route in the same process, rounds
    step build 150 python3 -m surogate_hf.kernels.build
    step gpu_decoded_linear 90 python3 -m pytest -q tests/kernels/test_gpu_decoded_linear.py -k \
        "registered or graph_ops or compiled or lora_layers" -p no:cacheprovider --tb=short
    cd benchmarks
    step e2e_trainer 390 python3 bench_trainer.py --shape smollm2-135m --use-cache --torch-compile-mode reduce-overhead \
        --qlora "${TRAINER_SETUPS:-peft,nf4,nf4_explicit}" --rounds 4 --warmup 3 --steps 20 \
        --name trainer_135m_registered
    cp results/trainer_135m_registered.md "$out/results/" 2>/dev/null
    ;;
  trainer_profile)
    step build 150 python3 -m surogate_hf.kernels.build
    step gpu_decoded_linear 100 python3 -m pytest -q tests/kernels/test_gpu_decoded_linear.py
    cd benchmarks
    step e2e_trainer_profile 330 python3 bench_trainer.py --shape smollm2-135m --use-cache \
        --torch-compile-mode reduce-overhead --qlora "${TRAINER_SETUPS:-nf4,peft}" --warmup 3 --steps 10 \
        --profile-dir "$out/results" --name trainer_135m_profile
    cp results/trainer_135m_profile.md "$out/results/" 2>/dev/null
    for f in "$out"/results/*.gaps.md; do echo "== $f"; cat "$f"; done
    ;;
  nograph)
    # SmolLM2-135M compiled whole without CUDA graphs (host-bound): PEFT and the 4-bit formats, each compiled once and
    # timed in five interleaved rounds in one process (--keep-models; a cold whole-model compile takes 100-150 s, so
    # three setups fill a call)
    step build 150 python3 -m surogate_hf.kernels.build
    step gpu_decoded_linear 100 python3 -m pytest -q tests/kernels/test_gpu_decoded_linear.py
    cd benchmarks
    step e2e_nograph 430 python3 bench_e2e.py --shape smollm2-135m --use-cache --gc-off --steps 20 --keep-models \
        --rounds 5 --setups "${NOGRAPH_SETUPS:-peft_bf16_compiled_model,ours_nf4_compiled_model,ours_nvfp4_compiled_model}" \
        --name e2e_135m_nograph_keep_models
    cp results/e2e_135m_nograph_keep_models.md "$out/results/" 2>/dev/null
    ;;
  *) echo "usage: device_run.sh tests|bench|compiled|rows|large_m|few|large_m_e2e|nograph [OUTDIR]"; exit 2 ;;
esac
