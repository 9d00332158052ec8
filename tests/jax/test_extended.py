"""dualvp_jax with K targets per row, a per-row temperature and sum p^2, against the float64 oracle
(:data:`dualvp.testing.extended.EXT_CASES`), with one collective round whatever K."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import dualvp_jax  # noqa: E402
from dualvp.testing import extended as ext  # noqa: E402
from ._helpers import JNP_DTYPES, mesh_1d, put, x64_for  # noqa: E402


def _run(prob: ext.ExtProblem, world: int, kind: str = "explicit") -> ext.ExtOutputs:
    """The global-array API on a W-device mesh: outputs and the gradient of the oracle's loss."""
    c = prob.case
    dt = JNP_DTYPES[c.dtype]
    cdt = jnp.float64 if c.dtype == "float64" else jnp.float32
    # converted on the host (jnp.asarray / astype would compile a program per shape and dtype)
    z = put(prob.logits if c.dtype == "float64" else prob.logits.astype(np.float32), dt)
    y = put(prob.target)
    keep = None if prob.keep_mask is None else put(prob.keep_mask)
    tau = put(prob.temperature, cdt) if c.row_temperature else prob.temperature
    mesh = mesh_1d(world, kind)

    @jax.jit
    def run(z, y, keep, tau, gl, ge, gs):
        def f(z):
            out = dualvp_jax.sharded_logprob_entropy(z, y, mesh, "tp", keep_mask=keep, temperature=tau,
                                                     ignore_index=c.ignore_index, multi_target=c.targets > 0,
                                                     with_sum_p2=c.sum_p2)
            return out if c.sum_p2 else out + (jnp.zeros_like(out[1]),)

        (lp, h, p2), vjp = jax.vjp(f, z)
        (g,) = vjp((gl, ge, gs))
        return lp, h, g, p2

    gs = put(prob.grad_sum_p2 if c.sum_p2 else np.zeros(prob.target.shape[:len(prob.grad_entropy.shape)]), cdt)
    lp, h, g, p2 = run(z, y, keep, tau, put(prob.grad_logprob, cdt), put(prob.grad_entropy, cdt), gs)

    def f64(a):
        return np.asarray(a).astype(np.float64)  # exact from any float dtype
    return ext.ExtOutputs(f64(lp), f64(h), f64(g), f64(p2) if c.sum_p2 else None)


def _check(case, world, kind="explicit"):
    prob = ext.make_ext(case)
    with x64_for(case.dtype):
        bad = ext.ext_failures(prob, _run(prob, world, kind))
    assert not bad, (case.name, world, bad)


_FAST = [("all_basic", 2), ("all_drop_target", 4), ("all_bfloat16", 2), ("k1", 1), ("row_tau_masked", 8)]
# The fast tier: every option at once, sharded (all_basic, W = 2), and one option unsharded (k1); the
# rest of the sample (a mask, bfloat16, W = 4 and 8) is slow.
_FAST_TIER = {("all_basic", 2), ("k1", 1)}


@pytest.mark.parametrize("name,world", [pytest.param(n, w, id=f"{n}-W{w}",
                                                     marks=() if (n, w) in _FAST_TIER else pytest.mark.slow)
                                        for n, w in _FAST])
def test_extended_vs_oracle(name, world):
    _check(ext.ext_case(name), world)


def _slow_worlds(i, c):
    """Every W for all_basic; every other case once, at W = 1 or the largest alternating over the table
    (each option, alone and masked, and every option on the shared cases, at both)."""
    if c.name == "all_basic":
        return c.worlds
    return (1,) if i % 2 else (max(c.worlds),)


_SLOW = [pytest.param(c, w, id=f"{c.name}-W{w}") for i, c in enumerate(ext.EXT_CASES) for w in _slow_worlds(i, c)
         if (c.name, w) not in _FAST]


@pytest.mark.slow
@pytest.mark.parametrize("case,world", _SLOW)
def test_extended_vs_oracle_all(case, world):
    _check(case, world, "auto" if world == 4 else "explicit")


def _collectives(jaxpr) -> dict:
    """Counts of the collective primitives in a jaxpr, sub-jaxprs included."""
    counts: dict = {}

    def walk(jp):
        for eqn in jp.eqns:
            name = eqn.primitive.name
            if name in ("all_gather", "psum", "pmax", "pmin", "ppermute", "all_to_all", "reduce_scatter",
                        "psum_scatter", "all_gather_invariant"):
                counts[name] = counts.get(name, 0) + 1
            for v in eqn.params.values():
                for sub in (v if isinstance(v, (list, tuple)) else (v,)):
                    if hasattr(sub, "jaxpr"):
                        walk(sub.jaxpr if hasattr(sub.jaxpr, "eqns") else sub.jaxpr.jaxpr)
                    elif hasattr(sub, "eqns"):
                        walk(sub)

    walk(jaxpr.jaxpr)
    return counts


@pytest.mark.parametrize("k", [1, 8])
def test_one_collective_round_whatever_k(k):
    # forward and backward of the per-shard op with every option on: one all_gather, nothing else
    world, t, v = 4, 6, 32
    mesh = mesh_1d(world, "auto")
    rng = np.random.default_rng(0)
    z = jnp.asarray(rng.normal(size=(t, v)), jnp.float32)
    y = jnp.asarray(rng.integers(0, v, size=(t, k)))
    keep = jnp.asarray(rng.random((t, v)) < 0.5)
    tau = jnp.asarray(rng.uniform(0.5, 2.0, size=t), jnp.float32)

    def body(z, y, keep, tau):
        lp, h, p2 = dualvp_jax.logprob_entropy(z, y, axis_name="tp", keep_mask=keep, temperature=tau,
                                               multi_target=True, with_sum_p2=True)
        return jnp.sum(lp) + jnp.sum(h) + jnp.sum(p2)

    def loss(z):
        # the op's outputs are invariant over "tp": the loss is returned replicated, no psum of the caller's
        f = jax.shard_map(body, mesh=mesh,
                          in_specs=(P(None, "tp"), P(), P(None, "tp"), P()), out_specs=P(), check_vma=True)
        return f(z, y, keep, tau)

    fwd = _collectives(jax.make_jaxpr(loss)(z))
    both = _collectives(jax.make_jaxpr(jax.grad(loss))(z))
    # all_gather(..., to="invarying") appears as all_gather_invariant
    assert fwd == {"all_gather_invariant": 1}, fwd
    assert both == {"all_gather_invariant": 1}, both


@pytest.mark.slow
def test_temperature_tensor_is_a_constant():
    rng = np.random.default_rng(1)
    z = jnp.asarray(rng.normal(size=(5, 16)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 16, size=(5, 2)))
    tau = jnp.asarray(rng.uniform(0.5, 2.0, size=5), jnp.float32)
    g_tau = jax.grad(lambda t: jnp.sum(dualvp_jax.logprob_entropy(z, y, temperature=t, multi_target=True)[0]))(tau)
    assert np.all(np.asarray(g_tau) == 0)
    # and the values do depend on the temperature tensor: row i at tau_i equals a scalar call at tau_i
    # (a row past the first: neither the first row's temperature used for all, nor one for the batch)
    lp = dualvp_jax.logprob_entropy(z, y, temperature=tau, multi_target=True)[0]
    lp3 = dualvp_jax.logprob_entropy(z[3:4], y[3:4], temperature=float(tau[3]), multi_target=True)[0]
    np.testing.assert_allclose(np.asarray(lp[3]), np.asarray(lp3[0]), rtol=1e-6, atol=1e-6)


def test_traced_bad_temperature_gives_nan_rows():
    z = jnp.zeros((3, 8), jnp.float32)
    y = jnp.asarray([1, 2, 3])
    tau = jnp.asarray([1.0, 0.0, -1.0])
    lp, h = jax.jit(lambda z, y, t: dualvp_jax.logprob_entropy(z, y, temperature=t))(z, y, tau)
    assert np.isfinite(np.asarray(lp[0])) and np.isnan(np.asarray(lp[1:])).all() and np.isnan(np.asarray(h[1:])).all()


@pytest.mark.parametrize("backend", ["jax", "jax-sharded"])
@pytest.mark.parametrize("bad", ext.EXT_BAD_INPUTS, ids=lambda b: b.name)
def test_extended_bad_input_raises(backend, bad):
    from tests.cross.test_bad_inputs import _call
    from dualvp.testing import cases

    kw = cases.bad_input_base()
    kw.update(bad.changes)
    with pytest.raises(bad.error) as info:
        _call(backend)(kw)
    msg = str(info.value)
    assert f"{bad.arg}:" in msg and "expected" in msg, msg


def test_fused_op_refuses_the_new_options_clearly():
    h = jnp.zeros((3, 4), jnp.float32)
    w = jnp.zeros((8, 4), jnp.float32)
    y = jnp.zeros((3,), jnp.int32)
    for kw in ({"multi_target": True}, {"with_sum_p2": True}):
        with pytest.raises(NotImplementedError, match=f"{next(iter(kw))}:"):
            dualvp_jax.linear_logprob_entropy(h, w, y, **kw)
