"""``logprob_entropy`` on logits in one process: options, errors, the in-place gradient, the compile fallback.

Each behaviour against the float64 oracle or exact identities (the shared table: test_logits_conformance.py).
"""

import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dualvp import reference  # noqa: E402
from dualvp.testing import cases  # noqa: E402
from dualvp_torch import compiled, engine_names, engines, logprob_entropy  # noqa: E402

from .test_logits_conformance import _problem  # noqa: E402


@pytest.fixture(autouse=True)
def eager(monkeypatch):
    """Eager path by default here; the fallback tests switch the compiled path on."""
    monkeypatch.setenv("DUALVP_COMPILE", "0")


# --- behaviour --------------------------------------------------------------------------


def test_entropy_grad_false_and_with_entropy_false():
    z, y, _ = _problem(T=6, V=16)
    z.requires_grad_(True)
    lp, h = logprob_entropy(z, y, entropy_grad=False)
    assert lp.requires_grad and not h.requires_grad and h.grad_fn is None
    lp2, h2 = logprob_entropy(z, y, with_entropy=False)
    assert h2 is None
    torch.testing.assert_close(lp, lp2)


@pytest.mark.parametrize("which", ["logprob", "entropy", "both"])
def test_loss_from_one_output_is_exact(which):
    z, y, keep = _problem(T=8, V=24, dtype=torch.float64, mask=True)
    z.requires_grad_(True)
    lp, h = logprob_entropy(z, y, keep_mask=keep)
    loss = {"logprob": lp.sum(), "entropy": h.sum(), "both": lp.sum() + 0.5 * h.sum()}[which]
    loss.backward()
    gl = np.ones(8) if which != "entropy" else np.zeros(8)
    ge = None if which == "logprob" else (np.ones(8) if which == "entropy" else np.full(8, 0.5))
    ref = reference.logprob_entropy_grad(z.detach().numpy(), y.numpy(), gl, ge, keep_mask=keep.numpy())
    np.testing.assert_allclose(z.grad.numpy(), ref, rtol=1e-9, atol=1e-12)


def test_double_backward_raises():
    z, y, _ = _problem(T=4, V=8, dtype=torch.float64)
    z.requires_grad_(True)
    lp, h = logprob_entropy(z, y)
    (g,) = torch.autograd.grad(lp.sum() + h.sum(), z, create_graph=True)
    with pytest.raises(RuntimeError):
        g.sum().backward()


# compiled: slow (float64 variants no other fast test compiles: ~6 s of CPU); a None cotangent is
# handled before the engine's backward runs (dualvp_torch.library._backward), the same for every engine
@pytest.mark.parametrize("impl", ["eager", pytest.param("compiled", marks=pytest.mark.slow)])
def test_output_outside_the_loss_is_a_zero_gradient_not_a_skipped_term(impl):
    """An output that does not reach the loss arrives in the backward as None (gradients are not
    materialised): it must count as zero, the other term exact, whatever the engine (float64 oracle)."""
    z, y, keep = _problem(T=6, V=16, dtype=torch.float64, mask=True)
    for which in ("logprob", "entropy"):
        zz = z.clone().requires_grad_(True)
        lp, h = logprob_entropy(zz, y, keep_mask=keep, temperature=0.7, impl=impl)
        g = torch.arange(1.0, 7.0, dtype=torch.float64)
        ((lp if which == "logprob" else h) * g).sum().backward()
        gl = g.numpy() if which == "logprob" else np.zeros(6)
        ge = g.numpy() if which == "entropy" else None
        ref = reference.logprob_entropy_grad(z.numpy(), y.numpy(), gl, ge, keep_mask=keep.numpy(), temperature=0.7)
        np.testing.assert_allclose(zz.grad.numpy(), ref, rtol=1e-9, atol=1e-12, err_msg=f"{impl} {which}")


def test_no_grad_leading_dims_noncontiguous_and_empty():
    full = torch.randn(2, 3, 32, dtype=torch.float64)
    y = torch.randint(0, 16, (2, 3))
    shard = full[..., 8:24]  # non-contiguous view with leading dims
    assert not shard.is_contiguous()
    with torch.no_grad():
        lp, h = logprob_entropy(shard, y)
    rl, rh = reference.logprob_entropy(shard.numpy(), y.numpy())
    np.testing.assert_allclose(lp.numpy(), rl, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(h.numpy(), rh, rtol=1e-10, atol=1e-10)
    t = full.transpose(0, 1)[..., :16].clone().requires_grad_(True)  # [3, 2, 16]
    lp, h = logprob_entropy(t.transpose(0, 1), y)
    (lp.sum() + h.sum()).backward()
    assert t.grad.shape == t.shape and torch.isfinite(t.grad).all()
    e = torch.zeros(0, 5, 16, requires_grad=True)
    lp, h = logprob_entropy(e, torch.zeros(0, 5, dtype=torch.long))
    assert lp.shape == (0, 5) and h.shape == (0, 5)
    (lp.sum() + h.sum()).backward()
    assert e.grad.shape == e.shape


def test_nonfinite_policy_row_by_row():
    z = torch.randn(5, 8, dtype=torch.float32)
    z[0, :] = -math.inf
    z[0, 2] = 0.5  # one finite entry
    z[1, 3] = -math.inf  # target on a banned column
    z[2, 4] = math.nan
    z[3, 1] = math.inf
    y = torch.tensor([2, 3, 0, 0, 5])
    z.requires_grad_(True)
    lp, h = logprob_entropy(z, y)
    (lp.sum() + h.sum()).backward()
    assert lp[0].item() == 0.0 and h[0].item() == 0.0 and torch.isfinite(z.grad[0]).all()
    assert lp[1].item() == -math.inf and torch.isfinite(h[1]) and torch.isfinite(z.grad[1]).all()
    assert torch.isnan(lp[2]) and torch.isnan(h[2]) and torch.isnan(z.grad[2]).all()
    assert torch.isnan(lp[3]) and torch.isnan(h[3])
    assert torch.isfinite(lp[4]) and torch.isfinite(h[4]) and torch.isfinite(z.grad[4]).all()
    rl, rh = reference.logprob_entropy(z.detach()[4:].double().numpy(), y[4:].numpy())
    np.testing.assert_allclose(lp[4:].detach().numpy(), rl, rtol=2e-5, atol=2e-5)


# --- in-place gradient ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_grad_matches_and_refuses_when_unsafe(dtype):
    z, y, keep = _problem(T=40, V=32, dtype=dtype)
    a = z.clone().requires_grad_(True)
    lp, h = logprob_entropy(a * 1, y, keep_mask=keep)
    (lp.sum() + h.sum()).backward()
    b = z.clone().requires_grad_(True)
    mid = b * 1
    lp2, h2 = logprob_entropy(mid, y, keep_mask=keep, inplace_grad=True)
    (lp2.sum() + h2.sum()).backward()
    assert torch.equal(a.grad, b.grad)
    assert torch.equal(mid.detach(), b.grad)  # the gradient lives in the logits' storage
    with pytest.raises(ValueError, match="inplace_grad: .*leaf"):
        logprob_entropy(z.clone().requires_grad_(True), y, inplace_grad=True)
    c = torch.randn(32, 40, requires_grad=True)
    with pytest.raises(ValueError, match="inplace_grad: expected contiguous"):
        logprob_entropy((c * 1).t(), y, inplace_grad=True)
    d = torch.randn(40, 32, requires_grad=True)
    mid = d * 1
    lp, _ = logprob_entropy(mid, y, inplace_grad=True)
    with torch.no_grad():
        mid.add_(1.0)  # modified between forward and backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lp.sum().backward()


# --- validation (the shared bad-input table: tests/cross/test_bad_inputs.py) -------------


def test_local_validation_errors_name_the_argument():
    z, y, _ = _problem(T=4, V=8)
    with pytest.raises(TypeError, match="^group: expected"):
        logprob_entropy(z, y, group="world")
    with pytest.raises(TypeError, match="^validate: expected"):
        logprob_entropy(z, y, validate=1)
    with pytest.raises(TypeError, match="^inplace_grad: expected"):
        logprob_entropy(z, y, inplace_grad="yes")
    with pytest.raises(ValueError, match=r"^target: expected ids in \[0, 8\)"):
        logprob_entropy(z, torch.tensor([0, 1, 8, -100]))
    # validate=False skips the range check (and its host sync)
    logprob_entropy(z, torch.tensor([0, 1, 8, -100]), validate=False)


@pytest.mark.slow  # a fresh process importing torch
def test_import_does_not_load_the_compiler():
    # torch._dynamo takes about a second to import: a process that never
    # compiles (an eager-only rank, a tool) does not pay it; the compile
    # errors the fallback catches are built on first use.
    import subprocess
    import sys

    code = ("import sys, dualvp_torch; assert 'torch._dynamo' not in sys.modules, 'imported'; "
            "from dualvp_torch import engines; import torch._dynamo.exc as e; "
            "assert e.TorchDynamoException in engines.COMPILE_ERRORS")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_compile_failure_falls_back_once(monkeypatch):
    monkeypatch.setenv("DUALVP_COMPILE", "1")
    state = dict(compiled._state)
    monkeypatch.setattr(engine_names, "_state", {"compile_failed": False})
    import torch._inductor.exc

    def fail(*a):
        raise torch._inductor.exc.CppCompileError(["c++"], "c++: command not found")

    monkeypatch.setattr(compiled, "_compiled", fail)
    z, y, _ = _problem(T=6, V=16)
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            lp, h = logprob_entropy(z, y)
            logprob_entropy(z, y)
        assert sum("falling back" in str(x.message) for x in w) == 1
        rl, rh = reference.logprob_entropy(z.double().numpy(), y.numpy())
        assert cases.within_tolerance(lp.numpy(), rl, cases.tolerance("float32", "logprob"))
    finally:
        compiled._state.clear()
        compiled._state.update(state)


@pytest.mark.parametrize("error", ["oom", "runtime", "oom_during_compile"])
def test_only_compile_failures_fall_back(monkeypatch, error):
    """A runtime error (out-of-memory included) propagates and never switches
    the process to the eager path."""
    import torch._inductor.exc

    monkeypatch.setenv("DUALVP_COMPILE", "1")
    state = dict(compiled._state)
    monkeypatch.setattr(engine_names, "_state", {"compile_failed": False})

    def fail(*a):
        if error == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        if error == "runtime":
            raise RuntimeError("a kernel failed")
        try:
            raise torch.OutOfMemoryError("out of memory while autotuning")
        except torch.OutOfMemoryError as oom:
            raise torch._inductor.exc.InductorError(oom, None) from oom

    monkeypatch.setattr(compiled, "_compiled", fail)
    z, y, _ = _problem(T=6, V=16)
    try:
        with pytest.raises((torch.OutOfMemoryError, RuntimeError)):
            logprob_entropy(z, y)
        assert not compiled.failed()
        assert engines.select() == "compiled"
    finally:
        compiled._state.clear()
        compiled._state.update(state)


def test_impl_argument_selects_and_is_checked(monkeypatch):
    monkeypatch.setenv("DUALVP_COMPILE", "1")
    assert engines.select("eager") == "eager"
    monkeypatch.setenv("DUALVP_COMPILE", "0")
    assert engines.select() == "eager" and engines.select("compiled") in ("compiled", "eager")
    z, y, _ = _problem(T=6, V=16)
    with pytest.raises(ValueError, match="^impl: expected"):
        logprob_entropy(z, y, impl="fast")
