"""The eager engine's torch forms of the unmasked stages (``dualvp_torch.eager_forms``).

The statistics are the spec's, op for op: bit for bit those of the spec run over torch
(``stages.stats_stage``), finite or not. The gradient reorders the spec's per-element
arithmetic (``p (k0 - b d) + a 1[v=y]``): within the float64 oracle's tolerance on
finite entries, and NaN exactly where the oracle's policy puts it, with banned (-inf)
columns under large upstream entropy gradients and a small temperature (where ``b d``
could overflow on a banned column), ignored rows holding NaN, in place or not.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dualvp import reference, spec  # noqa: E402
from dualvp.testing import metrics  # noqa: E402
from dualvp_torch import eager, logprob_entropy, stages  # noqa: E402

IGNORE = -100


def _problem(T, V, seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(T, V, generator=g, dtype=torch.float64) * 4
    y = torch.randint(0, V, (T,), generator=g)
    z[1, 3:V // 2] = -torch.inf  # banned columns
    z[2, :] = -torch.inf
    z[2, y[2]] = 0.5  # one column left
    z[3, 5] = torch.nan  # a NaN row
    y[4] = IGNORE
    z[4, 6] = torch.nan  # an ignored row holding NaN
    z[5, :] = -1e30  # far below 0, all equal
    y[6] = IGNORE
    return z, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("temperature", [1.0, 0.3])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_stats_are_the_spec_stage_bits(dtype, temperature, with_entropy):
    z, y = _problem(24, 700, 1)
    z = z.to(dtype)
    valid, owns, local = spec.target_to_local(stages.xp, y, 0, z.shape[1], IGNORE)
    tau = 1 if temperature == 1 else torch.full((), temperature, dtype=stages.compute_dtype(dtype))
    got = eager.stats(z, local, owns, None, tau, with_entropy)
    want = stages.stats_stage(z, local, owns, None, tau, None, with_entropy)
    assert got.dtype == want.dtype and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("temperature", [1.0, 0.25])
@pytest.mark.parametrize("entropy_grad", [True, False])
@pytest.mark.parametrize("inplace", [False, True])
def test_gradient_vs_oracle_nonfinite(dtype, temperature, entropy_grad, inplace):
    T, V = 16, 1000
    z64, y = _problem(T, V, 2)
    tdt = getattr(torch, dtype)
    z64 = z64.to(tdt).to(torch.float64)  # values of the dtype
    rng = np.random.default_rng(3)
    gl = rng.normal(size=T) * 100.0
    ge = rng.normal(size=T) * 1e4 if entropy_grad else None  # |gH / tau| up to ~1e5
    z = z64.to(tdt, copy=True).requires_grad_(True)
    x = z * 1 if inplace else z  # in place: the gradient overwrites a non-leaf copy
    lp, h = logprob_entropy(x, y, temperature=temperature, impl="eager", inplace_grad=inplace,
                            ignore_index=IGNORE, entropy_grad=entropy_grad)
    loss = (lp.double() * torch.from_numpy(gl)).sum()
    if ge is not None:
        loss = loss + (h.double() * torch.from_numpy(ge)).sum()
    loss.backward()
    got = z.grad.double().numpy()
    want = reference.logprob_entropy_grad(z64.numpy(), y.numpy(), gl, ge, temperature=temperature,
                                          ignore_index=IGNORE)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.isnan(got[3]).all()  # the NaN row
    assert np.isnan(got[4]).all() == entropy_grad  # an ignored row holding NaN: NaN only through the entropy
    # large upstream gradients: the absolute part scales with the largest entry (as metrics.tolerance's dh / dW)
    tol = metrics.tolerance(dtype, "grad")
    scale = np.abs(want[np.isfinite(want)]).max()
    assert metrics.within_tolerance(got, want, metrics.Tolerance(tol.atol * scale, tol.rtol))
