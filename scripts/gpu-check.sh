#!/usr/bin/env bash
# The CUDA/NCCL path on one GPU machine, in under 8 minutes: CUDA tests,
# side-by-side bench (vs slime's op when SLIME_PATH holds a checkout with
# slime/utils/ppo_utils.py), the cost of validate=True, and an NCCL run of
# the shared cases when two or more GPUs exist (tests/torch/test_cuda.py). Figures go to $OUT_DIR
# (default gpu-results/): one log per step plus JSON where a step makes it.
#
# usage: [SLIME_PATH=DIR] [OUT_DIR=DIR] bash scripts/gpu-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT_DIR:-gpu-results}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
rc=0
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  echo "== $name" | tee -a "$out/summary.txt"
  local t0=$SECONDS
  timeout "$secs" "$@" > "$out/$name.log" 2>&1
  local r=$?
  echo "   rc=$r in $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
  tail -n 5 "$out/$name.log" | sed 's/^/   /' | tee -a "$out/summary.txt"
  [ "$r" -eq 0 ] || rc=1
}
step env 30 bash -c 'nvidia-smi; python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.device_count(), torch.cuda.get_device_name(0))"'
step tests 240 python -m pytest -q -x -p no:cacheprovider -m cuda tests
slime=()
[ -n "${SLIME_PATH:-}" ] && slime=(--slime-path "$SLIME_PATH")
step bench 150 python benchmarks/vs_slime.py --device cuda "${slime[@]}" --T 16384 --V 19008 \
  --dtypes float32,bfloat16 --rounds 2 --reps 5 --out "$out/bench_cuda.json"
step validate_cost 60 bash -c "python benchmarks/validate_cost.py --device cuda --T 16384 --V 19008 > $out/validate_cost.jsonl; cat $out/validate_cost.jsonl"
echo "gpu-check: rc=$rc; figures in $out/" | tee -a "$out/summary.txt"
exit $rc
