#!/usr/bin/env bash
# On a machine with PyPI: fetch into .whl/ what scripts/gpu-check.sh needs beyond the GPU image
# (which has torch, triton, jax, pytest and pytest-xdist): the wheels of the baselines Liger-Kernel
# and Cut Cross-Entropy (pure Python, no dependencies beyond torch and triton; about 1 MB together),
# and slime's slime/utils/ppo_utils.py (its _VocabParallelLogProbEntropy op) under .whl/slime/.
# slime comes from SLIME_PATH (a checkout, or a bare/mirror git directory: its HEAD is read),
# else from a shallow clone of github.com/THUDM/slime; without either it is left out.
# Then run the check with `.whl` in the device tool's carry list.
#
# usage: [SLIME_PATH=DIR] bash scripts/gpu-wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
  liger-kernel==0.8.5 cut-cross-entropy==25.1.1
dest=.whl/slime/slime/utils
mkdir -p "$dest"
file=slime/utils/ppo_utils.py
if [ -n "${SLIME_PATH:-}" ] && [ -f "$SLIME_PATH/$file" ]; then
  cp "$SLIME_PATH/$file" "$dest/"
elif [ -n "${SLIME_PATH:-}" ] && git --git-dir="$SLIME_PATH" rev-parse -q HEAD > /dev/null 2>&1; then
  git --git-dir="$SLIME_PATH" show "HEAD:$file" > "$dest/ppo_utils.py"
else
  tmp=$(mktemp -d)
  if git clone -q --depth 1 https://github.com/THUDM/slime "$tmp/slime" 2> /dev/null; then
    cp "$tmp/slime/$file" "$dest/"
  else
    echo "gpu-wheels: no slime (set SLIME_PATH to a checkout or git directory); the bench will skip it"
    rm -rf .whl/slime
  fi
  rm -rf "$tmp"
fi
ls -la .whl
du -sh .whl
