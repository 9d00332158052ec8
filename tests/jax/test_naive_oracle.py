"""dualvp_jax against a second, independent oracle: jax.grad of the naive unsharded formulation, in float64.

Also ``jax.test_util.check_grads`` (reverse mode vs finite differences, float64)
in each mode. float64 is scoped with the ``jax.enable_x64`` context manager so
that it does not leak into other tests.
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

import dualvp_jax  # noqa: E402
from dualvp.testing import cases  # noqa: E402
from dualvp.testing.modes import MODES  # noqa: E402
from ._helpers import check_close, inputs, mesh_1d, sharded_runner  # noqa: E402


def naive(z, y, keep, tau, ignore_index):
    """Textbook formulation on full logits: log_softmax, jnp.where masking."""
    u = z / tau
    logp = jax.nn.log_softmax(u, axis=-1)
    valid = y != ignore_index
    ys = jnp.where(valid, y, 0)
    onehot = (jnp.arange(z.shape[-1]) == ys[..., None]) & valid[..., None]
    logq = logp if keep is None else jax.nn.log_softmax(jnp.where(keep | onehot, u, -jnp.inf), axis=-1)
    lp = jnp.where(valid, jnp.take_along_axis(logq, ys[..., None], axis=-1)[..., 0], 0.0)
    p = jnp.exp(logp)
    h = -jnp.sum(jnp.where(p > 0, p * jnp.where(p > 0, logp, 0.0), 0.0), axis=-1)
    return lp, h


# A sample of the shared cases (all of them against dualvp.reference: tests/jax/test_chunks.py): each mask
# kind, a temperature far from 1, and every option at once ("everything": ignored rows, a mask, -inf
# logits, a temperature; it holds what "basic", "temp_0.3", "ignored_masked" and "neg_inf" would pin).
_NAIVE_CASES = ("drop_target", "all_but_target", "random_mask_temp", "extreme_temp", "everything")


@pytest.mark.slow
@pytest.mark.parametrize("name", _NAIVE_CASES)
def test_vs_naive_jax_grad_float64(name):
    case = cases.case(name)
    prob = cases.make(case)
    world = max(w for w in case.worlds if w <= 4)
    with jax.enable_x64(True):
        z, y, k, gl, ge = inputs(prob, "float64")
        tau, ii = case.temperature, case.ignore_index

        # target, mask and cotangents arguments of the jitted programs: no constants for XLA to fold
        def naive_loss(z, y, k, gl, ge):
            lp, h = naive(z, y, k, tau, ii)
            return jnp.sum(gl * lp) + jnp.sum(ge * h), (lp, h)

        (_, (n_lp, n_h)), n_g = jax.jit(jax.value_and_grad(naive_loss, has_aux=True))(z, y, k, gl, ge)
        n_lp, n_h, n_g = (np.asarray(a) for a in (n_lp, n_h, n_g))
        assert np.all(np.isfinite(n_g)), "naive oracle gradient not finite"
        lp, h, g = sharded_runner(world, "explicit", tau, ii, k is not None)(z, y, k, gl, ge)
        assert g.dtype == jnp.float64
        check_close(name, lp, n_lp, "float64", "logprob")
        check_close(name, h, n_h, "float64", "entropy")
        check_close(name, g, n_g, "float64", "grad")

        # and jax.grad of a scalar loss through the unsharded API
        def loss(z, y, k, gl, ge):
            lp, h = dualvp_jax.logprob_entropy(z, y, keep_mask=k, temperature=tau, ignore_index=ii)
            return jnp.sum(gl * lp) + jnp.sum(ge * h)

        check_close(name, jax.jit(jax.grad(loss))(z, y, k, gl, ge), n_g, "float64", "grad")


# --- check_grads (reverse mode; custom_vjp has no forward mode) ------------------------


def _problem(seed=0, t=4, v=16, mask=True):
    rng = np.random.default_rng(seed)
    z = jnp.asarray(rng.normal(0.0, 2.0, size=(t, v)))
    y = jnp.asarray(np.array([3, v - 1, -100, 0][:t]))
    k = jnp.asarray(rng.random((t, v)) < 0.5) if mask else None
    return z, y, k


# (mode of the shared table dualvp.testing.modes, world or None for the unsharded API, temperature)
_MODES = [
    ("lp+ent+grad", None, 1.0),
    ("lp+ent+grad.keep", None, 0.7),
    ("lp+ent+grad.keep", 2, 1.3),
    ("lp+ent+grad", 4, 0.5),
    ("lp+ent.keep", 4, 1.0),
    ("lp.keep", 2, 1.0),
]


@pytest.mark.slow
@pytest.mark.parametrize("mode,world,temperature", _MODES, ids=[f"{m}-W{w}-tau{t}" for m, w, t in _MODES])
def test_check_grads_float64(mode, world, temperature):
    m = MODES[mode]
    opt = dict(m.options(), temperature=temperature)
    with jax.enable_x64(True):
        z, y, k = _problem(mask=m.masked)
        if world is None:
            def f(z):
                return dualvp_jax.logprob_entropy(z, y, keep_mask=k, **opt)
        else:
            mesh = mesh_1d(world, "auto")

            def body(z, y, *kk):
                return dualvp_jax.logprob_entropy(z, y, axis_name="tp", keep_mask=kk[0] if kk else None, **opt)

            def f(z):
                args = (y,) + ((k,) if k is not None else ())
                specs = (P(None, "tp"), P(None)) + ((P(None, "tp"),) if k is not None else ())
                outs = (P(None), P(None)) if m.with_entropy else (P(None), None)
                return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=outs)(z, *args)

        if not m.entropy_grad or not m.with_entropy:
            # the entropy carries no gradient (or is None): finite differences only see the log-prob
            g = f
            f = lambda z: g(z)[0]  # noqa: E731
        f = jax.jit(f)
        check_grads(f, (z,), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)
