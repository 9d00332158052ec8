"""scripts/gpu-wheels.sh and scripts/gpu-check.sh, checked without a GPU (the rehearsal,
``bash scripts/gpu-rehearse.sh``, runs the check end to end; it takes many minutes, so it is a
command in benchmarks/README.md rather than a test).

The first GPU run of a release once stopped at its first step: the image lacked a package that
dualvp_torch imports at load, and the wheels script did not fetch it.
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = os.path.join(ROOT, "scripts")


def _names(reqs):
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].strip().lower().replace("_", "-") for r in reqs}


def _script_list(text, var):
    m = re.search(rf'^{var}="([^"]*)"', text, re.M)
    assert m, f"no {var}= in gpu-wheels.sh"
    return m.group(1).split()


def test_gpu_wheels_fetches_every_requirement_the_image_lacks():
    try:
        import tomllib
    except ImportError:
        pytest.skip("needs Python 3.11 (tomllib)")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        base = tomllib.load(f)["project"]["dependencies"]
    with open(os.path.join(SCRIPTS, "gpu-wheels.sh")) as f:
        text = f.read()
    image = set(_script_list(text, "image_has"))
    fetched = {w.split("==")[0] for w in _script_list(text, "wants")}
    assert all("==" in w for w in _script_list(text, "wants")), "pin each wheel: one version of each"
    # dualvp[torch,jax,triton] and the bench's baselines
    need = _names(base + extras["torch"] + extras["jax"] + extras["triton"] + extras["bench"])
    missing = sorted(n for n in need if n not in image and n not in fetched)
    assert not missing, f"the GPU image lacks {missing} and gpu-wheels.sh does not fetch them"
    assert "array-api-compat" in fetched  # dualvp_torch imports it at load


@pytest.mark.parametrize("script", ["gpu-wheels.sh", "gpu-check.sh", "gpu-rehearse.sh"])
def test_gpu_scripts_parse(script):
    p = subprocess.run(["bash", "-n", os.path.join(SCRIPTS, script)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_gpu_check_keeps_the_compiled_triton_kernels():
    # gpu-check exports TRITON_INTERPRET=0; tests/conftest.py must keep it (it sets 1 only when the
    # variable is unset and /dev/nvidiactl is missing, and the CUDA Triton tests skip under 1)
    with open(os.path.join(SCRIPTS, "gpu-check.sh")) as f:
        assert re.search(r"^\s*export TRITON_INTERPRET=0\s*$", f.read(), re.M)
    code = ("import os, runpy; runpy.run_path(os.path.join(%r, 'tests', 'conftest.py'));"
            "print(os.environ['TRITON_INTERPRET'])" % ROOT)
    env = dict(os.environ, TRITON_INTERPRET="0")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == "0"
