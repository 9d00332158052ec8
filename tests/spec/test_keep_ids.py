"""The spec's kept set as ids (``spec.kept_columns`` and friends) against the float64 oracle.

The spec runs over simulated shards (``dualvp.simulate.over_shards``) in
float64, with and without column blocks; the oracle turns the ids into a mask
itself (``dualvp.reference.mask_from_ids``).
"""

import numpy as np
import pytest

from dualvp import reference, simulate, spec
from dualvp.testing import cases


@pytest.mark.parametrize("c", cases.KEEP_IDS_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("block", [None, 5])
def test_ids_over_shards_match_the_oracle(c, block):
    p = cases.make(c)
    kw = dict(temperature=c.temperature, ignore_index=c.ignore_index)
    with np.errstate(all="ignore"):
        lp0, h0 = reference.logprob_entropy(p.logits, p.target, keep_ids=p.keep_ids, **kw)
        g0 = reference.logprob_entropy_grad(p.logits, p.target, p.grad_logprob, p.grad_entropy, keep_ids=p.keep_ids,
                                            **kw)
        for world in c.worlds:
            lp, h, g = simulate.over_shards(p.logits, p.target, world, keep_ids=p.keep_ids, grad_logprob=p.grad_logprob,
                                            grad_entropy=p.grad_entropy, block=block, **kw)
            for got, want in ((lp, lp0), (h, h0), (g, g0)):
                np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-10, equal_nan=True)


def test_ids_from_mask_round_trip():
    """The kit's ids (shuffled, repeated, padded) give the case's mask back."""
    c = cases.case("nucleus")
    p = cases.make(c)
    ids = cases.ids_from_mask(np.random.default_rng(0), p.keep_mask)
    assert (ids == -1).any() and ids.shape[:-1] == p.target.shape
    np.testing.assert_array_equal(reference.mask_from_ids(ids, c.vocab), p.keep_mask)


def test_kept_columns_dedupes_and_keeps_the_target():
    # shard 1 of V_local = 4 holds global ids 4..7; the target 5 and the repeated 6 count once
    ids = np.array([[6, 6, 5, -1, 3, 9, 100]])
    cols, use = spec.kept_columns(np, ids, np.array([5]), 1, 4, -100)
    assert sorted(cols[use].tolist()) == [1, 2]
    # the target is kept though no id names it, unless its row is ignored
    cols, use = spec.kept_columns(np, ids[:, :2], np.array([5]), 1, 4, -100)
    assert sorted(cols[use].tolist()) == [1, 2]
    cols, use = spec.kept_columns(np, ids[:, :2], np.array([-100]), 1, 4, -100)
    assert cols[use].tolist() == [2]
    cols, use = spec.kept_columns(np, np.zeros((1, 0), np.int64), np.array([7]), 1, 4, -100)
    assert cols[use].tolist() == [3]
