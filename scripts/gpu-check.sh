#!/usr/bin/env bash
# The GPU check, one prepared run on one H100/H200 within GPU_CHECK_BUDGET seconds (default 470):
#   env       versions, nvidia-smi, the imports (TRITON_INTERPRET unset: real kernels)
#   tests     python -m pytest -m cuda tests: the CUDA tests (the op's kernels against the float64
#             oracle, CUDA-graph capture and replay, torch.compile(fullgraph=True), W=2 ranks sharing
#             the GPU over gloo, the bench on the GPU)
#   verify    python -m dualvp verify --device cuda
#   bench     dualvp bench --device cuda: the logits op at 16384x19008, 4096x75968, 4096x32000,
#             float32/bfloat16, modes lp, lp+ent+grad, lp+ent+grad.keep, against slime, torch-eager,
#             Liger and dualvp_jax; then W=2 ranks sharing the GPU over gloo (rows with W=2)
#   linear    dualvp bench --device cuda --op linear: the fused LM-head op against CCE, Liger, torch
#   profile   benchmarks/gpu_profile.py: kernel time, launches and host time per call, top kernels
# Both bench steps append to benchmarks/results/cuda.csv, which is copied to the output folder
# with a Markdown table of this run's rows (cuda.md). Output folder: $OUT_DIR, else $OUT, else
# gpu-results/: summary.txt (each step's status and last lines), steps.log (every step's output),
# cuda.csv, cuda.md.
#
# Every step has its own timeout and the whole run a deadline: a step is cut to the time left.
# GPU_CHECK_STEPS=a,b,... runs only the steps of those names (env always runs).
# Wheels the image lacks (liger-kernel, cut-cross-entropy: scripts/gpu-wheels.sh fetches them)
# come from .whl/ at the repository root; slime's op from .whl/slime/slime/utils/ppo_utils.py
# (or SLIME_PATH=DIR holding slime/utils/ppo_utils.py). Without CUDA: stops after env, exit 2.
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
unset TRITON_INTERPRET
deadline=$((SECONDS + ${GPU_CHECK_BUDGET:-470}))
grace=10
rc=0
results=benchmarks/results/cuda.csv
say() { echo "$*" | tee -a "$out/summary.txt"; }
step() {  # step NAME SECONDS CMD...: run with a timeout cut to the deadline; a failure sets rc=1
  local name=$1 secs=$2; shift 2
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
  grep -v '^USDT:' "$log" | tail -n 6 | sed 's/^/   /' | tee -a "$out/summary.txt"
  rm -f "$log"
  [ "$r" -eq 0 ] || rc=1
  return "$r"
}

if compgen -G ".whl/*.whl" > /dev/null; then
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/dualvp-wheels .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/dualvp-wheels && say "installed from .whl/: $(cd .whl && ls *.whl | tr '\n' ' ')"
fi
slime=()  # expanded as ${slime[@]+...}: an empty array is fine under set -u on any bash
if [ -n "${SLIME_PATH:-}" ]; then slime=(--slime-path "$SLIME_PATH")
elif [ -f .whl/slime/slime/utils/ppo_utils.py ]; then slime=(--slime-path .whl/slime); fi

if ! GPU_CHECK_STEPS= step env 40 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  python -c "import sys, torch
print(\"python\", sys.version.split()[0], \"torch\", torch.__version__, \"CUDA\", torch.version.cuda, \"GPUs\", torch.cuda.device_count())
if not torch.cuda.is_available():
    sys.exit(\"gpu-check: no CUDA device (torch.cuda.is_available() is False); nothing here can run\")
print(torch.cuda.get_device_name(0))
import importlib.metadata as md
for d in (\"triton\", \"jax\", \"liger-kernel\", \"cut-cross-entropy\"):
    try:
        print(d, md.version(d))
    except md.PackageNotFoundError:
        print(d, \"not installed\")
import dualvp_torch, dualvp_jax  # noqa: F401 - their imports must resolve
"'; then
  say "gpu-check: stopped: the env step failed (no CUDA, or a missing package); see $out/steps.log"
  exit 2
fi

# pytest-xdist (when installed) spreads the first Triton compiles over 4 processes
xdist=(); python -c "import xdist" 2>/dev/null && xdist=(-n 4)
step tests 130 python -m pytest -q -p no:cacheprovider ${xdist[@]+"${xdist[@]}"} -m cuda tests
step verify 40 python -m dualvp verify --device cuda
# the Triton kernels first, the default (compiled) path, the baselines the goals compare with, variants
step bench 160 python -m dualvp bench --device cuda ${slime[@]+"${slime[@]}"} --worlds 2 --results "$results" \
  --impls dualvp-torch-triton,dualvp-torch,slime,torch-eager,liger,dualvp-jax,dualvp-torch-inplace
step linear 80 python -m dualvp bench --device cuda --op linear --results "$results"
step profile 40 bash -c "python benchmarks/gpu_profile.py --device cuda --T 16384 --V 19008 --host --top 6 \
  && python benchmarks/gpu_profile.py --device cuda --T 4096 --V 32000 --dtype bfloat16 --top 6"
if [ -f "$results" ]; then
  cp "$results" "$out/cuda.csv"
  python -m dualvp.tools.bench.results "$results" > "$out/cuda.md" 2>&1
  say "results: $(($(wc -l < "$results") - 1)) rows in $results (copied to $out/cuda.csv; this run: $out/cuda.md)"
fi
say "gpu-check: rc=$rc in $SECONDS s; output in $out/"
exit $rc
