"""The spec over column blocks: any split merges (reduce_stats) to the oracle;
the same spec runs on numpy, jax.numpy and torch; a 0-d temperature keeps the
compute dtype; the accumulation dtype is honoured."""

import numpy as np
import pytest

from dualvp import reference, simulate, spec, testing
from dualvp.testing import cases

TOL = cases.Tolerance(1e-10, 1e-12)


# The fast tier: each kept shift and each entropy form with every case, world and block; the other two
# pairings in the slow tier.
@pytest.mark.parametrize("kept_shift, entropy_terms", [
    ("kept", "select"), ("max", "clamp"),
    pytest.param("kept", "clamp", marks=pytest.mark.slow), pytest.param("max", "select", marks=pytest.mark.slow)])
@pytest.mark.parametrize("block", [1, 5, 17, 96])
@pytest.mark.parametrize("name", ["confident_lm", "nucleus", "neg_inf_masked", "random_mask_temp", "extreme_temp",
                                  "everything"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_blocks_match_oracle(name, world, block, kept_shift, entropy_terms):
    c = cases.case(name)
    c = cases.case(name, dtype="float64", vocab=96 if c.vocab <= 96 else 264, worlds=(1, 2, 4))
    prob = cases.make(c)
    lp, h, g = simulate.over_shards(
        prob.logits, prob.target, world, keep_mask=prob.keep_mask, temperature=c.temperature,
        ignore_index=c.ignore_index, grad_logprob=prob.grad_logprob, grad_entropy=prob.grad_entropy, block=block,
        kept_shift=kept_shift, entropy_terms=entropy_terms,
    )
    rlp, rh, rg = testing.oracle(prob)
    for q, x, ref in (("logprob", lp, rlp), ("entropy", h, rh), ("grad", g, rg)):
        assert cases.within_tolerance(x, ref, TOL), (q, cases.max_errors(x, ref))


def _rand(seed=0, T=6, V=40):
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(T, V)) * 4
    z[1, ::3] = -np.inf
    z[2, :10] = -np.inf  # a whole block of -inf
    y = rng.integers(0, V, size=T)
    y[3] = -100
    keep = rng.random((T, V)) < 0.3
    return z, y, keep


def test_reduce_is_associative_and_order_free():
    z, y, keep = _rand()
    valid, owns, local = spec.target_to_local(np, y, 0, 40, -100)
    edges = [0, 3, 10, 11, 25, 40]
    with np.errstate(invalid="ignore", divide="ignore"):
        blocks = [
            spec.block_stats(np, z[:, a:b], local, owns, keep[:, a:b], 0.7, start=a) for a, b in zip(edges, edges[1:])
        ]
        whole = spec.block_stats(np, z, local, owns, keep, 0.7)
        flat = spec.reduce_stats(np, np.stack(blocks), temperature=0.7)
        rev = spec.reduce_stats(np, np.stack(blocks[::-1]), temperature=0.7)
        left = blocks[0]
        for b in blocks[1:]:
            left = spec.merge_stats(np, left, b, 0.7)
        nested = spec.merge_stats(
            np, spec.reduce_stats(np, np.stack(blocks[:2]), temperature=0.7),
            spec.reduce_stats(np, np.stack(blocks[2:]), temperature=0.7), 0.7,
        )
        # the block axis may be any axis
        other = spec.reduce_stats(np, np.stack(blocks, axis=1), axis=-2, temperature=0.7)
    ref = spec.reduce_stats(np, whole[None], temperature=0.7)
    for x in (flat, rev, left, nested, other):
        fx, fr = spec.finalize(np, x, 0.7), spec.finalize(np, ref, 0.7)
        for a, b in zip(fx, fr):
            np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)


def test_temperature_array_keeps_dtype_and_accumulation():
    z, y, keep = _rand(1)
    z32 = z.astype(np.float32)
    valid, owns, local = spec.target_to_local(np, y, 0, 40, -100)
    tau = np.asarray(0.7)  # 0-d float64: must not promote float32 work
    with np.errstate(invalid="ignore", divide="ignore"):
        st = spec.block_stats(np, z32, local, owns, keep, tau, acc_dtype=np.float64)
        comb = spec.finalize(np, spec.reduce_stats(np, st[None], temperature=tau), tau)
        lp, h = spec.outputs(np, comb, valid, tau)
        ones = np.ones(6, np.float32)
        g = spec.block_grad(np, z32, local, owns, keep, comb, valid, ones, ones, tau)
        st64 = spec.block_stats(np, z32, local, owns, keep, 0.7, dtype=np.float64)
    assert st.dtype == lp.dtype == h.dtype == g.dtype == np.float32
    assert st64.dtype == np.float64
    rlp, rh = reference.logprob_entropy(z32, y, keep_mask=keep, temperature=0.7)
    assert cases.within_tolerance(lp, rlp, cases.tolerance("float32", "logprob"))
    assert cases.within_tolerance(h, rh, cases.tolerance("float32", "entropy"))


def _run(xp, asarray, z, y, keep, tau, entropy_terms="clamp", indicator="compare"):
    valid, owns, local = spec.target_to_local(xp, asarray(y), 0, 40, -100)
    zz, kk = asarray(z), asarray(keep)
    st = xp.stack([spec.block_stats(xp, zz[:, a:b], local, owns, kk[:, a:b], tau, start=a, entropy_terms=entropy_terms)
                   for a, b in ((0, 13), (13, 40))])
    comb = spec.finalize(xp, spec.reduce_stats(xp, st, temperature=tau), tau)
    lp, h = spec.outputs(xp, comb, valid, tau)
    ones = xp.ones(z.shape[:1], dtype=zz.dtype)
    concat = getattr(xp, "concat", None) or xp.concatenate  # (NumPy < 2 has no concat)
    g = concat([spec.block_grad(xp, zz[:, a:b], local, owns, kk[:, a:b], comb, valid, ones, ones, tau, start=a,
                                indicator=indicator) for a, b in ((0, 13), (13, 40))], axis=-1)
    return [np.asarray(x) for x in (lp, h, g)]


@pytest.mark.slow
@pytest.mark.parametrize("indicator", ["compare", "arith"])
@pytest.mark.parametrize("entropy_terms", ["clamp", "select"])
def test_same_spec_on_numpy_jax_torch(entropy_terms, indicator):
    z, y, keep = _rand(2)
    z[2, :] = np.random.default_rng(0).normal(size=40)  # every row finite somewhere on the kept side
    with np.errstate(invalid="ignore", divide="ignore"):
        want = _run(np, np.asarray, z, y, keep, 0.8)
    got = {}
    try:
        import jax
        import jax.numpy as jnp

        with jax.enable_x64(True):
            got["jax"] = _run(jnp, jnp.asarray, z, y, keep, jnp.asarray(0.8), entropy_terms, indicator)
    except ImportError:
        pass
    try:
        import array_api_compat.torch as txp
        import torch

        got["torch"] = _run(txp, torch.as_tensor, z, y, keep, torch.tensor(0.8, dtype=torch.float64), entropy_terms,
                            indicator)
    except ImportError:
        pass
    assert got, "neither jax nor torch is installed"
    for name, res in got.items():
        for a, b in zip(res, want):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_entropy_terms_select_and_clamp_agree(dtype):
    # "select" (0 where e^d = 0, d unclamped) and "clamp" (d clamped) are two
    # ways around 0 * -inf: banned columns, a whole banned block, a
    # temperature so small that finite (z - m) / tau overflows to -inf, and
    # exponentials that underflow. The statistics agree exactly; a row holding
    # NaN keeps NaN in m and s either way (t may differ there), so its entropy
    # is NaN under both (and its log-prob, unless a keep mask drops the NaN).
    z, y, keep = _rand(seed=5)
    z = z.astype(dtype)
    z[4, 7] = np.nan
    valid, owns, local = spec.target_to_local(np, y, 0, 40, -100)
    tiny = np.finfo(dtype).tiny * 4
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for tau in (1.0, 0.8, tiny):
            for k in (None, keep):
                for start, (a, b) in ((0, (0, 40)), (10, (10, 40))):
                    args = (np, z[:, a:b], local, owns, None if k is None else k[:, a:b], tau)
                    st = {how: spec.block_stats(*args, start=start, entropy_terms=how) for how in ("clamp", "select")}
                    ok = ~np.isnan(z[:, a:b]).any(-1)
                    np.testing.assert_array_equal(st["select"][ok], st["clamp"][ok],
                                                  err_msg=f"tau={tau} keep={k is not None}")
                    for how, x in st.items():
                        assert np.isnan(x[~ok][:, [0, 1]]).all(), (how, tau)
                        lp, h = spec.outputs(np, spec.finalize(np, x, tau), valid, tau)
                        assert np.isnan(h[~ok]).all() and (k is not None or np.isnan(lp[~ok]).all()), (how, tau)
    with pytest.raises(ValueError, match="entropy_terms"):
        spec.block_stats(np, z, local, owns, entropy_terms="where")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("block", [None, 5, 17])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_indicator_arith_and_compare_give_the_same_gradient(world, block, dtype):
    """block_grad's ``indicator``: max(1 - |v - y|, 0) in integers is the compare's 1[v = y], bit for bit.

    Every shared case (targets on other shards and blocks, ignored rows, -inf,
    keep masks, temperatures), whole shards and column blocks (5 and 17: blocks at
    non-zero starts, a partial last block; one-column blocks, three quarters of this
    test's time, add no other offset); the compare's gradient is checked against the
    oracle by test_blocks_match_oracle, one-column blocks included.
    """
    for c in cases.CASES:
        c = cases.case(c.name, dtype=dtype, vocab=96 if c.vocab <= 96 else 264, worlds=(1, 2, 4))
        prob = cases.make(c)
        kw = dict(keep_mask=prob.keep_mask, temperature=c.temperature, ignore_index=c.ignore_index,
                  grad_logprob=prob.grad_logprob, grad_entropy=prob.grad_entropy, dtype=np.dtype(dtype), block=block)
        g = {how: simulate.over_shards(prob.logits, prob.target, world, indicator=how, **kw)[2]
             for how in ("compare", "arith")}
        assert g["arith"].dtype == np.dtype(dtype)
        assert np.array_equal(g["arith"], g["compare"], equal_nan=True), c.name


def test_indicator_is_checked():
    z, y, keep = _rand()
    valid, owns, local = spec.target_to_local(np, y, 0, 40, -100)
    with np.errstate(invalid="ignore", divide="ignore"):
        comb = spec.finalize(np, spec.block_stats(np, z, local, owns), 1.0)
        with pytest.raises(ValueError, match="indicator"):
            spec.block_grad(np, z, local, owns, None, comb, valid, np.ones(6), None, indicator="where")


@pytest.mark.parametrize("kept_shift", ["kept", "max"])
def test_without_entropy_the_logprob_is_unchanged(kept_shift):
    # with_entropy=False skips t and, under a keep mask, s; the log-prob and
    # its gradient (which read neither) must equal the oracle's, blocks merged
    # as usual, and every other statistic must be the full one's.
    z, y, keep = _rand(seed=3)
    valid, owns, local = spec.target_to_local(np, y, 0, 40, -100)
    g_lp = np.linspace(0.5, 1.5, z.shape[0])
    with np.errstate(invalid="ignore", divide="ignore"):
        for k in (None, keep):
            full = spec.block_stats(np, z, local, owns, k, 0.7)
            parts = []
            for a, b in ((0, 13), (13, 40)):
                args = (np, z[:, a:b], local, owns, None if k is None else k[:, a:b], 0.7)
                part = spec.block_stats(*args, start=a, with_entropy=False, kept_shift=kept_shift)
                # rows that "max" marks are computed again with "kept", as every caller does
                redo = spec.block_stats(*args, start=a, with_entropy=False)
                parts.append(spec.redo_marked(np, part, redo))
            lean = spec.reduce_stats(np, np.stack(parts), temperature=0.7)
            assert all(np.all(b[:, spec.STATS.index("t")] == 0) for b in parts)  # (merged, it is no longer 0)
            skipped = [spec.STATS.index("t")]
            if k is not None:
                assert all(np.all(b[:, spec.STATS.index("s")] == 1) for b in parts)
                skipped.append(spec.STATS.index("s"))
            comb = spec.finalize(np, lean, 0.7)
            lp, _ = spec.outputs(np, comb, valid, 0.7)
            rlp, _ = reference.logprob_entropy(z, y, keep_mask=k, temperature=0.7)
            assert cases.within_tolerance(lp, rlp, TOL)
            g = spec.block_grad(np, z, local, owns, k, comb, valid, g_lp, None, 0.7)
            rg = reference.logprob_entropy_grad(z, y, g_lp, None, keep_mask=k, temperature=0.7)
            assert cases.within_tolerance(g, rg, TOL)
            if k is not None and kept_shift == "max":
                # (mk, sk) shifted by the overall max: the same pair as the full one's up to its
                # shift, which the log-prob and gradient above check
                skipped += [spec.STATS.index("mk"), spec.STATS.index("sk")]
            assert np.allclose(np.delete(lean, skipped, axis=1), np.delete(full, skipped, axis=1), rtol=1e-12, atol=0,
                               equal_nan=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kept_shift_max_marks_exactly_the_far_rows(dtype):
    # kept_shift="max" sums the kept exponentials shifted by the overall max:
    # its (shift, sum) pair must finalize to the same outputs as the kept
    # max's, and it must mark (sk = NaN) exactly the rows whose kept sum,
    # shifted by the overall max, is below e^-KEPT_GAP (computed here in
    # float64 from the kept max's terms): only rows whose kept max lies more
    # than KEPT_GAP temperature units below the overall max, and every row
    # more than KEPT_GAP + ln V below (gap 120: every float32 kept e^d is 0).
    tau = 0.5
    z, y, keep = _rand(seed=4, T=9)
    z[:, 0] = 30.0  # the overall max, dropped by the mask (the targets are elsewhere)
    keep[:, 0] = False
    y = np.where(y == 0, 1, y)
    V = z.shape[1]
    # row 4: far below; row 5: just beyond KEPT_GAP + ln V; row 6: just inside KEPT_GAP;
    # row 8: beyond KEPT_GAP with its kept columns at the cap, whose sum is then >= e^-KEPT_GAP
    gaps = {4: 120.0, 5: spec.KEPT_GAP + np.log(V) + 1.0, 6: spec.KEPT_GAP - 1.0, 8: spec.KEPT_GAP + 1.0}
    for r, gap in gaps.items():
        z[r, 1:] = np.minimum(z[r, 1:], 30.0 - tau * gap)
    z[8, 1:] = 30.0 - tau * gaps[8]
    keep[8, 1:] = True
    z[7, 5:] = -np.inf
    keep[7] = False  # nothing kept: the target alone (not a marked row) ...
    y[7] = 2
    z[7, 2] = 30.0 - 200.0 * tau  # ... 200 tau below the max (must not underflow: L = 0)
    z = z.astype(dtype)
    valid, owns, local = spec.target_to_local(np, y, 0, V, -100)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        kept = spec.block_stats(np, z, local, owns, keep, tau)
        fast = spec.block_stats(np, z, local, owns, keep, tau, kept_shift="max")
        marked = spec.marked_rows(np, fast)
        z64 = z.astype(np.float64)
        kmax = np.max(np.where(keep, z64, -np.inf), axis=-1)
        gap = (z64.max(-1) - kmax) / tau
        sk64 = np.sum(np.where(keep, np.exp((z64 - z64.max(-1, keepdims=True)) / tau), 0.0), axis=-1)
        assert marked.tolist() == ((sk64 < np.exp(-spec.KEPT_GAP)) & np.isfinite(kmax)).tolist()
        some = np.isfinite(kmax)  # the kept pair's shift is the overall max (else the dropped target's logit)
        assert np.all(gap[marked] > spec.KEPT_GAP) and np.all(marked[(gap > spec.KEPT_GAP + np.log(V)) & some])
        assert marked[4] and marked[5] and not marked[6] and not marked[7] and not marked[8]
        assert np.all(fast[some, spec.STATS.index("mk")] == z.max(-1)[some]) and not some[7]
        # the unmarked rows agree with the kept max's statistics after finalizing
        ok = ~marked & valid
        fk, ff = spec.finalize(np, kept, tau), spec.finalize(np, fast, tau)
        lk, hk = spec.outputs(np, fk, valid, tau)
        lf, hf = spec.outputs(np, ff, valid, tau)
        tol = cases.tolerance(np.dtype(dtype).name, "logprob")
        assert cases.within_tolerance(lf[ok], lk[ok], tol)
        # (not bit-equal: "kept" forms e^d on kept columns as e^(d_k) times a
        # factor, so s differs in the last bits, by numpy's exp and version)
        assert cases.within_tolerance(hf, hk, cases.tolerance(np.dtype(dtype).name, "entropy"))
        g = [spec.block_grad(np, z, local, owns, keep, c, valid, np.ones(9, dtype), np.ones(9, dtype), tau)
             for c in (fk, ff)]
        assert cases.within_tolerance(g[1][ok], g[0][ok], cases.tolerance(np.dtype(dtype).name, "grad"))
    rlp, _ = reference.logprob_entropy(z, y, keep_mask=keep, temperature=tau)
    assert np.isfinite(rlp[4]) and cases.within_tolerance(lk[ok], rlp[ok], tol)
    assert rlp[7] == 0 and lf[7] == 0


@pytest.mark.parametrize("with_mask", [False, True])
def test_temperature_number_one_is_the_array_one(with_mask):
    # The number 1 skips the block-sized divisions (spec._over_tau; the torch
    # eager path passes it), an array holding 1 divides: the same bits.
    z, y, keep = _rand(seed=5)
    z = z.astype(np.float32)
    keep = keep if with_mask else None
    valid, owns, local = spec.target_to_local(np, y, 0, 40, -100)
    one = np.asarray(1.0, dtype=np.float32)
    ones = np.ones(6, np.float32)
    out = []
    with np.errstate(invalid="ignore", divide="ignore"):
        for tau in (1, one):
            st = spec.block_stats(np, z, local, owns, keep, tau)
            comb = spec.finalize(np, spec.reduce_stats(np, st[None], temperature=tau), tau)
            out.append([st, *spec.outputs(np, comb, valid, tau),
                        spec.block_grad(np, z, local, owns, keep, comb, valid, ones, ones, tau)])
    for a, b in zip(*out):
        assert a.dtype == b.dtype == np.float32 and np.array_equal(a, b, equal_nan=True)
