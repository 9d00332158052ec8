"""``dualvp verify --op linear``: the fused LM head, torch on gloo ranks and JAX on host devices vs the oracle.

A small float32 problem at ``--tp 2`` (a keep mask, temperature 0.7) must
PASS on all twelve rows (log-prob, entropy, ``dh``, ``dW`` for torch vs
oracle, JAX vs oracle, torch vs JAX). The same in bfloat16 under the
deliberate fault ``DUALVP_TEST_FAULT=grad_tau`` (:mod:`dualvp.testing.faults`:
the JAX backward forgets ``1/temperature``) must FAIL on exactly the four rows
that see JAX's ``dh`` / ``dW`` and PASS on the other eight (torch's bfloat16
gradients among them). The adapters are also checked in this process against
the float64 oracle at W = 1. Two CLI runs in this process (tests/cross/_cli.py: 2 gloo ranks
forked from the forkserver each; the faulty run's JAX child a process, the passing run's in this
process).
"""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("jax")

from dualvp import testing  # noqa: E402
from dualvp.testing import cases  # noqa: E402
from dualvp.tools import cli  # noqa: E402

from ._cli import jax_in_process, run_verify  # noqa: E402

_SMALL = ("--op", "linear", "--tp", "2", "--tokens", "24", "--hidden", "16", "--vocab", "300",
          "--temperature", "0.7", "--mask", "nucleus", "--no-compile")


def _rows(stdout):
    return [ln for ln in stdout.splitlines() if ln.rstrip().endswith(("PASS", "FAIL"))]


@pytest.mark.slow
def test_verify_linear_passes_at_tp2(monkeypatch):
    jax_in_process(monkeypatch)
    dtype = "float32"
    proc = run_verify(*_SMALL, "--dtype", dtype)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert f"--op linear: W=2 T=24 H=16 V=300 dtype={dtype} temperature=0.7 mask=nucleus" in lines[0], lines[0]
    rows = _rows(proc.stdout)
    assert len(rows) == 12 and all(ln.rstrip().endswith("PASS") for ln in rows), proc.stdout
    got = {(ln[:18].strip(), ln.split()[3]) for ln in rows}
    assert got == {(c, q) for c in ("torch vs oracle", "jax vs oracle", "torch vs jax")
                   for q in ("logprob", "entropy", "dh", "dW")}, got
    assert proc.stdout.rstrip().endswith("PASS: 12 checks within tolerance")


@pytest.mark.slow
def test_verify_linear_bfloat16_fault_fails_the_jax_gradients():
    bad = run_verify(*_SMALL, "--dtype", "bfloat16", fault="grad_tau")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "dtype=bfloat16" in bad.stdout.splitlines()[0]
    rows = _rows(bad.stdout)
    assert len(rows) == 12, bad.stdout
    fails = {(ln[:18].strip(), ln.split()[3]) for ln in rows if ln.rstrip().endswith("FAIL")}
    assert fails == {(c, q) for c in ("jax vs oracle", "torch vs jax") for q in ("dh", "dW")}, bad.stdout


def test_linear_adapters_vs_oracle_in_process():
    """W = 1, no child: torch (eager) and JAX through ``testing.run`` on a masked problem with ignored rows."""
    c = cases.Case(name="lin", lead=(2, 9), vocab=130, worlds=(1,), temperature=1.3, mask="random",
                   ignore_frac=0.3, seed=3)
    p = cases.make_linear(c, 8)
    assert p.hidden.shape == (2, 9, 8) and p.weight.shape == (130, 8) and (p.target == -100).any()
    ref = testing.oracle(p)
    assert isinstance(ref, testing.LinearOutputs) and ref.dW.shape == (130, 8)
    # the oracle is the chain rule on the float64 logits: an independent check of oracle_linear
    z = p.hidden @ p.weight.T
    g = testing.oracle(cases.Problem(c, z, p.target, p.keep_mask, p.grad_logprob, p.grad_entropy)).grad
    np.testing.assert_allclose(ref.dh, g @ p.weight, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ref.dW, g.reshape(-1, 130).T @ p.hidden.reshape(-1, 8), rtol=1e-12, atol=1e-12)
    res = {"torch": testing.run("torch", p, 1, impl="eager"), "jax": testing.run("jax", p, 1)}
    assert testing.failures(p, res) == []
    with pytest.raises(ValueError, match="spec"):
        testing.run("spec", p, 1)


def test_linear_rejects_input_and_bad_hidden(capsys, tmp_path):
    assert cli.main(["verify", "--op", "linear", "--input", str(tmp_path / "x.pt")]) == 2
    assert "--op linear" in capsys.readouterr().err
    assert cli.main(["verify", "--op", "linear", "--hidden", "0"]) == 2
    assert "--hidden" in capsys.readouterr().err
