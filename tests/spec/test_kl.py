"""The KL divergence's math (dualvp.kl_spec) against its float64 oracle (dualvp.kl_reference).

The spec runs here with NumPy as ``xp``, shard by shard (W = 1, 2, 4, 8) and
combined in one round, exactly as the backends do; the oracle is the textbook
formula on the whole vocabulary. The oracle's closed-form gradients are checked
against central differences of its own value, so both sides are judged.
"""

import numpy as np
import pytest

from dualvp import kl_reference, kl_spec
from dualvp.testing import TOLERANCES
from dualvp.testing.kl import KL_CASES, kl_failures, make_kl, run_spec


def spec_kl(problem, world: int, dtype=np.float64):
    return run_spec(problem, world, dtype)


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_spec_shards_match_oracle_float64(world):
    fails = []
    for case in KL_CASES:
        p = make_kl(case, dtype="float64")
        fails += kl_failures(p, spec_kl(p, world), f"W={world} ")
    assert not fails, "\n".join(fails)


@pytest.mark.parametrize("world", [1, 8])
def test_spec_shards_match_oracle_float32_compute(world):
    # float32 compute on float32 / bfloat16-rounded inputs: the backends' precision class
    fails = []
    for case in KL_CASES:
        p = make_kl(case)
        fails += kl_failures(p, spec_kl(p, world, np.float32), f"W={world} ")
    assert not fails, "\n".join(fails)


def test_block_merge_is_associative():
    # blocks of a shard merge like shards: ((0,1),(2,3)) == (0,1,2,3)
    p = make_kl(KL_CASES[1], dtype="float64")
    blocks = np.split(p.logits, 4, axis=-1), np.split(p.ref_logits, 4, axis=-1)
    with np.errstate(all="ignore"):
        st = np.stack([kl_spec.block_stats(np, a, b, 0.7) for a, b in zip(*blocks)])
        flat = kl_spec.finalize(np, kl_spec.merge_stats(np, st, 0.7))
        pairs = np.stack([kl_spec.merge_stats(np, st[:2], 0.7), kl_spec.merge_stats(np, st[2:], 0.7)])
        nested = kl_spec.finalize(np, kl_spec.merge_stats(np, pairs, 0.7))
    np.testing.assert_allclose(nested.kl, flat.kl, rtol=1e-13, atol=1e-13)


def test_infinite_and_banned_semantics():
    # p_v = 0 terms contribute 0; p_v > 0 with q_v = 0 gives +inf
    z = np.array([[0.0, 1.0, -np.inf, 2.0]])
    r = np.array([[0.5, 0.0, 3.0, 1.0]])
    lp = z - np.log(np.sum(np.exp(z[np.isfinite(z)])))
    lq = r - np.log(np.sum(np.exp(r)))
    expect = sum(np.exp(lp[0, v]) * (lp[0, v] - lq[0, v]) for v in (0, 1, 3))
    np.testing.assert_allclose(kl_reference.kl_divergence(z, r), [expect], rtol=1e-14)
    assert np.isinf(kl_reference.kl_divergence(z, r, direction="reverse")[0])
    with np.errstate(all="ignore"):
        for world in (1, 2, 4):
            a, b = np.split(z, world, -1), np.split(r, world, -1)
            comb = kl_spec.combine_stats(np, np.stack([kl_spec.block_stats(np, x, y) for x, y in zip(a, b)]))
            np.testing.assert_allclose(comb.kl, [expect], rtol=1e-14)
            comb = kl_spec.combine_stats(np, np.stack([kl_spec.block_stats(np, y, x) for x, y in zip(a, b)]))
            assert comb.kl[0] == np.inf


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_oracle_gradient_is_the_derivative(direction):
    rng = np.random.default_rng(0)
    z, r = rng.normal(0, 2, (3, 11)), rng.normal(0, 2, (3, 11))
    z[0, 4] = r[0, 4] = -np.inf  # banned in both
    g = rng.normal(size=3)
    tau, h = 0.8, 1e-6
    f = lambda zz, rr: np.sum(g * kl_reference.kl_divergence(zz, rr, temperature=tau, direction=direction))  # noqa
    dz, dr = kl_reference.kl_divergence_grad(z, r, g, temperature=tau, direction=direction)
    for x, d, first in ((z, dz, True), (r, dr, False)):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            if not np.isfinite(x[idx]):
                continue
            xp_, xm = x.copy(), x.copy()
            xp_[idx] += h
            xm[idx] -= h
            num[idx] = (f(xp_, r) - f(xm, r)) / (2 * h) if first else (f(z, xp_) - f(z, xm)) / (2 * h)
        np.testing.assert_allclose(d, num, atol=1e-7)


def test_shifted_form_keeps_precision_at_large_offsets():
    # the textbook sum p (a - b)/tau - lse + lse in float32 loses |a/tau| eps ~ 1e-3 here; the spec must not
    p = make_kl(KL_CASES[7])  # offsets 1e4 / -5e3 at tau 0.3
    kl32 = spec_kl(p, 4, np.float32)[0]
    ref = kl_reference.kl_divergence(p.logits, p.ref_logits, temperature=0.3)
    tol = TOLERANCES["float32"]["kl"]
    assert np.all(np.abs(kl32 - ref) <= tol.atol + tol.rtol * np.abs(ref))
    u, w = (p.logits / 0.3).astype(np.float32), (p.ref_logits / 0.3).astype(np.float32)
    lse = lambda x: x.max(-1) + np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1))  # noqa: E731
    pp = np.exp(u - lse(u)[..., None])
    naive = (pp * (u - w)).sum(-1) - lse(u) + lse(w)
    assert np.max(np.abs(naive - ref)) > 10 * np.max(np.abs(kl32 - ref))  # the test can tell the two apart
