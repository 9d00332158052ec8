"""The checks can fail: a deliberate mistake in one backend is reported.

``DUALVP_TEST_FAULT=grad_tau`` (the seam :mod:`dualvp.testing.faults`, honoured
by the JAX adapter) makes the JAX backward forget the 1/temperature factor. In
a child process with it set, both the tests' comparison
(:func:`dualvp.testing.failures`) and ``dualvp verify`` must report FAIL, on
the gradient rows only; without it, the same problem passes. The JAX child is
started by ``dualvp verify``'s own launcher (:func:`dualvp.tools.verify.start_jax`).
"""

import types

import pytest

pytest.importorskip("torch")
pytest.importorskip("jax")

from dualvp import testing  # noqa: E402
from dualvp.testing import cases, faults  # noqa: E402
from dualvp.tools import verify  # noqa: E402

from ._cli import run_verify  # noqa: E402


@pytest.mark.slow  # the tests' harness, not the library (the fast tier's: test_verify_input.py's comparison)
def test_helper_reports_the_fault(tmp_path):
    # Without the fault the same problem passes: tests/cross/test_cross_backends.py
    # [temp_0.3-W2] (JAX at W = 2 and torch, no failure), and every passing verify run
    # goes through the same start_jax / finish_jax child.
    prob = cases.make(cases.case("temp_0.3"))
    started = verify.start_jax(prob, 2, str(tmp_path), {faults.ENV: "grad_tau"})
    torch_out = testing.run("torch", prob, 1, impl="eager")
    failures = testing.failures(prob, {"torch": torch_out, "jax": verify.finish_jax(started, 300)})
    assert failures, "a gradient off by a factor tau went unnoticed"
    assert all(" grad:" in f for f in failures), failures
    assert any(f.startswith("jax vs oracle grad") for f in failures)
    assert any(f.startswith("torch vs jax grad") for f in failures)


@pytest.mark.slow
def test_verify_reports_the_fault():
    args = ["--tp", "2", "--tokens", "16", "--vocab", "64", "--temperature", "0.5", "--no-compile"]
    proc = run_verify(*args, fault="grad_tau")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    fails = [ln for ln in proc.stdout.splitlines() if ln.rstrip().endswith("FAIL")]
    assert fails and all(" grad " in ln for ln in fails), proc.stdout
    assert any(ln.startswith("jax vs oracle") for ln in fails), proc.stdout
    assert any(ln.startswith("torch vs jax") for ln in fails), proc.stdout
    assert "FAIL:" in proc.stdout
    # without the fault the same problem passes: JAX at W = 2 in this process (no child to start; verify's
    # own passing runs, JAX child and table, are test_verify_input.py's, e.g. test_npz_file_passes_at_tp2)
    prob = verify.problem_for(types.SimpleNamespace(op="logits", tokens=16, vocab=64, tp=2, dtype="float32",
                                                    temperature=0.5, mask="none", seed=0))
    assert testing.failures(prob, {"jax": testing.run("jax", prob, 2)}) == []
