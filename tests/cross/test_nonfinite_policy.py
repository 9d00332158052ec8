"""The documented non-finite policy, row by row, for both backends (W = 1 and 2).

Rows: (0) ordinary; (1) banned (-inf) columns; (2) a whole shard banned;
(3) the target's logit is -inf; (4) a NaN; (5) a +inf; (6) a NaN on the
*other* shard than the target; (7) ordinary again. Rows 4-6 must give NaN
log-prob, entropy and gradient; all other rows must be finite (row 3:
log-prob -inf) and equal the oracle, unaffected by the poisoned rows.
"""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("jax")

from dualvp import testing  # noqa: E402
from dualvp.testing import cases  # noqa: E402

V = 8
POISONED = [4, 5, 6]


def _problem() -> cases.Problem:
    rng = np.random.default_rng(0)
    z = rng.normal(size=(8, V))
    y = np.array([1, 2, 6, 3, 1, 1, 1, 5])
    z[1, [0, 5, 7]] = -np.inf
    z[2, :4] = -np.inf  # shard 0 of 2 entirely banned
    z[3, 3] = -np.inf  # the target itself
    z[4, 2] = np.nan
    z[5, 6] = np.inf
    z[6, 7] = np.nan  # shard 1; the target (1) lives on shard 0
    c = cases.Case("nonfinite", lead=(8,), vocab=V, worlds=(1, 2), dtype="float32")
    return cases.Problem(c, cases.round_to_dtype(z, "float32"), y, None, rng.normal(size=8), rng.normal(size=8))


def _check(out: testing.Outputs, prob: cases.Problem):
    lp, h, g = testing.oracle(prob)
    out = out._asdict()
    for r in range(8):
        if r in POISONED:
            assert np.isnan(out["logprob"][r]) and np.isnan(out["entropy"][r]), r
            assert np.isnan(out["grad"][r]).all(), r
            continue
        assert np.isfinite(out["entropy"][r]) and np.isfinite(out["grad"][r]).all(), r
        if r == 3:
            assert out["logprob"][r] == -np.inf
        else:
            assert np.isfinite(out["logprob"][r]), r
        for q, ref in (("logprob", lp), ("entropy", h), ("grad", g)):
            assert cases.within_tolerance(out[q][r], ref[r], cases.tolerance("float32", q)), (q, r)


# torch: the compiled kernels at W = 1 (their per-shard non-finite handling), the
# eager ones at W = 2 (the combine across shards is the same code on both paths;
# two ranks compiling would cost more than the rest of this file). The fast tier:
# torch's eager kernels at W = 1 (no compile) and JAX over two shards.
@pytest.mark.parametrize("backend,world,impl", [pytest.param("jax", 1, None, marks=pytest.mark.slow), ("jax", 2, None),
                                                pytest.param("torch", 1, "compiled", marks=pytest.mark.slow),
                                                ("torch", 1, "eager"),
                                                pytest.param("torch", 2, "eager", marks=pytest.mark.slow)])
def test_rows(backend, world, impl):
    prob = _problem()
    _check(testing.run(backend, prob, world, impl=impl, timeout=300), prob)
