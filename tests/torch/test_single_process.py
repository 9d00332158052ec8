"""dualvp_torch in one process (W = 1, group=None): table, gradcheck, behaviour, kernels vs spec."""

import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import array_api_compat.torch as xp  # noqa: E402

from dualvp import reference, spec  # noqa: E402
from dualvp.testing import cases  # noqa: E402
from dualvp.testing.modes import MODES  # noqa: E402
from dualvp_torch import kernels, logprob_entropy  # noqa: E402
from dualvp_torch.function import LogProbEntropyFunction  # noqa: E402

from ._sweep import LOSS_MODES, sweep  # noqa: E402


@pytest.fixture(autouse=True)
def eager(monkeypatch):
    """Eager path by default here (compilation per variant is the slow part of a
    CPU test run); the tests marked below switch the compiled path on."""
    monkeypatch.setenv("DUALVP_COMPILE", "0")


def test_table_compiled(monkeypatch):
    # Every mode in float32 and bfloat16 (the dtypes models train in); float64 and float16 in the
    # modes that share the entropy-carrying variants (2 compiled stages each instead of 5: the table
    # compiles 22 variants, not 27). Their no-entropy and in-place variants are the same code compiled
    # for another dtype: those modes run on every dtype in test_table_eager, and compiled in float32
    # and bfloat16 here (bfloat16's lean log-prob takes the full statistics, as float16's would).
    monkeypatch.setenv("DUALVP_COMPILE", "1")
    shared = tuple(m for m in LOSS_MODES if m[1] and m[2] and not m[4])
    failures = sweep(0, 1, dtype_modes={"float64": shared, "float16": shared})
    assert not failures, "\n".join(failures[:30])


def test_compiled_with_float32_sums_matches_the_oracle(monkeypatch, case="everything"):
    # Float32 row sums (kernels.FLOAT64_SUMS_DEVICES without the device: the opt-out), on the CPU:
    # the compiled kernels with float32 row sums stay within the shared tolerances ("everything":
    # keep mask, temperature, ignored rows, -inf logits).
    from ._sweep import run_case

    monkeypatch.setenv("DUALVP_COMPILE", "1")
    monkeypatch.setattr(kernels, "FLOAT64_SUMS_DEVICES", frozenset())
    assert kernels.accumulation_dtype(torch.zeros(1)) is None
    failures: list = []
    run_case(next(c for c in cases.CASES if c.name == case), 0, 1, None, LOSS_MODES[0], failures)
    assert not failures, "\n".join(failures)


def test_table_eager():
    failures = sweep(0, 1)
    assert not failures, "\n".join(failures[:30])


# --- compiled vs eager, kernels vs spec ---------------------------------------------


def _problem(T=300, V=96, dtype=torch.float32, seed=0, mask=True):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(T, V, generator=g, dtype=torch.float64) * 3).to(dtype)
    y = torch.randint(0, V, (T,), generator=g)
    y[::7] = -100
    keep = (torch.rand(T, V, generator=g) < 0.4) if mask else None
    return z, y, keep


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", [False, True])
def test_compiled_and_eager_agree(monkeypatch, dtype, mask):
    z, y, keep = _problem(dtype=dtype, mask=mask)
    gl, ge = torch.randn(300), torch.randn(300)
    out = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("DUALVP_COMPILE", flag)
        x = z.clone().requires_grad_(True)
        lp, h = logprob_entropy(x, y, keep_mask=keep, temperature=0.7)
        ((lp * gl).sum() + (h * ge).sum()).backward()
        out[flag] = (lp.detach(), h.detach(), x.grad.float())
    name = str(dtype).replace("torch.", "")
    for i, q in enumerate(("logprob", "entropy", "grad")):
        tol = cases.tolerance(name, q)
        assert cases.within_tolerance(out["1"][i].double().numpy(), out["0"][i].double().numpy(), tol), q


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("mask", [False, True])
def test_kernels_match_spec(monkeypatch, compiled, mask):
    monkeypatch.setenv("DUALVP_COMPILE", "1" if compiled else "0")
    z, y, keep = _problem(T=64, V=40, dtype=torch.float64, mask=mask)
    z[3, :] = -math.inf
    z[3, 5] = 1.0
    z[4, ::2] = -math.inf
    if keep is not None:  # every row keeps a finite entry (else the log-prob is undefined)
        keep[3, 5] = True
        keep[4, 1::2] = True
    valid, owns, local = spec.target_to_local(xp, y, 1, 40, -100)
    y2 = torch.where(valid, y % 40 + 40, y)  # rank 1 of 2 owns these
    valid, owns, local = spec.target_to_local(xp, y2, 1, 40, -100)
    tau = 0.6
    tau_t = torch.tensor(tau, dtype=torch.float64)
    if keep is not None:
        z[5, 1:] = z[5, 0] - 40.0  # kept max 67 tau below the overall max: marked and recomputed on CPU
        keep[5, 0] = False
    got = kernels.shard_stats(z, local, owns, keep, tau_t)
    want = spec.shard_stats(xp, z, local, owns, keep, tau)
    if keep is not None:
        # on CPU both paths shift the kept sum by the overall max (one pass
        # over the mask) and recompute the rows that marks with the kept max
        fast = spec.shard_stats(xp, z, local, owns, keep, tau, kept_shift="max")
        marked = spec.marked_rows(xp, fast)
        assert marked.tolist() == [i == 5 for i in range(64)]
        want = spec.redo_marked(xp, fast, want)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    comb = spec.combine_stats(xp, want[None], temperature=tau)
    gl, ge = torch.randn(64, dtype=torch.float64), torch.randn(64, dtype=torch.float64)
    gl0 = torch.where(valid, gl, torch.zeros_like(gl))
    gw = spec.grad_logits(xp, z, local, owns, keep, comb, valid, gl, ge, tau)
    # the gradient into a buffer of its own (kernels.HUGE_PAGE_DEVICES opted in) and as the stage's
    # own output (the default)
    for devices in (frozenset({"cpu"}), frozenset()):
        monkeypatch.setattr(kernels, "HUGE_PAGE_DEVICES", devices)
        g = kernels.shard_grad(z, local, owns, keep, comb.M, comb.log_s, comb.c, comb.mk, comb.log_sk, valid, gl, ge,
                               tau_t)
        torch.testing.assert_close(g, gw, rtol=1e-12, atol=1e-12)
    # the merge (compiled on a GPU by default; forced here) against the spec's, with another rank's statistics
    other = spec.shard_stats(xp, torch.randn(64, 40, dtype=torch.float64), local, torch.zeros_like(owns), keep, tau)
    all_stats = torch.stack([other, want])
    got = kernels.merge(all_stats, valid, tau_t, compiled=compiled)
    comb_w = spec.finalize(xp, spec.reduce_stats(xp, all_stats, axis=0, temperature=tau_t), tau_t)
    for a, b in zip((*got[0], got[1], got[2]), (*comb_w, *spec.outputs(xp, comb_w, valid, tau_t))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, equal_nan=True)


def test_compiled_masked_rows_far_below_the_max_match_the_oracle(monkeypatch):
    # float32: the kept sum shifted by the overall max underflows entirely for
    # rows whose kept set lies 100 tau below it; the compiled CPU stage marks
    # them and recomputes them with the kept max (else the log-prob is +inf).
    monkeypatch.setenv("DUALVP_COMPILE", "1")
    z, y, keep = _problem(T=40, V=96)
    y[y == 0] = 1
    for r in (3, 17, 18):
        z[r, 1:] = z[r, 0] - 100.0 * 0.5
        keep[r, 0] = False
    x = z.clone().requires_grad_(True)
    lp, h = logprob_entropy(x, y, keep_mask=keep, temperature=0.5)
    (lp.sum() + h.sum()).backward()
    zn, yn, kn = z.double().numpy(), y.numpy(), keep.numpy()
    rlp, rh = reference.logprob_entropy(zn, yn, keep_mask=kn, temperature=0.5)
    rg = reference.logprob_entropy_grad(zn, yn, np.ones(40), np.ones(40), keep_mask=kn, temperature=0.5)
    for q, a, b in (("logprob", lp, rlp), ("entropy", h, rh), ("grad", x.grad, rg)):
        assert cases.within_tolerance(a.detach().double().numpy(), b, cases.tolerance("float32", q)), q


# --- gradcheck ------------------------------------------------------------------------

# (mode of the shared table, temperature)
_GC_MODES = [("lp", 1.0), ("lp+ent+grad", 1.0), ("lp+ent+grad.keep", 1.0), ("lp+ent+grad", 0.45),
             ("lp+ent.keep", 1.7)]


@pytest.mark.parametrize("mode,temperature", _GC_MODES, ids=[f"{m}-tau{t}" for m, t in _GC_MODES])
def test_gradcheck_float64(mode, temperature):
    m = MODES[mode]
    z, y, keep = _problem(T=5, V=7, dtype=torch.float64, seed=3, mask=m.masked)
    z.requires_grad_(True)

    def f(x):
        lp, h = logprob_entropy(x, y, keep_mask=keep, temperature=temperature, **m.options())
        return (lp,) if h is None or not h.requires_grad else (lp, h)

    assert torch.autograd.gradcheck(f, (z,), eps=1e-6, atol=1e-7, rtol=1e-5)


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


def test_unmaterialised_grad_raises():
    class Ctx:
        pass

    from dualvp.validation import Options

    ctx = Ctx()
    ctx.opt = Options()
    ctx.impl = None
    ctx.needs_input_grad = (True, False, False, False, False, False)
    with pytest.raises(RuntimeError, match="arrived as None"):
        LogProbEntropyFunction.backward(ctx, None, torch.zeros(3))
    with pytest.raises(RuntimeError, match="entropy arrived as None"):
        LogProbEntropyFunction.backward(ctx, torch.zeros(3), None)


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


def test_import_does_not_load_the_compiler():
    # torch._dynamo takes about a second to import: a process that never
    # compiles (an eager-only rank, a tool) does not pay it; the compile
    # errors the fallback catches are built on first use.
    import subprocess
    import sys

    code = ("import sys, dualvp_torch; assert 'torch._dynamo' not in sys.modules, 'imported'; "
            "from dualvp_torch import kernels; import torch._dynamo.exc as e; "
            "assert e.TorchDynamoException in kernels.COMPILE_ERRORS")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_compile_failure_falls_back_once(monkeypatch):
    monkeypatch.setenv("DUALVP_COMPILE", "1")
    state = dict(kernels._state)
    import torch._inductor.exc

    def fail(*a):
        raise torch._inductor.exc.CppCompileError(["c++"], "c++: command not found")

    monkeypatch.setattr(kernels, "_compiled", fail)
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
        kernels._state.clear()
        kernels._state.update(state)


@pytest.mark.parametrize("error", ["oom", "runtime", "oom_during_compile"])
def test_only_compile_failures_fall_back(monkeypatch, error):
    """A runtime error (out-of-memory included) propagates and never switches
    the process to the eager path."""
    import torch._inductor.exc

    monkeypatch.setenv("DUALVP_COMPILE", "1")
    state = dict(kernels._state)

    def fail(*a):
        if error == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        if error == "runtime":
            raise RuntimeError("a kernel failed")
        try:
            raise torch.OutOfMemoryError("out of memory while autotuning")
        except torch.OutOfMemoryError as oom:
            raise torch._inductor.exc.InductorError(oom, None) from oom

    monkeypatch.setattr(kernels, "_compiled", fail)
    z, y, _ = _problem(T=6, V=16)
    try:
        with pytest.raises((torch.OutOfMemoryError, RuntimeError)):
            logprob_entropy(z, y)
        assert not kernels._state["failed"]
        assert kernels.select() == "compiled"
    finally:
        kernels._state.clear()
        kernels._state.update(state)


def test_impl_argument_selects_and_is_checked(monkeypatch):
    monkeypatch.setenv("DUALVP_COMPILE", "1")
    assert kernels.select("eager") == "eager"
    monkeypatch.setenv("DUALVP_COMPILE", "0")
    assert kernels.select() == "eager" and kernels.select("compiled") in ("compiled", "eager")
    z, y, _ = _problem(T=6, V=16)
    with pytest.raises(ValueError, match="^impl: expected"):
        logprob_entropy(z, y, impl="fast")
