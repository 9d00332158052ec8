#!/usr/bin/env bash
# On a machine with PyPI: fetch into .whl/ every package scripts/gpu-check.sh needs that the GPU
# image lacks. The image (the device notes' package list) has torch 2.11.0+cu130, triton 3.6.0,
# jax 0.11.2 with its CUDA plugin, numpy, packaging, pytest, pytest-xdist, pytest-timeout,
# hypothesis, matplotlib. Checked against dualvp[torch,jax,triton] and the bench baselines:
#   array-api-compat   dualvp[torch] (dualvp_torch imports it at load: without it nothing runs)
#   liger-kernel       the `liger` and `liger-flce` baselines (pure Python; needs torch, triton)
#   cut-cross-entropy  the `cce` baseline (pure Python; needs torch, triton)
#   megatron-core      the `megatron` baseline (one CPython wheel; needs torch, numpy, packaging)
# and slime's slime/utils/ppo_utils.py (its _VocabParallelLogProbEntropy op) under .whl/slime/,
# from SLIME_PATH (a checkout, or a bare/mirror git directory: its HEAD is read), else from a
# shallow clone of github.com/THUDM/slime; without either it is left out (the bench skips slime).
# Then run the check with `.whl` in the device tool's carry list.
#
# GPU_WHEELS_PYTHON (default 3.12, the image's) and GPU_WHEELS_DIR (default .whl) let the
# rehearsal (scripts/gpu-rehearse.sh) fetch the same packages for this machine's Python.
#
# usage: [SLIME_PATH=DIR] [GPU_WHEELS_PYTHON=3.12] [GPU_WHEELS_DIR=.whl] bash scripts/gpu-wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# what the check relies on the image for (tests/tools/test_gpu_scripts.py holds dualvp's extras to it)
image_has="torch triton jax jaxlib numpy packaging pytest pytest-xdist pytest-timeout hypothesis matplotlib"
wants="array-api-compat==1.16.0 liger-kernel==0.8.5 cut-cross-entropy==25.1.1 megatron-core==0.16.1"
dir=${GPU_WHEELS_DIR:-.whl}
pyver=${GPU_WHEELS_PYTHON:-3.12}
mkdir -p "$dir"
plats=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64; do plats+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  "${plats[@]}" -d "$dir" $wants 2> >(grep -v "^WARNING: Location" >&2)
echo "gpu-wheels: the image has $image_has"
dest=$dir/slime/slime/utils
mkdir -p "$dest"
file=slime/utils/ppo_utils.py
if [ -n "${SLIME_PATH:-}" ] && [ -f "$SLIME_PATH/$file" ]; then
  cp "$SLIME_PATH/$file" "$dest/"
elif [ -n "${SLIME_PATH:-}" ] && git --git-dir="$SLIME_PATH" rev-parse -q HEAD > /dev/null 2>&1; then
  git --git-dir="$SLIME_PATH" show "HEAD:$file" > "$dest/ppo_utils.py"
  echo "slime: $file of $(git --git-dir="$SLIME_PATH" rev-parse --short HEAD)"
else
  tmp=$(mktemp -d)
  if git clone -q --depth 1 https://github.com/THUDM/slime "$tmp/slime" 2> /dev/null; then
    cp "$tmp/slime/$file" "$dest/"
  else
    echo "gpu-wheels: no slime (set SLIME_PATH to a checkout or git directory); the bench will skip it"
    rm -rf "$dir/slime"
  fi
  rm -rf "$tmp"
fi
ls -la "$dir"
du -sh "$dir"
