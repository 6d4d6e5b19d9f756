#!/usr/bin/env bash
# One-shot GPU check (one H200, < 10 minutes): GPU-marked tests, bf16 training steps,
# MegaBlocks vs native vs DeepSpeed MoE layers, MoD block speed at S=2048, and the speed modes:
# fp32/bf16 x eager/compiled training steps of dense and MoD (bench_speed.py), the compile and
# host-sync tests (tests/test_compile.py: fullgraph on the GPU, CUDA's sync detector).
# Usage: bash benchmarks/gpu_check.sh [OUT_DIR]   (logs go to OUT_DIR, default ./gpu_check_out)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-gpu_check_out}}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__)" | tee -a "$OUT/gpu.txt"
$PY -c "import megablocks; print('megablocks', megablocks.__version__)" 2>&1 | tail -1 | tee -a "$OUT/gpu.txt"

echo "== GPU tests" | tee "$OUT/tests.txt"
timeout 180 $PY -m pytest -q -m gpu tests 2>&1 | tail -20 | tee -a "$OUT/tests.txt"

echo "== bf16 training steps (tiny MoD and staged MoDE)" | tee "$OUT/bf16.txt"
for cfg in configs/tiny/mod.yaml configs/tiny/mode_staged.yaml; do
  timeout 120 $PY -m mode.cli train --config $cfg deepspeed.precision=bf16 train.max_steps=50 train.eval_every=25 \
    log.progress=false run.dir="$OUT/bf16_$(basename $cfg .yaml)" run.fresh=true 2>&1 | tail -3 | tee -a "$OUT/bf16.txt"
  cat "$OUT/bf16_$(basename $cfg .yaml)/DONE" | tee -a "$OUT/bf16.txt"; echo | tee -a "$OUT/bf16.txt"
done

echo "== Speed modes: fp32/bf16 x eager/compiled, dense vs MoD (d_model 512, S 1024)" | tee "$OUT/bench_speed.txt"
timeout 120 $PY -m pytest -q tests/test_compile.py 2>&1 | tail -5 | tee -a "$OUT/bench_speed.txt"
timeout 240 $PY benchmarks/bench_speed.py --batch 8 --reps 10 2>&1 | tee -a "$OUT/bench_speed.txt"

echo "== Optimizer step: AdamW loop vs foreach vs fused, and whole steps (fused is what mode train uses)" | tee "$OUT/bench_optimizer.txt"
timeout 90 $PY benchmarks/bench_optimizer.py --device cuda --reps 10 2>&1 | tee -a "$OUT/bench_optimizer.txt"

echo "== MoE layers: native vs DeepSpeed vs MegaBlocks" | tee "$OUT/bench_moe.txt"
timeout 150 $PY benchmarks/bench_moe.py 2>&1 | tee -a "$OUT/bench_moe.txt"

echo "== MoD block speed" | tee "$OUT/bench_mod.txt"
timeout 150 $PY benchmarks/bench_mod.py 2>&1 | tee -a "$OUT/bench_mod.txt"
