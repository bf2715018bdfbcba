#!/usr/bin/env bash
# Every GPU check and benchmark in one command, for a lent H100 (no network):
#   bash bench/run_gpu.sh OUTDIR [kernels|attention|gqa|lce|moe|offload|decode|models|steps ...]
# GPU tests first, then the named benchmarks (default: kernels and models); logs and tables go to OUTDIR.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bench/run_gpu.sh OUTDIR [benchmarks...]}; shift
mkdir -p "$out"
source bench/gpu_env.sh
if ls .whl/*.whl >/dev/null 2>&1; then  # Liger-Kernel and accelerate (pure Python) as baselines, when carried along
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/env.txt"
TRITONSPEC_TEST_DEVICE=cuda python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log" | tail -5
for b in "${@:-kernels models}"; do
  for name in $b; do
    case $name in
      kernels) python3 bench/bench_kernels.py --cudagraph --budget 150 --out "$out/results_kernels.md" 2>&1 | tee "$out/bench_kernels.log" | tail -30 ;;
      attention) python3 bench/bench_attention.py --final 2>&1 | tee "$out/bench_attention.log" | tail -20 ;;
      gqa) python3 bench/bench_attention.py --gqa --out "$out" 2>&1 | tee "$out/bench_gqa.log" | tail -12 ;;
      lce) python3 bench/bench_linear_cross_entropy.py --out "$out/results_lce.md" 2>&1 | tee "$out/bench_lce.log" | tail -14 ;;
      steps) python3 bench/bench_training_step.py --hidden 4096 --intermediate 14336 --layers 8 --heads 32 --kv-heads 8 \
               --vocab 128256 --batch 2 --seq 4096 --steps 6 --profile --variants hf-sdpa,ts-kernelize,ts-all,liger-flce \
               --out "$out/results_step_llama3.md" 2>&1 | tee "$out/bench_step_llama3.log" | tail -20
             python3 bench/bench_training_step.py --model qwen3-moe --heads 32 --kv-heads 4 --layers 4 --vocab 151936 \
               --batch 2 --steps 6 --profile --variants hf-sdpa,ts-kernelize,ts-all,liger-flce \
               --out "$out/results_step_qwen3moe.md" 2>&1 | tee "$out/bench_step_qwen3moe.log" | tail -20 ;;
      moe) python3 bench/bench_moe.py --block --out "$out/results_moe.md" 2>&1 | tee "$out/bench_moe.log" | tail -40
           python3 bench/bench_training_step.py --model qwen3-moe --heads 32 --kv-heads 4 --layers 4 --vocab 151936 \
             --batch 2 --variants hf-sdpa,ts-kernelize,liger,liger-flce --out "$out/results_moe_step.md" 2>&1 \
             | tee "$out/bench_moe_step.log" | tail -12 ;;
      offload) for case in qwen3-30b-a3b mixtral-8x7b; do  # one model build each: a few minutes apiece
                 python3 bench/bench_offload.py --case $case --out "$out/results_offload.md" 2>&1 | tee "$out/bench_offload_$case.log" | tail -30
               done ;;
      decode) python3 bench/bench_attention.py --decode --out "$out" 2>&1 | tee "$out/bench_attention_decode.log" | tail -32
              python3 bench/bench_decode.py --batch 1 --prompt 64 --skip-guards --out "$out/results_decode.md" 2>&1 \
                | tee "$out/bench_decode.log" | tail -12 ;;
      models) python3 bench/bench_training_step.py --out "$out/results_models.md" 2>&1 | tee "$out/bench_models.log" | tail -12 ;;
    esac
  done
done
