"""The shared scenario table builds what its names promise."""

import numpy as np
import pytest

from dualvp.testing import cases


@pytest.mark.parametrize("c", cases.CASES, ids=lambda c: c.name)
def test_case_builds(c):
    p = cases.make(c)
    assert p.logits.shape == tuple(c.lead) + (c.vocab,)
    assert p.target.shape == tuple(c.lead)
    # logits are exactly representable in the case's dtype
    np.testing.assert_array_equal(cases.round_to_dtype(p.logits, c.dtype), p.logits)
    valid = p.target != c.ignore_index
    assert np.all((p.target[valid] >= 0) & (p.target[valid] < c.vocab))
    if c.mask == "drop_target" and valid.any():
        assert not p.keep_mask[valid, p.target[valid]].any() if p.target.ndim == 1 else True


@pytest.mark.slow
def test_bfloat16_rounding_matches_torch_if_available():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(0).normal(size=1000) * 100
    ours = cases.round_to_dtype(x, "bfloat16")
    theirs = torch.tensor(x, dtype=torch.float32).to(torch.bfloat16).double().numpy()
    np.testing.assert_array_equal(ours, theirs)


def test_within_tolerance_detects_errors():
    ref = np.array([1.0, -np.inf, 2.0])
    assert cases.within_tolerance(ref.copy(), ref, cases.Tolerance(0, 0))
    assert not cases.within_tolerance(np.array([1.0, 0.0, 2.0]), ref, cases.Tolerance(1, 1))
    assert not cases.within_tolerance(np.array([1.1, -np.inf, 2.0]), ref, cases.Tolerance(1e-3, 0))
    assert cases.max_errors(np.array([np.nan]), np.array([1.0]))[0] == float("inf")
    assert cases.max_errors(np.array([-np.inf, 1.5]), np.array([-np.inf, 1.0])) == (0.5, 0.5)
    assert not cases.within_tolerance(np.array([1.0, 2.0]), np.array([1.0]), cases.Tolerance(1, 1))


def test_within_rounding_detects_errors():
    # issue 45's rule for the fused op's 16-bit dh / dW: max |x - ref| <= 2 x max |rnd(ref) - ref|
    from dualvp.testing import metrics

    rng = np.random.default_rng(0)
    ref = rng.standard_normal((64, 32))
    once = cases.round_to_dtype(ref, "bfloat16")
    unit = np.abs(once - ref).max()
    assert metrics.rounding_unit(ref, "bfloat16") == unit
    assert metrics.within_rounding(once, ref, "bfloat16")  # the float64 result rounded once: 1x
    bad = ref.copy()
    bad[3, 4] += 2.5 * unit  # one entry 2.5 units off
    assert not metrics.within_rounding(bad, ref, "bfloat16")
    assert metrics.rounding_ratio(bad, ref, "bfloat16") == pytest.approx(2.5)
    nan = once.copy()
    nan[0, 0] = np.nan
    assert not metrics.within_rounding(nan, ref, "bfloat16")
    # representable values (a unit of 0): floored at 2^-(p+2) max |ref|, not a demand for exact results
    exact = np.array([1.0, -0.5, 0.25])
    assert metrics.rounding_unit(exact, "float16") == 2.0 ** -13
    assert metrics.within_rounding(exact + 2.0 ** -12, exact, "float16")
    assert not metrics.within_rounding(exact + 2.0 ** -11, exact, "float16")
    assert metrics.rounding_unit(np.zeros(3), "float16") == 2.0 ** -24  # the smallest subnormal


def test_compare_by_the_rounding_rule():
    # compare(rounding_rule=True): 16-bit dh / dW vs the oracle by issue 45's rule (the fused op's default
    # G rounding, "fixed"), a pair within twice its bound; other quantities and float32 element-wise
    from dualvp.testing import metrics
    from dualvp.testing.oracle import LinearOutputs

    rng = np.random.default_rng(1)
    ref = LinearOutputs(rng.standard_normal(8), rng.random(8), rng.standard_normal((8, 16)),
                        rng.standard_normal((32, 16)))
    unit = metrics.rounding_unit(ref.dh, "bfloat16")
    small = np.abs(ref.dh) < 0.05  # the element-wise tolerance is tight there, the rule is not
    assert small.any()
    near = ref.dh + np.where(small, 1.5 * unit, 0.0)  # 1.5 units off on the small entries only
    far = ref.dh.copy()
    far[0, 0] += 2.5 * unit
    for dh, dtype, rule, ok in [(near, "bfloat16", True, True), (near, "bfloat16", False, False),
                                (far, "bfloat16", True, False), (near, "float32", True, False)]:
        rows = metrics.compare({"torch": ref._replace(dh=dh)}, ref, dtype, rounding_rule=rule)
        got = {r.quantity: r.ok for r in rows}
        assert got == {"logprob": True, "entropy": True, "dh": ok, "dW": True}, (dtype, rule, got)
    # a pair: each within 2 units of the oracle, so within 4 of each other
    a, b = ref._replace(dh=ref.dh + 1.9 * unit), ref._replace(dh=ref.dh - 1.9 * unit)
    rows = metrics.compare({"torch": a, "jax": b}, ref, "bfloat16", rounding_rule=True)
    assert all(r.ok for r in rows), rows
    c = ref._replace(dh=ref.dh - 2.2 * unit)
    pair = [r for r in metrics.compare({"torch": a, "jax": c}, ref, "bfloat16", rounding_rule=True)
            if r.check == "torch vs jax" and r.quantity == "dh"]
    assert not pair[0].ok


def test_oracle_is_exported_only_as_reference():
    import dualvp

    assert not hasattr(dualvp, "logprob_entropy") and not hasattr(dualvp, "cases")

