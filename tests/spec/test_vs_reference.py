"""spec.py over W simulated shards equals the float64 oracle (reference.py)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dualvp import reference, simulate, testing
from dualvp.testing import cases

# Float64 round-off of spec vs oracle. The oracle forms z / tau before
# shifting, so its own error is ~ eps64 * |z| / tau (1e4 / 0.3 -> ~1e-11).
ATOL, RTOL = 1e-10, 1e-12

WORLDS = (1, 2, 3, 4, 8)


def _spec_case(c: cases.Case) -> cases.Case:
    # float64 everywhere; a vocabulary every W in WORLDS divides.
    return cases.case(c.name, dtype="float64", vocab=96 if c.vocab <= 96 else 264, worlds=(1, 2, 3, 4, 8))


def _check(prob: cases.Problem, world: int):
    # the spec in float64 (the "spec" adapter runs it in the backends' compute dtype)
    c = prob.case
    lp, h, g = simulate.over_shards(
        prob.logits, prob.target, world, keep_mask=prob.keep_mask, temperature=c.temperature,
        ignore_index=c.ignore_index, grad_logprob=prob.grad_logprob, grad_entropy=prob.grad_entropy,
    )
    rlp, rh, rg = testing.oracle(prob)
    tol = cases.Tolerance(ATOL, RTOL)
    for name, x, ref in (("logprob", lp, rlp), ("entropy", h, rh), ("grad", g, rg)):
        assert cases.within_tolerance(x, ref, tol), (name, cases.max_errors(x, ref))
        # -inf log-probs are legal; NaN never appears for legal input
        assert not np.isnan(x).any(), name
    return lp, h, g


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("c", cases.CASES, ids=lambda c: c.name)
def test_spec_matches_oracle(c, world):
    _check(cases.make(_spec_case(c)), world)


def test_extreme_rows_keep_full_precision():
    # +-1e4 logits at tau = 0.3: shifting before dividing keeps the error at
    # float64 round-off of the *differences*, far below |z| * eps.
    prob = cases.make(_spec_case(cases.case("extreme_temp")))
    lp, h, g = _check(prob, 4)
    assert np.isfinite(lp).all() and np.isfinite(h).all() and np.isfinite(g).all()


def test_target_on_banned_column():
    prob = cases.make(_spec_case(cases.case("neg_inf")))
    y0 = prob.target.reshape(-1)[0]
    assert np.isneginf(prob.logits.reshape(-1, prob.logits.shape[-1])[0, y0])
    lp, h, g = _check(prob, 8)
    assert np.isneginf(lp.reshape(-1)[0])
    assert np.isfinite(g).all() and np.isfinite(h).all()


@pytest.mark.parametrize("keep_value", [True, False])
@pytest.mark.parametrize("target", [0, 1, -100])
def test_nan_row_under_a_mask_stays_nan(keep_value, target):
    # A row holding NaN gives NaN for that row only, also through the masked
    # gradient's per-row factor (found by tests/cross/test_fuzz.py: an ignored
    # single-column NaN row with the column kept got a zero gradient).
    z = np.array([[np.nan, 0.5, -1.0], [0.2, 1.0, -0.3]])
    y = np.array([target, 1])
    keep = np.full(z.shape, keep_value)
    gl, ge = np.array([0.7, -0.2]), np.array([-0.4, 0.9])
    kw = dict(keep_mask=keep, temperature=0.25)
    lp, h, g = simulate.over_shards(z, y, 1, grad_logprob=gl, grad_entropy=ge, **kw)
    rlp, rh = reference.logprob_entropy(z, y, **kw)
    rg = reference.logprob_entropy_grad(z, y, gl, ge, **kw)
    assert np.isnan(g[0]).all() and np.isnan(rg[0]).all()
    tol = cases.Tolerance(1e-12, 1e-12)
    for x, ref in ((lp, rlp), (h, rh), (g, rg)):
        assert cases.within_tolerance(x, ref, tol), cases.max_errors(x, ref)


def test_shard_order_does_not_matter():
    # Combining the same shards in another order changes only rounding.
    from dualvp import spec

    prob = cases.make(_spec_case(cases.case("confident_lm")))
    W, vr = 4, prob.logits.shape[-1] // 4
    locs = [spec.target_to_local(np, prob.target, r, vr, -100) for r in range(W)]
    stats = np.stack(
        [spec.shard_stats(np, prob.shard(r, W)[0], locs[r][2], locs[r][1]) for r in range(W)]
    )
    a = spec.combine_stats(np, stats)
    b = spec.combine_stats(np, stats[::-1])
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-13, atol=1e-13)


# --- property tests -------------------------------------------------------------

_finite = st.floats(-50, 50, allow_nan=False, width=64)


@st.composite
def _problems(draw):
    world = draw(st.sampled_from(WORLDS))
    vr = draw(st.integers(1, 6))
    vocab = world * vr
    rows = draw(st.integers(0, 5))
    z = draw(hnp.arrays(np.float64, (rows, vocab), elements=_finite))
    banned = draw(hnp.arrays(np.bool_, (rows, vocab)))
    if rows:
        banned[:, draw(st.integers(0, vocab - 1))] = False  # every row keeps a finite entry
    z = np.where(banned, -np.inf, z)
    target = draw(hnp.arrays(np.int64, (rows,), elements=st.integers(0, vocab - 1)))
    ignored = draw(hnp.arrays(np.bool_, (rows,)))
    target = np.where(ignored, -100, target)
    keep = draw(st.one_of(st.none(), hnp.arrays(np.bool_, (rows, vocab))))
    tau = draw(st.sampled_from([0.3, 0.5, 1.0, 2.0, 7.0]))
    gl = draw(hnp.arrays(np.float64, (rows,), elements=st.floats(-3, 3)))
    ge = draw(hnp.arrays(np.float64, (rows,), elements=st.floats(-3, 3)))
    return world, z, target, keep, tau, gl, ge


@pytest.mark.slow
@given(_problems())
def test_property_spec_matches_oracle(p):
    world, z, y, keep, tau, gl, ge = p
    kw = dict(keep_mask=keep, temperature=tau)
    lp, h, g = simulate.over_shards(z, y, world, grad_logprob=gl, grad_entropy=ge, **kw)
    rlp, rh = reference.logprob_entropy(z, y, **kw)
    rg = reference.logprob_entropy_grad(z, y, gl, ge, **kw)
    tol = cases.Tolerance(1e-9, 1e-10)
    assert cases.within_tolerance(lp, rlp, tol), cases.max_errors(lp, rlp)
    assert cases.within_tolerance(h, rh, tol), cases.max_errors(h, rh)
    assert cases.within_tolerance(g, rg, tol), cases.max_errors(g, rg)


@given(_problems())
def test_property_invariants(p):
    # Independent of the oracle: probabilities bound the outputs.
    world, z, y, keep, tau, gl, ge = p
    lp, h, g = simulate.over_shards(z, y, world, keep_mask=keep, temperature=tau,
                                                grad_logprob=np.ones_like(gl), grad_entropy=None)
    n_finite = np.isfinite(z).sum(-1)
    assert np.all(h >= -1e-12) and np.all(h <= np.log(np.maximum(n_finite, 1)) + 1e-9)
    # Rows whose kept set (mask + target) holds a finite logit have a defined
    # renormalised distribution; the others are NaN by the documented policy.
    rows = np.arange(z.shape[0])
    kept = np.zeros(z.shape, bool) if keep is None else keep.copy()
    if keep is None:
        kept[:] = True
    valid = y != -100
    kept[rows[valid], y[valid]] = True
    defined = (kept & np.isfinite(z)).any(-1) | ~valid
    assert np.all(lp[defined] <= 1e-12)
    assert np.all(np.isnan(lp[~defined]))
    # the log-prob gradient of a row sums to zero (softmax is shift invariant)
    np.testing.assert_allclose(g[defined].sum(-1), 0.0, atol=1e-9)
