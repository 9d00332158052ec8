"""The spec's extended op (K targets per row, a per-row temperature, sum of p^2) in NumPy float64,
sharded W = 1, 2, 4, 8, against the float64 oracle on :data:`dualvp.testing.extended.EXT_CASES`."""

import numpy as np
import pytest

from dualvp import spec
from dualvp.testing import extended as ext


def _spec_outputs(prob: ext.ExtProblem, world: int) -> ext.ExtOutputs:
    c = prob.case
    multi = c.targets > 0
    y = prob.target if multi else prob.target[..., None]
    gl = prob.grad_logprob if multi else prob.grad_logprob[..., None]
    tau = prob.temperature
    v_local = prob.logits.shape[-1] // world
    lay = spec.ExtLayout(y.shape[-1], prob.keep_mask is not None, c.sum_p2)
    positions = [spec.target_to_local(np, y, r, v_local, c.ignore_index) for r in range(world)]
    with np.errstate(all="ignore"):
        stats = [spec.ext_block_stats(np, *_shard(prob, r, world, pos), tau, with_sum_p2=c.sum_p2)
                 for r, pos in enumerate(positions)]
        ec = spec.ext_finalize(np, spec.ext_reduce_stats(np, np.stack(stats), lay, 0, tau), lay, tau)
        valid = positions[0][0]
        lp, h, p2 = spec.ext_outputs(np, ec, valid, tau)
        g = np.concatenate([spec.ext_block_grad(np, prob.shard(r, world)[0], pos[2], pos[1], prob.shard(r, world)[1],
                                                ec, valid, gl, prob.grad_entropy, tau, g_sum_p2=prob.grad_sum_p2)
                            for r, pos in enumerate(positions)], axis=-1)
    return ext.ExtOutputs(lp if multi else lp[..., 0], h, g, p2)


def _shard(prob, r, world, pos):
    z, keep = prob.shard(r, world)
    _, owns, local = pos
    return z, local, owns, keep


_PARAMS = [pytest.param(c, w, id=f"{c.name}-W{w}") for c in ext.EXT_CASES for w in c.worlds]


@pytest.mark.parametrize("case,world", _PARAMS)
def test_spec_extended_vs_oracle(case, world):
    prob = ext.make_ext(case)
    bad = ext.ext_failures(prob, _spec_outputs(prob, world))
    assert not bad, (case.name, world, bad)


def test_extended_cases_exercise_the_options():
    # the table is not vacuous: K > 1 with repeats, dropped targets, ignored targets, per-row taus that differ
    p = ext.make_ext(ext.ext_case("all_drop_target"))
    assert p.target.shape[-1] == 4 and p.target[0, 0] == p.target[0, -1]
    assert np.ptp(p.temperature) > 0.1
    flat_keep = p.keep_mask.reshape(-1, p.keep_mask.shape[-1])
    assert any(not flat_keep[i, p.target.reshape(-1, 4)[i, 0]] for i in range(flat_keep.shape[0]))
    assert (ext.make_ext(ext.ext_case("all_ignored_masked")).target == -100).any()


def test_row_temperature_nan_rows():
    # a temperature that is not finite and > 0 makes its row NaN, and only its row
    rng = np.random.default_rng(0)
    z = rng.normal(size=(3, 8))
    y = np.array([[1], [2], [3]])
    tau = np.array([1.0, 0.0, np.inf])
    lay = spec.ExtLayout(1, False, True)
    valid, owns, local = spec.target_to_local(np, y, 0, 8, -100)
    with np.errstate(all="ignore"):
        st = spec.ext_block_stats(np, z, local, owns, None, tau, with_sum_p2=True)
        ec = spec.ext_finalize(np, spec.ext_reduce_stats(np, st[None], lay, 0, tau), lay, tau)
        lp, h, p2 = spec.ext_outputs(np, ec, valid, tau)
    assert np.isfinite([lp[0, 0], h[0], p2[0]]).all()
    assert np.isnan(lp[1:, 0]).all() and np.isnan(h[1:]).all() and np.isnan(p2[1:]).all()
