"""Transformations, meshes, options and the non-finite / validation policy of dualvp_jax."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import dualvp_jax  # noqa: E402
from dualvp import reference  # noqa: E402
from dualvp.testing import cases  # noqa: E402
from ._helpers import (  # noqa: E402
    check_close, inputs, mesh_1d, mesh_2d, reference_of, sharded_runner,
)


@pytest.mark.slow
def test_jit_and_eager_agree():
    prob = cases.make(cases.case("random_mask_temp"))
    z, y, k, gl, ge = inputs(prob)
    args = (z, y, k, gl, ge)
    eager = sharded_runner(4, "explicit", 0.7, -100, True, jit=False)(*args)
    jitted = sharded_runner(4, "explicit", 0.7, -100, True, jit=True)(*args)
    for a, b in zip(eager, jitted):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_vmap_over_batch(kind):
    """vmap of value and gradient over a leading batch dim == per-example calls."""
    probs = [cases.make(cases.case("nucleus", seed=s)) for s in (1, 2, 3)]
    z = jnp.stack([inputs(p)[0] for p in probs])
    y = jnp.stack([inputs(p)[1] for p in probs])
    k = jnp.stack([inputs(p)[2] for p in probs])
    mesh = mesh_1d(4, kind)

    def loss(z, y, k):
        lp, h = dualvp_jax.sharded_logprob_entropy(z, y, mesh, "tp", keep_mask=k, temperature=0.9)
        return jnp.sum(lp) + 0.5 * jnp.sum(h), (lp, h)

    (_, (lp, h)), g = jax.jit(jax.vmap(jax.value_and_grad(loss, has_aux=True)))(z, y, k)
    for i, p in enumerate(probs):
        kw = dict(keep_mask=p.keep_mask, temperature=0.9)
        r_lp, r_h = reference.logprob_entropy(p.logits, p.target, **kw)
        r_g = reference.logprob_entropy_grad(p.logits, p.target, np.ones(6), 0.5 * np.ones(6), **kw)
        check_close("vmap", lp[i], r_lp, "float32", "logprob")
        check_close("vmap", h[i], r_h, "float32", "entropy")
        check_close("vmap", g[i], r_g, "float32", "grad")
    # the unsharded API under vmap too
    lp1, h1 = jax.vmap(lambda z, y, k: dualvp_jax.logprob_entropy(z, y, keep_mask=k, temperature=0.9))(z, y, k)
    np.testing.assert_allclose(np.asarray(lp1), np.asarray(lp), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_2d_mesh_data_parallel(kind):
    """Tokens split over "dp", vocab over "tp": outputs sharded over dp, exact values and gradients."""
    case = cases.case("confident_lm_bf16", lead=(8,))
    prob = cases.make(case)
    ref_lp, ref_h, ref_g = reference_of(prob)
    mesh = mesh_2d(2, 4, kind)
    z, y, k, gl, ge = inputs(prob)
    z = jax.device_put(z, NamedSharding(mesh, P("dp", "tp")))
    y = jax.device_put(y, NamedSharding(mesh, P("dp")))
    k = jax.device_put(k, NamedSharding(mesh, P("dp", "tp")))

    @jax.jit
    def run(z, y, k, gl, ge):
        f = lambda z: dualvp_jax.sharded_logprob_entropy(z, y, mesh, "tp", keep_mask=k)  # noqa: E731
        (lp, h), vjp = jax.vjp(f, z)
        return lp, h, vjp((gl, ge))[0]

    lp, h, g = run(z, y, k, gl, ge)
    assert lp.sharding.spec[0] == "dp" and g.sharding.spec == P("dp", "tp")
    assert g.dtype == jnp.bfloat16
    check_close("2d", lp, ref_lp, "bfloat16", "logprob")
    check_close("2d", h, ref_h, "bfloat16", "entropy")
    check_close("2d", g, ref_g, "bfloat16", "grad")


# Each (policy, op) once, W alternating: each op and each policy both unsharded and sharded.
_REMAT = [(2, "nothing_saveable", "logits"), (1, "dots_saveable", "logits"), (1, "nothing_saveable", "linear"),
          (2, "dots_saveable", "linear")]


@pytest.mark.slow
@pytest.mark.parametrize("world,policy,op", _REMAT, ids=["-".join(map(str, r)) for r in _REMAT])
def test_under_remat(world, policy, op):
    """Inside ``jax.checkpoint`` (rematerialisation, as LLM training wraps its layers): the LM head's matmul and
    the op (or the fused op) recomputed in the backward give the same values and gradients, bit for bit, as
    without it; for the logits op also the oracle's (the gradients checked against the float64 chain rule
    through the logits gradient)."""
    prob = cases.make(cases.case("random_mask_temp"))
    _, y, k, gl, ge = inputs(prob)
    v = prob.logits.shape[-1]
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal(prob.target.shape + (8,)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((v, 8)) * 0.7, jnp.float32)
    mesh = mesh_1d(world)

    def head(h, w, y, k):
        kw = dict(keep_mask=k, temperature=0.7)
        if op == "linear":  # no logits at all
            if world == 1:
                return dualvp_jax.linear_logprob_entropy(h, w, y, **kw), None
            return dualvp_jax.sharded_linear_logprob_entropy(h, w, y, mesh, "tp", **kw), None
        z = h @ w.T
        if world == 1:
            return dualvp_jax.logprob_entropy(z, y, **kw), z
        return dualvp_jax.sharded_logprob_entropy(z, y, mesh, "tp", **kw), z

    # target, mask and cotangents arguments: closed over, they would be constants that XLA folds
    def loss(h, w, remat, y, k, gl, ge):
        f = jax.checkpoint(head, policy=getattr(jax.checkpoint_policies, policy)) if remat else head
        (lp, ent), z = f(h, w, y, k)
        return jnp.sum(gl * lp) + jnp.sum(ge * ent), (lp, ent, z)

    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
    rest = (y, k, gl, ge)
    # the op's forward (its row maxima) is in the program twice under remat: recomputed for the backward
    maxima = [str(jax.make_jaxpr(run, static_argnums=2)(h, w, r, *rest)).count("reduce_max") for r in (False, True)]
    assert maxima[1] == 2 * maxima[0] > 0, maxima
    (val, (lp, ent, z)), (dh, dw) = run(h, w, True, *rest)
    (val0, (lp0, ent0, _)), (dh0, dw0) = run(h, w, False, *rest)
    for a, b in ((val, val0), (lp, lp0), (ent, ent0), (dh, dh0), (dw, dw0)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if op == "linear":  # (the fused op against the oracle: tests/jax/test_linear.py)
        return
    # against float64: the op's gradient w.r.t. the (float32) logits, chained through the matmul
    zf = np.asarray(z, np.float64)
    r_lp, r_h = reference.logprob_entropy(zf, prob.target, keep_mask=prob.keep_mask, temperature=0.7)
    r_gz = reference.logprob_entropy_grad(zf, prob.target, np.asarray(gl, np.float64), np.asarray(ge, np.float64),
                                          keep_mask=prob.keep_mask, temperature=0.7)
    check_close("remat", lp, r_lp, "float32", "logprob")
    check_close("remat", ent, r_h, "float32", "entropy")
    r_dh = r_gz @ np.asarray(w, np.float64)
    r_dw = r_gz.reshape(-1, v).T @ np.asarray(h, np.float64).reshape(-1, h.shape[-1])
    for name, got, want in (("dh", dh, r_dh), ("dw", dw, r_dw)):  # the tolerance scaled as the fused-op tests do
        scale = max(1.0, float(np.abs(want).max()))
        check_close(f"remat {name}", np.asarray(got) / scale, want / scale, "float32", "grad")


@pytest.mark.slow
def test_entropy_grad_false_stops_gradient_and_with_entropy_false():
    prob = cases.make(cases.case("basic"))
    z, y, _, _, _ = inputs(prob)
    mesh = mesh_1d(2, "explicit")
    # eager (un-jitted) grad of explicitly sharded values needs the mesh as context, as for any JAX op
    with jax.set_mesh(mesh):
        _check_entropy_options(mesh, z, y)


def _check_entropy_options(mesh, z, y):
    f = lambda z, **kw: dualvp_jax.sharded_logprob_entropy(z, y, mesh, "tp", **kw)  # noqa: E731
    g_h = jax.grad(lambda z: jnp.sum(f(z, entropy_grad=False)[1]))(z)
    assert np.all(np.asarray(g_h) == 0)
    g_both = jax.grad(lambda z: jnp.sum(sum(f(z, entropy_grad=False))))(z)
    g_lp = jax.grad(lambda z: jnp.sum(f(z)[0]))(z)
    np.testing.assert_allclose(np.asarray(g_both), np.asarray(g_lp), rtol=1e-6, atol=1e-7)
    lp, h = f(z, with_entropy=False)
    assert h is None and lp.shape == y.shape
    lp, h = dualvp_jax.logprob_entropy(z, y, with_entropy=False)
    assert h is None
    # entropy_grad=False: the entropy value is unchanged
    np.testing.assert_array_equal(np.asarray(f(z, entropy_grad=False)[1]), np.asarray(f(z)[1]))


# --- non-finite values ---------------------------------------------------------------------


def _nonfinite_problem():
    rng = np.random.default_rng(0)
    z = rng.normal(0, 2, size=(6, 16)).astype(np.float32)
    y = np.array([1, 2, 3, 4, 5, 6])
    z[1, 7] = np.nan           # NaN row
    z[2, 3] = np.inf           # +inf row
    z[3, :8] = -np.inf         # a whole shard of -inf (W=2): legal
    z[4, 5] = -np.inf          # target at -inf: log-prob -inf, finite gradient
    z[5, :] = -np.inf          # no finite logit: no distribution, NaN
    return z, y


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_nonfinite_policy_row_by_row(world):
    z, y = _nonfinite_problem()
    y = y.copy()
    y[3] = 9  # keep the target of the -inf-shard row finite
    mesh = mesh_1d(world, "auto")

    def loss(z):
        lp, h = dualvp_jax.sharded_logprob_entropy(z, jnp.asarray(y), mesh, "tp")
        return jnp.sum(jnp.where(jnp.isfinite(lp), lp, 0.0)) + jnp.sum(jnp.where(jnp.isfinite(h), h, 0.0)), (lp, h)

    (_, (lp, h)), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(jnp.asarray(z))
    lp, h, g = np.asarray(lp), np.asarray(h), np.asarray(g)
    ref_lp, ref_h = reference.logprob_entropy(z, y)
    assert np.isfinite(lp[[0, 3]]).all() and np.isfinite(h[[0, 3, 4]]).all()
    np.testing.assert_allclose(lp[[0, 3]], ref_lp[[0, 3]], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(h[[0, 3, 4]], ref_h[[0, 3, 4]], rtol=2e-5, atol=2e-5)
    assert np.isnan(lp[1]) and np.isnan(h[1]) and np.isnan(g[1]).all()
    assert np.isnan(lp[2]) and np.isnan(h[2]) and np.isnan(g[2]).all()
    assert lp[4] == -np.inf and np.isfinite(g[4]).all()
    assert np.isnan(lp[5])
    assert np.isfinite(g[[0, 3, 4]]).all()


def test_out_of_range_target_traced_gives_nan_rows_concrete_raises():
    z = jnp.asarray(np.random.default_rng(1).normal(size=(4, 8)).astype(np.float32))
    y = jnp.asarray([0, 8, -1, -100])
    mesh = mesh_1d(2, "auto")
    lp, h = jax.jit(lambda z, y: dualvp_jax.sharded_logprob_entropy(z, y, mesh, "tp"))(z, y)
    assert np.isfinite(np.asarray(lp)[[0, 3]]).all() and np.isnan(np.asarray(lp)[[1, 2]]).all()
    # y is an argument of the jitted function (traced); a closed-over y would be concrete and raise
    g = jax.jit(jax.grad(lambda z, y: jnp.sum(dualvp_jax.logprob_entropy(z, y)[0])))(z, y)
    assert np.isnan(np.asarray(g)[[1, 2]]).all() and np.isfinite(np.asarray(g)[[0, 3]]).all()
    with pytest.raises(ValueError, match="target:"):
        dualvp_jax.sharded_logprob_entropy(z, y, mesh, "tp")
    with pytest.raises(ValueError, match="target:"):
        dualvp_jax.logprob_entropy(z, y)


def test_validate_false_skips_the_range_check_and_gives_nan_rows():
    """``validate=False``: no host check (no synchronisation); out-of-range rows are NaN, as when traced."""
    z = jnp.asarray(np.random.default_rng(2).normal(size=(4, 8)).astype(np.float32))
    y = jnp.asarray([0, 8, -1, -100])
    ref_lp, _ = reference.logprob_entropy(np.asarray(z, np.float64), np.asarray([0, 0, 0, -100]))
    for lp, h in (dualvp_jax.sharded_logprob_entropy(z, y, mesh_1d(2, "auto"), "tp", validate=False),
                  dualvp_jax.logprob_entropy(z, y, validate=False)):
        lp, h = np.asarray(lp), np.asarray(h)
        assert np.isnan(lp[[1, 2]]).all() and np.isnan(h[[1, 2]]).all()
        np.testing.assert_allclose(lp[[0, 3]], ref_lp[[0, 3]], rtol=2e-5, atol=2e-5)
    w = jnp.asarray(np.random.default_rng(3).normal(size=(8, 5)).astype(np.float32))
    hid = jnp.asarray(np.random.default_rng(4).normal(size=(4, 5)).astype(np.float32))
    lp, _ = dualvp_jax.linear_logprob_entropy(hid, w, y, validate=False)
    assert np.isnan(np.asarray(lp)[[1, 2]]).all() and np.isfinite(np.asarray(lp)[[0, 3]]).all()
    with pytest.raises(ValueError, match="target:"):
        dualvp_jax.linear_logprob_entropy(hid, w, y)
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match="validate:"):
            dualvp_jax.sharded_logprob_entropy(z, y, mesh_1d(2, "auto"), "tp", validate=bad)
        with pytest.raises(TypeError, match="validate:"):
            dualvp_jax.linear_logprob_entropy(hid, w, y, validate=bad)


def test_one_process_needs_no_agreement():
    """With one JAX process every call is local: no agreement, no coordinator (the multi-process
    behaviour is tests/jax/test_multiprocess.py)."""
    from dualvp_jax import multiprocess

    mesh = mesh_1d(2, "explicit")
    z = jax.device_put(jnp.zeros((4, 8), jnp.float32), NamedSharding(mesh, P(None, "tp")))
    assert multiprocess.processes_of(z, mesh=mesh) == (0,)
    y = jax.device_put(jnp.asarray([0, 9, 3, 12]), NamedSharding(mesh, P("tp")))
    # a target sharded over devices: its shards are read once each; bad ids 9 and 12 (V = 8)
    assert multiprocess.count_bad_targets(y, 8, -100) == (2, [9, 12])
    assert multiprocess.count_bad_targets(np.asarray([[-100, 8], [-3, 7]]), 8, -100) == (2, [-3, 8])


# --- validation through the global-array API (the shared bad-input table: tests/cross/test_bad_inputs.py)


@pytest.mark.slow
def test_bad_mesh_arguments():
    z = jnp.zeros((4, 6), jnp.float32)
    y = jnp.zeros((4,), jnp.int32)
    with pytest.raises(ValueError, match="logits:.*divisible"):
        dualvp_jax.sharded_logprob_entropy(z, y, mesh_1d(4, "auto"), "tp")
    with pytest.raises(ValueError, match="vocab_axis:"):
        dualvp_jax.sharded_logprob_entropy(z, y, mesh_1d(2, "auto"), "model")
    with pytest.raises(TypeError, match="mesh:"):
        dualvp_jax.sharded_logprob_entropy(z, y, "tp")
    # a traced temperature is a temperature tensor (broadcast to the rows), not an error
    lp, _ = jax.jit(lambda z, y, t: dualvp_jax.logprob_entropy(z, y, temperature=t))(z, y, 2.0)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(dualvp_jax.logprob_entropy(z, y, temperature=2.0)[0]))
    with pytest.raises(TypeError, match="temperature:"):
        jax.jit(lambda t: dualvp_jax.logprob_entropy(z, y, temperature=t))(jnp.ones(4, jnp.int32))


def test_validation_happens_at_trace_time():
    """A bad shape raises while tracing, inside jit and inside shard_map."""
    mesh = mesh_1d(2, "auto")

    def body(z, y):
        return dualvp_jax.logprob_entropy(z, y[:, None], axis_name="tp")

    z = jnp.zeros((4, 8), jnp.float32)
    y = jnp.zeros((4,), jnp.int32)
    with pytest.raises(ValueError, match="target:"):
        jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P(None)), out_specs=(P(None), P(None))))(z, y)


@pytest.mark.parametrize("kind", ["explicit", pytest.param("auto", marks=pytest.mark.slow)])
def test_one_collective_forward_none_backward(kind):
    """Forward: one all-gather of O(T) statistics; backward: no collective; no pmax/psum anywhere."""
    mesh = mesh_1d(4, kind)
    z = jax.device_put(jnp.zeros((6, 64), jnp.float32), NamedSharding(mesh, P(None, "tp")))
    y = jnp.zeros((6,), jnp.int32)
    k = jnp.ones((6, 64), bool)

    def loss(z, y, k):
        lp, h = dualvp_jax.sharded_logprob_entropy(z, y, mesh, "tp", keep_mask=k, temperature=0.5)
        return jnp.sum(lp) + jnp.sum(h)

    import re

    fwd = str(jax.make_jaxpr(loss)(z, y, k))
    both = str(jax.make_jaxpr(jax.grad(loss))(z, y, k))
    gathers = re.findall(r"(\w+\[\d+,6,6\]) = (all_gather\w*)\[", both)
    assert gathers == [("f32[4,6,6]", "all_gather_invariant")], both  # the [W, T, 6] statistics table
    assert len(re.findall(r"= all_gather\w*\[", fwd)) == 1, fwd
    for name in ("psum", "pmax", "pmin", "ppermute", "all_to_all", "reduce_scatter"):
        assert f"= {name}" not in both, both


def test_check_vma_off_is_refused():
    """With check_vma=False the replicated outputs' gradients would be 1/W too small: raise instead."""
    mesh = mesh_1d(4, "auto")
    z = jnp.zeros((3, 16), jnp.float32)
    y = jnp.zeros((3,), jnp.int32)
    body = lambda z, y: dualvp_jax.logprob_entropy(z, y, axis_name="tp")  # noqa: E731
    sm = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P()), out_specs=(P(), P()), check_vma=False)
    with pytest.raises(ValueError, match="axis_name:.*check_vma"):
        jax.jit(sm)(z, y)
