#!/usr/bin/env bash
# The GPU check's rehearsal on this CPU: scripts/gpu-check.sh end to end with GPU_CHECK_REHEARSAL=1
# (tiny sizes, the CUDA device replaced by cpu, the Triton kernels under TRITON_INTERPRET=1), in a
# virtualenv holding only the GPU image's packages at the versions closest to the image's that the
# package index has, plus the wheels scripts/gpu-wheels.sh fetches, installed the way the GPU run
# installs them (pip --no-index --no-deps --target, on PYTHONPATH).
#
#   image (device notes)     here
#   Python 3.12.3            $REHEARSAL_PYTHON (default python3.11: the CPU torch wheel on disk)
#   torch 2.11.0+cu130       torch 2.13.0 (CPU; a CUDA torch from the index is gigabytes)
#   triton 3.6.0             triton 3.6.0
#   jax/jaxlib 0.11.2        0.10.2 (the newest the index has)
#   numpy 2.5.2              2.3.5: Triton 3.6.0's interpreter calls int() on one-element arrays,
#                            an error from NumPy 2.4 on (the GPU run interprets nothing)
#   pytest, pytest-xdist, pytest-timeout, hypothesis, packaging: the index's
#
# The virtualenv and the wheels are cached under .rehearsal/ (ignored by git); the check's output
# goes to .rehearsal/out/ (summary.txt, steps.log, rehearsal.csv, cuda.md). Exit status: the
# check's. Needs the package index once (then the cache); slime's file from SLIME_PATH or .whl/slime.
#
# usage: [SLIME_PATH=DIR] [GPU_CHECK_STEPS=...] bash scripts/gpu-rehearse.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=.rehearsal
venv=$root/venv
reqs="torch==2.13.0 triton==3.6.0 jax==0.10.2 jaxlib==0.10.2 numpy==2.3.5 pytest pytest-xdist pytest-timeout
hypothesis packaging"
stamp=$venv/.dualvp-rehearsal-$(echo "$reqs" | md5sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  [ -x "$venv/bin/python" ] || "${REHEARSAL_PYTHON:-python3.11}" -m venv "$venv"
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install -q $reqs
  rm -f "$venv"/.dualvp-rehearsal-*
  touch "$stamp"
fi
if ! compgen -G "$root/whl/*.whl" > /dev/null; then
  pyver=$("$venv/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  GPU_WHEELS_PYTHON=$pyver GPU_WHEELS_DIR=$root/whl SLIME_PATH=${SLIME_PATH:-} bash scripts/gpu-wheels.sh > /dev/null
fi
if [ ! -f "$root/whl/slime/slime/utils/ppo_utils.py" ] && [ -f .whl/slime/slime/utils/ppo_utils.py ]; then
  mkdir -p "$root/whl/slime/slime/utils" && cp .whl/slime/slime/utils/ppo_utils.py "$root/whl/slime/slime/utils/"
fi
rm -rf "$root/out"
# SLIME_PATH was for gpu-wheels.sh (a git directory will do there); the check reads slime from the wheels
# a copy runs (bash reads a script as it goes: an edit during the long run would break it); from
# .rehearsal/ it finds the repository root as scripts/ does
cp scripts/gpu-check.sh "$root/gpu-check.sh"
PATH=$PWD/$venv/bin:$PATH GPU_CHECK_REHEARSAL=1 GPU_CHECK_WHEELS=$root/whl OUT_DIR=$root/out SLIME_PATH='' \
  bash "$root/gpu-check.sh" || true
# Passed: every step ran to its end (none cut, none left out) with exit status 0, and every results
# row with an error is Cut Cross-Entropy's under the interpreter (its kernels do not interpret: the
# linear step's status is then 1, and its row says why). A step that fails here fails on the GPU.
"$venv/bin/python" - "$root/out" <<'PY'
import csv, os, re, sys
out = sys.argv[1]
summary = open(os.path.join(out, "summary.txt")).read()
steps = re.findall(r"^== (\w+)(.*)\n(?:   rc=(\d+) in (\d+) s(.*))?", summary, re.M)
path = os.path.join(out, "rehearsal.csv")
rows = list(csv.DictReader(open(path))) if os.path.exists(path) else []
errors = [(r["impl"], r["op"], r["note"][:90]) for r in rows if (r.get("note") or "").startswith("error")]
bad = [f"{r[1]} {r[2]}" for r in errors if r[0] != "cce"]
for name, head, rc, secs, tail in steps:
    ok = rc == "0" or (name == "linear" and rc == "1" and all(e[0] == "cce" for e in errors))
    print(f"rehearsal: {name:9s} {'ok  ' if ok else 'FAIL'} {secs or '-':>4s} s {head.strip()} {tail.strip()}")
    if not ok:
        bad.append(f"step {name}: rc={rc or 'none'}{tail}")
names = [s[0] for s in steps]
want = ["env", "check", "profile", "bench", "linear", "compiled", "tests", "verify", "w2"]
if names != want:
    bad.append(f"steps {names}, expected {want}")
print(f"rehearsal: {len(rows)} rows, {len(errors)} with an error ({sorted(set(e[0] for e in errors))})")
print("rehearsal: passed" if not bad else "rehearsal: FAILED: " + "; ".join(bad))
sys.exit(1 if bad else 0)
PY
