#!/usr/bin/env bash
# One-shot GPU check on one lent H200, in three parts that each fit one device command (< 600 s; each
# part's step timeouts sum to at most 400 s, leaving room for the imports and probes before them):
#   part 1 (390 s): GPU-marked tests (CUDA's sync detector on a training step), bf16 training steps
#           through `mode train` (eager, then compiled);
#   part 2 (380 s): the compile tests (graphs traced on the CPU), the speed modes: fp32/bf16 x
#           eager/compiled training steps of dense and MoD (bench_speed.py), AdamW loop vs foreach vs fused;
#   part 3 (400 s): MegaBlocks vs native (vs DeepSpeed where installed) MoE layers, MoD block speed at S=2048.
# Usage: bash benchmarks/gpu_check.sh [OUT_DIR] [1|2|3|all]   (logs go to OUT_DIR, default ./gpu_check_out)
# Sections that need DeepSpeed (`mode train`, the DeepSpeed MoE layer) say so and are skipped where it
# is not installed (a lent machine's image may lack it and reach no package index).
# Every step runs even when one fails (a lent machine is not started twice for one failure); the
# exit status is 1 if any step failed or timed out, and each failure is named at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
failed=()
# step LOG SECONDS CMD...: run under a timeout, append the output to LOG (and show it), note a failure.
step() {
  local log=$1 secs=$2
  shift 2
  timeout "$secs" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  if ((rc != 0)); then
    echo "FAILED (exit $rc$( ((rc == 124)) && echo ", timed out after ${secs}s")): $*" | tee -a "$log"
    failed+=("$*")
  fi
}
OUT=${1:-${OUT:-gpu_check_out}}
PART=${2:-all}
if [[ ! $PART =~ ^(1|2|3|all)$ ]]; then  # a typo must not pass as "every step passed" on a lent machine
  echo "gpu_check.sh: part '$PART' is not 1, 2, 3 or all (usage: bash benchmarks/gpu_check.sh [OUT_DIR] [1|2|3|all])" >&2
  exit 2
fi
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
HAVE_DS=0
if $PY -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>/dev/null | tee -a "$OUT/gpu.txt" | grep -q deepspeed; then
  HAVE_DS=1
else
  echo "deepspeed: not installed (mode train and the DeepSpeed MoE layer are skipped)" | tee -a "$OUT/gpu.txt"
fi
$PY -c "import megablocks; print('megablocks', megablocks.__version__)" 2>&1 | tail -1 | tee -a "$OUT/gpu.txt"

if [[ $PART == 1 || $PART == all ]]; then
  echo "== GPU tests" | tee "$OUT/tests.txt"
  step "$OUT/tests.txt" 120 $PY -m pytest -q -m gpu tests

  echo "== bf16 training steps (tiny MoD and staged MoDE; then MoD compiled)" | tee "$OUT/bf16.txt"
  if [[ $HAVE_DS == 1 ]]; then
    # "TIMEOUT CONFIG [OVERRIDE]": compiled is DeepSpeed's start + torch.compile + 50 steps
    # (test_compile.py alone took 100 s on an H200)
    for run in "60 mod.yaml" "60 mode_staged.yaml" "150 mod.yaml train.compile=true"; do
      set -- $run
      secs=$1
      shift
      name="bf16_$(basename "$1" .yaml)${2:+_compiled}"
      step "$OUT/$name.log" "$secs" $PY -m mode.cli train --config "configs/tiny/$1" "${@:2}" deepspeed.precision=bf16 \
        deepspeed.zero_stage=1 train.max_steps=50 train.eval_every=25 log.progress=false run.dir="$OUT/$name" \
        run.fresh=true >/dev/null
      tail -3 "$OUT/$name.log" | tee -a "$OUT/bf16.txt"
      cat "$OUT/$name/DONE" 2>&1 | tee -a "$OUT/bf16.txt"; echo | tee -a "$OUT/bf16.txt"
    done
  else
    echo "skipped: needs deepspeed" | tee -a "$OUT/bf16.txt"
  fi
fi

if [[ $PART == 2 || $PART == all ]]; then
  echo "== Speed modes: fp32/bf16 x eager/compiled, dense vs MoD (d_model 512, S 1024)" | tee "$OUT/bench_speed.txt"
  step "$OUT/bench_speed.txt" 150 $PY -m pytest -q tests/test_compile.py
  step "$OUT/bench_speed.txt" 140 $PY benchmarks/bench_speed.py --batch 8 --reps 5

  echo "== Optimizer step: AdamW loop vs foreach vs fused, and whole steps (fused is what mode train uses)" | tee "$OUT/bench_optimizer.txt"
  step "$OUT/bench_optimizer.txt" 90 $PY benchmarks/bench_optimizer.py --device cuda --reps 10
fi

if [[ $PART == 3 || $PART == all ]]; then
  # bench_moe.py measures native and MegaBlocks without DeepSpeed (its ds_* columns are then skipped)
  echo "== MoE layers: native vs DeepSpeed vs MegaBlocks" | tee "$OUT/bench_moe.txt"
  step "$OUT/bench_moe.txt" 200 $PY benchmarks/bench_moe.py

  echo "== MoD block speed" | tee "$OUT/bench_mod.txt"
  step "$OUT/bench_mod.txt" 200 $PY benchmarks/bench_mod.py --device cuda
fi

if ((${#failed[@]})); then
  printf 'gpu_check: %d step(s) failed:\n' "${#failed[@]}"
  printf '  %s\n' "${failed[@]}"
  exit 1
fi
echo "gpu_check: every step passed"
