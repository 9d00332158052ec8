"""``logprob_entropy`` on logits in one process (W = 1, group=None) against the float64 oracle.

The shared table (eager; compiled: slow), the compiled kernels with float32 row sums, compiled against
eager, the stages against the spec's functions, masked rows far below the max, and gradcheck.
(Behaviour, errors and the compile fallback: test_logits_behaviour.py; W = 2, 4: test_logits_ranks.py.)
"""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import array_api_compat.torch as xp  # noqa: E402

from dualvp import reference, spec  # noqa: E402
from dualvp.testing import cases  # noqa: E402
from dualvp.testing.modes import MODES  # noqa: E402
from dualvp_torch import engines, logprob_entropy, tuning  # noqa: E402

from ._sweep import LOSS_MODES, sweep  # noqa: E402


@pytest.fixture(autouse=True)
def eager(monkeypatch):
    """Eager path by default here (compilation per variant is the slow part of a
    CPU test run); the tests marked below switch the compiled path on."""
    monkeypatch.setenv("DUALVP_COMPILE", "0")


@pytest.mark.slow
def test_table_compiled(monkeypatch):
    # Every mode in float32 and bfloat16 (the dtypes models train in); float64 in the modes that share
    # the entropy-carrying variants (2 compiled stages instead of 5). Its no-entropy and in-place
    # variants are the same code compiled for another dtype: those modes run on every dtype in
    # test_table_eager, and compiled in float32 and bfloat16 here. float16 is not compiled here: its
    # compiled stages take bfloat16's Python path (float32 compute, the full statistics on the CPU:
    # Tuning.full_stats_cpu_dtypes), the same code for another 16-bit dtype; its case runs on the
    # eager engine in test_table_eager (every mode).
    monkeypatch.setenv("DUALVP_COMPILE", "1")
    shared = tuple(m for m in LOSS_MODES if m[1] and m[2] and not m[4])
    failures = sweep(0, 1, dtype_modes={"float64": shared, "float16": ()})
    assert not failures, "\n".join(failures[:30])


def test_compiled_case_matches_the_oracle(monkeypatch):
    # The fast tier's compiled run of the op (the default tuning) against the oracle: the case with
    # everything (keep mask, temperature, ignored rows, -inf logits), log-prob and entropy loss.
    from ._sweep import run_case

    monkeypatch.setenv("DUALVP_COMPILE", "1")
    failures: list = []
    run_case(next(c for c in cases.CASES if c.name == "everything"), 0, 1, None, LOSS_MODES[0], failures)
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_compiled_with_float32_sums_matches_the_oracle(monkeypatch, case="everything"):
    # Float32 row sums (Tuning.float64_sums_devices without the device: the opt-out), on the CPU:
    # the compiled kernels with float32 row sums stay within the shared tolerances ("everything":
    # keep mask, temperature, ignored rows, -inf logits).
    from ._sweep import run_case

    monkeypatch.setenv("DUALVP_COMPILE", "1")
    assert engines.accumulation_dtype(torch.zeros(1)) == torch.float64  # the default
    failures: list = []
    with tuning.using(tuning.Tuning(float64_sums_devices=())):
        assert engines.accumulation_dtype(torch.zeros(1)) is None
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


@pytest.mark.parametrize("dtype,mask", [
    (torch.float32, True),  # the compiled variants of test_compiled_case_matches_the_oracle: no compile of its own
    pytest.param(torch.float32, False, marks=pytest.mark.slow),
    pytest.param(torch.bfloat16, False, marks=pytest.mark.slow),
    pytest.param(torch.bfloat16, True, marks=pytest.mark.slow),
])
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


@pytest.mark.parametrize("compiled", [pytest.param(True, marks=pytest.mark.slow), False])
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
    got = engines.shard_stats(z, local, owns, keep, tau_t, compiled=compiled)
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
    gw = spec.grad_logits(xp, z, local, owns, keep, comb, valid, gl, ge, tau)
    res = torch.stack(comb[:5])  # the row statistics as one value
    g = engines.shard_grad(z, local, owns, keep, res, valid, gl, ge, tau_t, compiled=compiled)
    torch.testing.assert_close(g, gw, rtol=1e-12, atol=1e-12)
    # the merge (compiled on a GPU by default; forced here) against the spec's, with another rank's statistics
    other = spec.shard_stats(xp, torch.randn(64, 40, dtype=torch.float64), local, torch.zeros_like(owns), keep, tau)
    all_stats = torch.stack([other, want])
    got = engines.merge(all_stats, valid, tau_t, compiled=compiled, on_cpu=not compiled)
    comb_w = spec.finalize(xp, spec.reduce_stats(xp, all_stats, axis=0, temperature=tau_t), tau_t)
    for a, b in zip((*got[0], got[1], got[2]), (*comb_w[:5], *spec.outputs(xp, comb_w, valid, tau_t))):
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
