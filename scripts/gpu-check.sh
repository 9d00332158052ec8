#!/usr/bin/env bash
# The GPU check: one prepared run on one H100/H200 within GPU_CHECK_BUDGET seconds (default 450).
# The steps, in this order so that the goal figures come back first even from a run cut short
# (the first four take at most 240 s); each appends its rows to benchmarks/results/cuda.csv as
# they come, and a step that fails or times out does not stop the next one:
#   env       versions (Triton's: the static figures are for 3.6.0), nvidia-smi, the imports
#   check     scripts/triton_check.py: impl="triton" against the float64 oracle at the goal sizes
#             (16384x19008, 4096x75968; float32, bfloat16; with and without a keep mask)
#   profile   benchmarks/gpu_profile.py --impl triton at the goal sizes, float32 and bfloat16, every
#             mode: kernel ms against the copy-bandwidth floor measured in the same run, launches,
#             host us per call, Python calls per call
#   bench     dualvp bench, W=1 at the goal sizes: the Triton kernels, then the baselines torch-eager,
#             Liger, slime, dualvp_jax (before any inductor compile)
#   linear    dualvp bench --op linear in bfloat16: the fused Triton op, CCE, Liger, unfused, fused
#   compiled  dualvp bench, W=1: the compiled path (inductor), Megatron, and 4096x32000
#   tests     the CUDA tests (pytest -m cuda), per-test and session timeouts, failure summary (-rfE)
#   verify    dualvp verify --device cuda
#   w2        dualvp bench --worlds 2: W=2 ranks sharing the GPU over gloo
# A baseline that fails is a results row with its error (the `note` column); the step goes on.
# Output folder: $OUT_DIR, else $OUT, else gpu-results/: summary.txt (each step's status and last
# lines), steps.log (every step's output), cuda.csv (the results file), cuda.md (this run's rows).
#
# TRITON_INTERPRET=0 is exported (not unset: tests/conftest.py sets 1 where /dev/nvidiactl is
# missing, and the CUDA Triton tests would then skip themselves). Wheels the image lacks come from
# .whl/ (scripts/gpu-wheels.sh): installed with pip --no-index --no-deps into a temporary folder on
# PYTHONPATH; slime's op from .whl/slime/slime/utils/ppo_utils.py (or SLIME_PATH=DIR). Without
# CUDA the script stops after env, exit 2. GPU_CHECK_STEPS=a,b,... runs only those steps (env
# always runs).
#
# Rehearsal (GPU_CHECK_REHEARSAL=1; scripts/gpu-rehearse.sh builds its virtualenv): the same steps
# on this CPU, the CUDA device replaced by cpu, the Triton kernels under TRITON_INTERPRET=1, tiny
# sizes, wheels from GPU_CHECK_WHEELS (default .whl), rows in $OUT_DIR/rehearsal.csv (never the
# tracked file); every step's imports, arguments, implementation names, error rows and CSV
# writing are exercised. Budget and step timeouts x5 (a loaded 2-core CPU).
#
# usage: [OUT_DIR=DIR] [GPU_CHECK_BUDGET=S] [GPU_CHECK_STEPS=...] [SLIME_PATH=DIR] bash scripts/gpu-check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT_DIR:-${OUT:-gpu-results}}
mkdir -p "$out"
: > "$out/summary.txt"
: > "$out/steps.log"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
py=${GPU_CHECK_PYTHON:-python3}
rehearsal=${GPU_CHECK_REHEARSAL:-0}
wheels=${GPU_CHECK_WHEELS:-.whl}
if [ "$rehearsal" = 1 ]; then
  export TRITON_INTERPRET=1
  dev=cpu scale=5 results=$out/rehearsal.csv
  rm -f "$results"
  # tiny sizes with the shapes of the real ones (two sizes, both dtypes, every mode)
  goal=40x300,8x1000 prof_sizes=8x64,4x128 bench_sizes=16x256,8x512 compiled_sizes=16x256 lin_shapes=16x8x64
  gloo=(--gloo-size 8x128) verify=(--tokens 16 --vocab 256) prof=(--reps 1 --warmup 0 --calls 1)
  per_impl=(--per-impl-workers --reps 1 --warmup 0 --loop 1)
else
  export TRITON_INTERPRET=0
  dev=cuda scale=1 results=benchmarks/results/cuda.csv
  goal=16384x19008,4096x75968 prof_sizes=$goal bench_sizes=$goal compiled_sizes=$goal,4096x32000
  lin_shapes=4096x2048x32000,16384x4096x75968 gloo=() verify=() prof=(--calls 5) per_impl=()
fi
t_start=$SECONDS
deadline=$((SECONDS + ${GPU_CHECK_BUDGET:-450} * scale))
grace=10
rc=0
say() { echo "$*" | tee -a "$out/summary.txt"; }
step() {  # step NAME SECONDS CMD...: run with a timeout cut to the deadline; a failure sets rc=1
  local name=$1 secs=$(($2 * scale)); shift 2
  if [ -n "${GPU_CHECK_STEPS:-}" ] && [[ ",$GPU_CHECK_STEPS," != *",$name,"* ]]; then return 0; fi
  local left=$((deadline - SECONDS - grace))
  [ "$secs" -gt "$left" ] && secs=$left
  if [ "$secs" -lt 5 ]; then say "== $name: not run, out of time"; rc=1; return 1; fi
  say "== $name (timeout ${secs} s)"
  echo "==================== $name" >> "$out/steps.log"
  local t0=$SECONDS log
  log=$(mktemp)
  timeout -k "$grace" "$secs" "$@" > "$log" 2>&1
  local r=$?
  grep -v '^USDT:' "$log" >> "$out/steps.log"
  say "   rc=$r in $((SECONDS - t0)) s$([ "$r" -eq 124 ] && echo ', timed out')"
  local n=8; [ "$name" = env ] && n=25
  grep -v '^USDT:' "$log" | grep -v -i 'warning' | tail -n "$n" | sed 's/^/   /' | tee -a "$out/summary.txt"
  rm -f "$log"
  [ "$r" -eq 0 ] || rc=1
  return "$r"
}

if compgen -G "$wheels/*.whl" > /dev/null; then
  site=$(mktemp -d /tmp/dualvp-wheels.XXXXXX)
  if $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl; then
    export PYTHONPATH=$PYTHONPATH:$site
    say "installed from $wheels/: $(cd "$wheels" && ls -- *.whl | tr '\n' ' ')"
  else
    say "gpu-check: installing $wheels/*.whl failed; going on without them"
  fi
fi
slime=()  # expanded as ${slime[@]+...}: an empty array is fine under set -u on any bash
if [ -n "${SLIME_PATH:-}" ]; then slime=(--slime-path "$SLIME_PATH")
elif [ -f "$wheels/slime/slime/utils/ppo_utils.py" ]; then slime=(--slime-path "$wheels/slime"); fi

if ! GPU_CHECK_STEPS='' step env 30 env DEV="$dev" $py -c '
import os, subprocess, sys
import importlib.metadata as md
dev = os.environ["DEV"]
if dev == "cuda":
    subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"])
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "CUDA", torch.version.cuda,
      "GPUs", torch.cuda.device_count(), "TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET"))
if dev == "cuda":
    if not torch.cuda.is_available():
        sys.exit("gpu-check: no CUDA device (torch.cuda.is_available() is False); nothing here can run")
    print(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
for d in ("triton", "jax", "jaxlib", "numpy", "array-api-compat", "liger-kernel", "cut-cross-entropy",
          "megatron-core", "pytest", "pytest-xdist", "pytest-timeout", "hypothesis"):
    try:
        print(d, md.version(d))
    except md.PackageNotFoundError:
        print(d, "not installed")
import dualvp_torch, dualvp_jax  # noqa: F401 - their imports must resolve
'; then
  say "gpu-check: stopped: the env step failed (no CUDA, or a missing package); see $out/steps.log"
  exit 2
fi

# 1. correctness of exactly what is timed next (and Triton's disk cache warmed)
step check 45 $py scripts/triton_check.py --device "$dev" --sizes "$goal" --results "$results"
# 2. the goal figures: kernel time against the floor, launches, host time
step profile 60 $py benchmarks/gpu_profile.py --device "$dev" --impl triton --sizes "$prof_sizes" \
  --dtypes float32,bfloat16 "${prof[@]}" --top 4 --host --results "$results"
# 3. the Triton kernels and the baselines at W=1, before anything compiles with inductor
modes=(--modes lp,lp+ent+grad,lp+ent+grad.keep)
# whatever the first three left of their 135 s: the first four end by 240 s (x scale) after the start
bench_s=$(( (240 * scale - (SECONDS - t_start)) / scale ))
[ "$bench_s" -lt 105 ] && bench_s=105
step bench "$bench_s" $py -m dualvp bench --device "$dev" --sizes "$bench_sizes" --worlds none ${slime[@]+"${slime[@]}"} \
  "${modes[@]}" ${per_impl[@]+"${per_impl[@]}"} --results "$results" \
  --impls dualvp-torch-triton,torch-eager,liger,slime,dualvp-jax
# 4. the fused op in bfloat16: its Triton kernels first, then the baselines, then the paths that compile
step linear 90 $py -m dualvp bench --device "$dev" --op linear --dtypes bfloat16 --shapes "$lin_shapes" \
  --results "$results" --impls dualvp-fused-triton,cce,liger-flce,dualvp-unfused,dualvp-fused
# 5. the compiled path (inductor), Megatron, and the third size
step compiled 60 $py -m dualvp bench --device "$dev" --sizes "$compiled_sizes" --worlds none \
  "${modes[@]}" ${per_impl[@]+"${per_impl[@]}"} --results "$results" --impls dualvp-torch,megatron
# 6. the CUDA tests: per-test timeout, a session timeout that leaves verify and W=2 their time,
#    and the failure summary (-rfE) even when cut
xdist=(); $py -c "import xdist" 2>/dev/null && xdist=(-n $((4 / scale > 1 ? 4 / scale : 2)))
session=$(( (deadline - SECONDS - grace - 100 * scale) ))
[ "$session" -lt 30 ] && session=30
cut=(); $py -c "import sys, pytest_timeout as t; sys.exit(not hasattr(t, 'SESSION_TIMEOUT_KEY'))" 2>/dev/null \
  && cut=(--session-timeout "$session")  # pytest-timeout >= 2.3
step tests $((session / scale + 15)) $py -m pytest -q -p no:cacheprovider ${xdist[@]+"${xdist[@]}"} -m cuda \
  --timeout $((120 * scale)) ${cut[@]+"${cut[@]}"} -rfE tests
step verify 40 $py -m dualvp verify --device "$dev" ${verify[@]+"${verify[@]}"}
step w2 60 $py -m dualvp bench --device "$dev" --sizes none --worlds 2 ${gloo[@]+"${gloo[@]}"} "${modes[@]}" \
  ${slime[@]+"${slime[@]}"} --results "$results" --impls dualvp-torch-triton,dualvp-torch,slime,megatron
if [ -f "$results" ]; then
  cp "$results" "$out/$(basename "$results")" 2> /dev/null
  $py -m dualvp.tools.bench.results "$results" > "$out/cuda.md" 2>&1
  say "results: $(($(wc -l < "$results") - 1)) rows in $results (this run's commit: $out/cuda.md)"
fi
say "gpu-check: rc=$rc in $SECONDS s; output in $out/"
exit $rc
