#!/usr/bin/env bash
# The CUDA/NCCL path on one GPU machine, in under 9 minutes: the op's CUDA
# tests (pytest -m cuda tests/torch: tests/torch/test_cuda.py), `dualvp
# verify --device cuda`, then what the code changed since the last GPU run
# (the per-call host work): a profile of one call with its host side
# (benchmarks/gpu_profile.py --host, at 16384 x 19008 and 4096 x 32000),
# `dualvp bench --device cuda` at T=4096, V_local=32000 (vs slime's op when
# SLIME_PATH holds a checkout with slime/utils/ppo_utils.py) and
# benchmarks/vs_slime.py at T=16384, V_local=19008; then, while time is
# left, what the three H200 runs answered, re-measured: verify --op linear,
# the per-call cost of validate=True (benchmarks/validate_cost.py), float32
# vs float64 row sums (benchmarks/gpu_precision.py), the fused LM-head op's
# bench (bench_linear_cuda.json), dualvp_jax's two forwards
# (benchmarks/jax_paths.py), the tests of the --device cuda commands
# (pytest -m cuda tests/tools) and dualvp-jax / jax-naive beside
# dualvp-torch (bench_jax_cuda.json).
# With two or more GPUs verify also runs on NCCL ranks (the tests do too).
# Figures go to $OUT_DIR (default gpu-results/): summary.txt, one log per
# step, the JSON files.
#
# Every step has its own timeout and the whole run a deadline (GPU_CHECK_BUDGET
# seconds, default 520, kill grace included): a step is cut to the time left,
# and an extra step that would not get 30 s is skipped. Without CUDA the
# script stops after the env step, exit 2.
#
# GPU_CHECK_STEPS=a,b,... runs only the steps of those names (env always runs).
#
# usage: [SLIME_PATH=DIR] [OUT_DIR=DIR] [GPU_CHECK_BUDGET=S] [GPU_CHECK_STEPS=...] bash scripts/gpu-check.sh
# (wheels of missing packages, if any, in .whl/ at the repository root)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT_DIR:-gpu-results}
mkdir -p "$out"
: > "$out/summary.txt"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
deadline=$((SECONDS + ${GPU_CHECK_BUDGET:-520}))
grace=10
rc=0
say() { echo "$*" | tee -a "$out/summary.txt"; }
step() {  # step NAME SECONDS CMD...: run with a timeout cut to the deadline; a failure sets rc=1
  local name=$1 secs=$2; shift 2
  if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ ",$GPU_CHECK_STEPS," != *",$name,"* ]]; then return 0; fi
  local left=$((deadline - SECONDS - grace))
  [ "$secs" -gt "$left" ] && secs=$left
  if [ "$secs" -lt 5 ]; then say "== $name: not run, out of time"; rc=1; return 1; fi
  say "== $name (timeout ${secs} s)"
  local t0=$SECONDS
  timeout -k "$grace" "$secs" "$@" > "$out/$name.log" 2>&1
  local r=$?
  say "   rc=$r in $((SECONDS - t0)) s$([ "$r" -eq 124 ] && echo ', timed out')"
  tail -n 5 "$out/$name.log" | sed 's/^/   /' | tee -a "$out/summary.txt"
  [ "$r" -eq 0 ] || rc=1
  return "$r"
}
extra() {  # extra NAME SECONDS CMD...: a step that runs only if 30 s or more are left
  if [ $((deadline - SECONDS - grace)) -lt 30 ]; then say "== $1: skipped, under 30 s left"; return 0; fi
  step "$@"
}

# Wheels in .whl/ (a machine without a package index: e.g. array-api-compat, which
# the H200 image lacked) are installed into a private target first. The env step
# imports dualvp_torch and dualvp_jax, so a missing dependency stops the run here
# instead of failing every later step.
if compgen -G ".whl/*.whl" > /dev/null; then
  python -m pip install -q --no-index --no-deps --no-compile --target /tmp/dualvp-wheels .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/dualvp-wheels && say "installed from .whl/: $(ls .whl | tr '\n' ' ')"
fi
if ! GPU_CHECK_STEPS= step env 30 bash -c 'nvidia-smi || echo "(no nvidia-smi)"
  python -c "import sys, torch
print(\"torch\", torch.__version__, \"CUDA\", torch.version.cuda, \"GPUs\", torch.cuda.device_count())
if not torch.cuda.is_available():
    sys.exit(\"gpu-check: no CUDA device (torch.cuda.is_available() is False); nothing here can run\")
print(torch.cuda.get_device_name(0))
import dualvp_torch, dualvp_jax  # noqa: F401 - their imports (array_api_compat, jax) must resolve
"'; then
  say "gpu-check: stopped: the env step failed (no CUDA, or a missing package); see $out/env.log"
  exit 2
fi
gpus=$(python -c "import torch; print(torch.cuda.device_count())")

# pytest-xdist (when installed) spreads the first Triton compiles of the ~100 cases over 4 processes
xdist=(); python -c "import xdist" 2>/dev/null && xdist=(-n 4)
step tests 180 python -m pytest -q -p no:cacheprovider ${xdist[@]+"${xdist[@]}"} -m cuda tests/torch
step verify 60 python -m dualvp verify --device cuda --tp 1
if [ "$gpus" -ge 2 ]; then
  step verify_nccl 90 python -m dualvp verify --device cuda --tp "$([ "$gpus" -ge 4 ] && echo 4 || echo 2)"
fi
slime=()  # expanded as ${slime[@]+...}: an empty array is fine under set -u on any bash
[ -n "${SLIME_PATH:-}" ] && slime=(--slime-path "$SLIME_PATH")
# Order (after the tests and verify): what this code changed since the last GPU run first.
# The fourth session cut the per-call host work (row marks and the duck-sizing patch only at a
# compiled variant's first call; 373 -> 291 us per fwd+bwd on the CPU with the GPU's settings),
# which the third GPU run found to bound the op at T = 4096 (~2 ms per forward for ~0.1 ms of
# kernels): the profile with --host, then the 4096 x 32000 bench (float32 first, dualvp and slime
# first: its JSON is written as it goes), then vs_slime at 16384 x 19008.
step profile 75 bash -c "python benchmarks/gpu_profile.py --device cuda --T 16384 --V 19008 --modes lp,ent,mask --host \
  && python benchmarks/gpu_profile.py --device cuda --T 4096 --V 32000 --modes lp,ent,mask --host"
step bench 170 python -m dualvp bench --device cuda ${slime[@]+"${slime[@]}"} --sizes 4096x32000 --dtypes float32,bfloat16 \
  --modes lp,lp+ent+grad,lp+ent+grad.keep --impls dualvp-torch,slime,torch-eager \
  --reps 5 --out "$out/bench_cuda.json" \
  && python -m dualvp bench --report "$out/bench_cuda.json" > "$out/bench_cuda.md"
extra vs_slime 100 python benchmarks/vs_slime.py --device cuda ${slime[@]+"${slime[@]}"} --T 16384 --V 19008 \
  --dtypes float32,bfloat16 --rounds 2 --reps 5 --out "$out/vs_slime_cuda.json"
# Extras that the three H200 runs answered (re-measured with the current code while time is left):
# verify --op linear, validate=True's per-call cost, float32 vs float64 row sums, the --device cuda
# commands' own tests (79 s), dualvp-jax beside dualvp-torch, the fused LM-head op's bench (run 6:
# fused 37 / 47 ms vs unfused 5.3 / 35 ms, bf16 / fp32) and dualvp_jax's two forwards (run 6:
# chunks 4.7-5.8x slower than the whole shard on the GPU: the CPU-only choice stands).
extra verify_linear 45 python -m dualvp verify --device cuda --tp 1 --op linear --hidden 256
extra validate_cost 45 bash -c "python benchmarks/validate_cost.py --device cuda --T 16384 --V 19008 \
  > $out/validate_cost.jsonl && cat $out/validate_cost.jsonl"
extra precision 60 python benchmarks/gpu_precision.py --device cuda --T 16384 --V 19008
extra bench_linear 120 python -m dualvp bench --op linear --device cuda ${slime[@]+"${slime[@]}"} \
  --T 4096 --hidden 2048 --V 32000 --dtypes bfloat16,float32 --reps 5 --out "$out/bench_linear_cuda.json"
extra jax_paths 60 env JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false \
  python benchmarks/jax_paths.py --T 16384 --V 19008 --reps 10
extra tests_cli 150 python -m pytest -q -p no:cacheprovider -m cuda tests/tools
extra bench_jax 90 python -m dualvp bench --device cuda --sizes 4096x32000 --dtypes float32,bfloat16 \
  --modes lp,lp+ent+grad --impls dualvp-torch,dualvp-jax,jax-naive --reps 5 --out "$out/bench_jax_cuda.json"
say "gpu-check: rc=$rc in $SECONDS s; figures in $out/"
exit $rc
