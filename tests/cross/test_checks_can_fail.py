"""The checks can fail: a deliberate mistake in one backend is reported.

``DUALVP_TEST_FAULT=grad_tau`` (read by ``dualvp_jax`` at import) makes the
JAX backward forget the 1/temperature factor. In a child process with it set,
both the test helper (:func:`check_problem`) and ``dualvp verify`` must report
FAIL, on the gradient rows only; without it, the same run passes.
"""

import os
import pickle
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("jax")

from dualvp import cases  # noqa: E402
from dualvp.tools import verify  # noqa: E402
from test_cross_backends import check_problem  # noqa: E402

_CHILD = (
    "import pickle, sys; from dualvp.tools.verify import jax_outputs; "
    "item = pickle.load(open(sys.argv[1], 'rb')); "
    "pickle.dump(jax_outputs(item, 2), open(sys.argv[2], 'wb'))"
)


def _jax_in_child(item, tmp_path, fault: str) -> dict:
    src, dst = tmp_path / "item.pkl", tmp_path / "out.pkl"
    src.write_bytes(pickle.dumps(item))
    env = dict(os.environ, DUALVP_TEST_FAULT=fault)
    subprocess.run([sys.executable, "-c", _CHILD, str(src), str(dst)], env=env, check=True, timeout=300)
    return pickle.loads(dst.read_bytes())


@pytest.mark.parametrize("fault", ["", "grad_tau"])
def test_helper_reports_the_fault(tmp_path, fault):
    prob = cases.make(cases.case("temp_0.3"))
    item = verify._item(prob)
    (torch_out,) = verify.torch_outputs(0, 1, [item])
    failures = check_problem(prob, torch_out, _jax_in_child(item, tmp_path, fault))
    if not fault:
        assert failures == []
    else:
        assert failures, "a gradient off by a factor tau went unnoticed"
        assert all(" grad:" in f for f in failures), failures
        assert any(f.startswith("jax vs oracle grad") for f in failures)
        assert any(f.startswith("torch vs jax grad") for f in failures)


def test_verify_reports_the_fault():
    env = dict(os.environ, DUALVP_TEST_FAULT="grad_tau")
    args = ["--tp", "2", "--tokens", "16", "--vocab", "64", "--temperature", "0.5", "--no-compile"]
    proc = subprocess.run([sys.executable, "-m", "dualvp", "verify", *args], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    fails = [ln for ln in proc.stdout.splitlines() if ln.rstrip().endswith("FAIL")]
    assert fails and all(" grad " in ln for ln in fails), proc.stdout
    assert any(ln.startswith("jax vs oracle") for ln in fails), proc.stdout
    assert "FAIL:" in proc.stdout
    ok = subprocess.run([sys.executable, "-m", "dualvp", "verify", *args],
                        env={k: v for k, v in os.environ.items() if k != "DUALVP_TEST_FAULT"},
                        capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stdout + ok.stderr
