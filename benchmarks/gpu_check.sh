#!/usr/bin/env bash
# One-shot GPU check on one lent H200, in sections that each fit one device command (< 600 s):
#   tests     GPU-marked tests: CUDA's sync detector on training steps; MegaBlocks = native where installed
#   bf16      bf16 training steps through `mode train` (DeepSpeed, ZeRO-1): tiny MoD and staged MoDE
#   compiled  the same for MoD with train.compile=true
#   speed     the compile tests (graphs traced on the CPU), the speed modes: fp32/bf16 x eager/compiled
#             training steps of dense and MoD (bench_speed.py)
#   optimizer AdamW loop vs foreach vs fused, and whole steps
#   moe       MegaBlocks vs native (vs DeepSpeed where installed) MoE layers, small and large shapes
#   mod       MoD block speed at S = 512..2048 and the model step (CPU shape fp32, GPU shape bf16), a
#             profile of the routed block at S 2048, the predictor in bf16
# Groups: 1 = tests,bf16,compiled (510 s at most); 2 = speed,optimizer (380 s); 3 = moe,mod (460 s).
# Usage: bash benchmarks/gpu_check.sh [OUT_DIR] [1|2|3|all|SECTION[,SECTION...]]
#   (logs go to OUT_DIR, default ./gpu_check_out)
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
SECTIONS=(tests bf16 compiled speed optimizer moe mod)
case ${2:-all} in
  1) want=tests,bf16,compiled ;;
  2) want=speed,optimizer ;;
  3) want=moe,mod ;;
  all) want=$(IFS=,; echo "${SECTIONS[*]}") ;;
  *) want=$2 ;;
esac
for w in ${want//,/ }; do  # a typo must not pass as "every step passed" on a lent machine
  if [[ ! " ${SECTIONS[*]} " =~ " $w " ]]; then
    echo "gpu_check.sh: section '$w' is not one of 1, 2, 3, all, ${SECTIONS[*]} (usage: bash benchmarks/gpu_check.sh [OUT_DIR] [1|2|3|all|SECTION[,SECTION...]])" >&2
    exit 2
  fi
done
on() { [[ ",$want," == *",$1,"* ]]; }
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
$PY -c "import megablocks, importlib.metadata as m; print('megablocks', m.version('megablocks'))" 2>&1 | tail -1 | tee -a "$OUT/gpu.txt"

if on tests; then
  echo "== GPU tests" | tee "$OUT/tests.txt"
  step "$OUT/tests.txt" 240 $PY -m pytest -q -rs -m gpu tests
fi

# bf16 RUN_NAME TIMEOUT ZERO_STAGE CONFIG [OVERRIDE...]: `mode train` for 50 bf16 steps, its last lines and DONE
bf16() {
  local name=$1 secs=$2 zero=$3 config=$4
  shift 4
  if [[ $HAVE_DS == 0 ]]; then
    echo "$name skipped: needs deepspeed" | tee -a "$OUT/bf16.txt"
    return
  fi
  step "$OUT/$name.log" "$secs" $PY -m mode.cli train --config "configs/tiny/$config" "$@" deepspeed.precision=bf16 \
    deepspeed.zero_stage="$zero" train.max_steps=50 train.eval_every=25 log.progress=false run.dir="$OUT/$name" \
    run.fresh=true >/dev/null
  tail -3 "$OUT/$name.log" | tee -a "$OUT/bf16.txt"
  cat "$OUT/$name/DONE" 2>&1 | tee -a "$OUT/bf16.txt"; echo | tee -a "$OUT/bf16.txt"
}
if on bf16; then
  echo "== bf16 training steps (tiny MoD and staged MoDE)" | tee -a "$OUT/bf16.txt"
  bf16 bf16_mod 60 1 mod.yaml
  bf16 bf16_mode_staged 60 1 mode_staged.yaml
fi
if on compiled; then
  # DeepSpeed's start + torch.compile + 50 steps (test_compile.py alone took 100 s on an H200); ZeRO 1:
  # compiled blocks faulted there until the optimizer's order kept the flat-buffer views aligned (session 28)
  echo "== bf16 training steps, compiled (tiny MoD, ZeRO 1)" | tee -a "$OUT/bf16.txt"
  bf16 bf16_mod_compiled 150 1 mod.yaml train.compile=true
fi

if on speed; then
  echo "== Speed modes: fp32/bf16 x eager/compiled, dense vs MoD (d_model 512, S 1024)" | tee "$OUT/bench_speed.txt"
  step "$OUT/bench_speed.txt" 150 $PY -m pytest -q tests/test_compile.py
  step "$OUT/bench_speed.txt" 140 $PY benchmarks/bench_speed.py --batch 8 --reps 5
fi

if on optimizer; then
  echo "== Optimizer step: AdamW loop vs foreach vs fused, and whole steps (fused is what mode train uses)" | tee "$OUT/bench_optimizer.txt"
  step "$OUT/bench_optimizer.txt" 90 $PY benchmarks/bench_optimizer.py --device cuda --reps 10
fi

if on moe; then
  # bench_moe.py measures native and MegaBlocks without DeepSpeed (its ds_* columns are then skipped).
  # The default shape is launch-bound on an H200; the large one is what a GPU run's layer looks like.
  echo "== MoE layers: native vs DeepSpeed vs MegaBlocks" | tee "$OUT/bench_moe.txt"
  step "$OUT/bench_moe.txt" 100 $PY benchmarks/bench_moe.py
  step "$OUT/bench_moe.txt" 100 $PY benchmarks/bench_moe.py --tokens 16384 --d-model 1024 --d-ff 4096
fi

if on mod; then
  echo "== MoD block speed" | tee "$OUT/bench_mod.txt"
  # the CPU benchmark's shape (fp32; launch-bound on an H200), then a GPU-sized one in bf16
  step "$OUT/bench_mod.txt" 100 $PY benchmarks/bench_mod.py --device cuda
  step "$OUT/bench_mod.txt" 100 $PY benchmarks/bench_mod.py --device cuda --dtype bf16 --d-model 2048 --heads 16 \
    --d-ff 8192 --tokens 16384 --batch 8
  # where the routing overhead (MoD minus inner, 2.6-3.8 ms a block in session 26) goes: kernels by GPU time
  step "$OUT/bench_mod.txt" 60 $PY benchmarks/bench_mod.py --device cuda --dtype bf16 --d-model 2048 --heads 16 \
    --d-ff 8192 --tokens 16384 --profile 2048,0.125
  # the causal predictor under bf16: fp32 GEMMs (before session 27) vs the stream's dtype (now)
  step "$OUT/bench_mod.txt" 60 $PY benchmarks/bench_predictor.py --device cuda --d-model 2048 --tokens 16384
fi

if ((${#failed[@]})); then
  printf 'gpu_check: %d step(s) failed:\n' "${#failed[@]}"
  printf '  %s\n' "${failed[@]}"
  exit 1
fi
echo "gpu_check: every step passed"
