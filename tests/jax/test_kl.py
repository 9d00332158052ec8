"""dualvp_jax.kl_divergence / sharded_kl_divergence against the float64 oracle (dualvp.kl_reference).

Values and both gradients on the shared KL cases, float32 and bfloat16, at
W = 1 and 4 host devices and a sample at W = 2 and 8 (tests/conftest.py gives 8); the collectives of
the forward and of the gradient read from the jaxpr; the CPU's chunked
statistics equal the whole-shard ones; bad inputs name the argument.
"""

import functools

import numpy as np
import pytest

import jax
import jax.extend
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import dualvp_jax
from dualvp_jax import kl as kl_mod
from dualvp.testing.kl import KL_CASES, kl_failures, make_kl

from ._helpers import JNP_DTYPES, mesh_1d, put


@functools.lru_cache(maxsize=None)
def _runner(world, tau, direction, has_mask):
    mesh = mesh_1d(world)

    @jax.jit
    def run(z, r, m, g):
        def f(z, r):
            kl = dualvp_jax.sharded_kl_divergence(z, r, mesh, "tp", row_mask=m if has_mask else None,
                                                  temperature=tau, direction=direction)
            return jnp.sum(g * kl), kl
        (_, kl), (dz, dr) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(z, r)
        return kl, dz, dr

    return mesh, run


def _check(case, dtype, world):
    p = make_kl(case, dtype)
    mesh, run = _runner(world, case.temperature, case.direction, p.row_mask is not None)
    dt = JNP_DTYPES[dtype]
    # converted on the host (jnp.asarray / astype would compile a program per shape and dtype)
    z = put(p.logits.astype(np.float32), dt)
    r = put(p.ref_logits.astype(np.float32), dt)
    m = put(np.ones(p.grad.shape, bool) if p.row_mask is None else p.row_mask)
    with jax.set_mesh(mesh):
        kl, dz, dr = run(z, r, m, put(p.grad, np.float32))
    assert kl.dtype == jnp.float32 and dz.dtype == dt and dr.dtype == dt
    return kl_failures(p, tuple(np.asarray(x).astype(np.float32) for x in (kl, dz, dr)), f"W={world} ")


# The slow tier runs every case at W = 1 (no axis) in float32 and at W = 4 (the shard combine, the same
# code at W = 2, 4, 8: the fast tier's sample below runs W = 2 and 8) in bfloat16 (the upcast on the way
# in, the cast of both gradients on the way out; the same float32 arithmetic in between); each case
# also in its own dtype in the samples below (~1.5 s of compiles a case and dtype).
_GRID = [(1, "float32"), (4, "bfloat16")]


@pytest.mark.slow
@pytest.mark.parametrize("world, dtype", _GRID)
def test_sharded_matches_oracle(world, dtype):
    fails = []
    for case in KL_CASES:
        fails += _check(case, dtype, world)
    assert not fails, "\n".join(fails)


# W = 2 in the fast tier (a whole banned shard, bfloat16 with masked rows); W = 4 and 8 slow
@pytest.mark.parametrize("world, names", [
    (2, ("banned_shard", "bf16_banned")),
    pytest.param(4, ("masked_batch", "bf16_reverse"), marks=pytest.mark.slow),
    pytest.param(8, ("banned_both", "reverse_infinite", "offset_low_tau"), marks=pytest.mark.slow)])
def test_sharded_matches_oracle_fast_sample(world, names):
    # the fast tier's sample: a whole banned shard, masked NaN rows, the bfloat16 cases, both
    # directions with infinities, a low temperature on large offsets; W = 2, 4, 8
    fails = []
    for name in names:
        case = next(c for c in KL_CASES if c.name == name)
        fails += _check(case, case.dtype, world)
    assert not fails, "\n".join(fails)


def _shard_map_fn(world, case, path="auto"):
    mesh = mesh_1d(world, "auto")
    opt = kl_mod.KLOptions(case.temperature, case.direction, path)

    def body(z, r, m):
        return kl_mod._apply(z, r, m, "tp", opt)

    return jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), P(None)), out_specs=P(None),
                         check_vma=True)


def _collectives(jaxpr) -> list:
    names = []

    def walk(jx):
        for eqn in jx.eqns:
            if any(k in eqn.primitive.name for k in ("all_gather", "psum", "pmax", "pmin", "ppermute", "all_to_all",
                                                      "reduce_scatter")):
                names.append(eqn.primitive.name)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    return names


def test_one_collective_per_forward_none_in_backward():
    case = KL_CASES[5]
    p = make_kl(case)
    f = _shard_map_fn(4, case)
    z, r, m = jnp.asarray(p.logits.reshape(-1, 64), jnp.float32), jnp.asarray(p.ref_logits.reshape(-1, 64),
                                                                              jnp.float32), jnp.asarray(
        p.row_mask.reshape(-1))
    assert _collectives(jax.make_jaxpr(f)(z, r, m)) == ["all_gather_invariant"]
    g = jax.make_jaxpr(jax.grad(lambda z, r: jnp.sum(f(z, r, m)), argnums=(0, 1)))(z, r)
    assert _collectives(g) == ["all_gather_invariant"]  # the forward's; the backward adds none
    # inside shard_map: values and both gradients against the oracle, through the public per-shard function
    out = jax.jit(lambda z, r: (f(z, r, m), *jax.grad(lambda z, r: jnp.sum(jnp.asarray(p.grad.reshape(-1),
                                                                                        jnp.float32) * f(z, r, m)),
                                                     argnums=(0, 1))(z, r)))(z, r)
    shaped = (np.asarray(out[0]).reshape(p.grad.shape), np.asarray(out[1]).reshape(p.logits.shape),
              np.asarray(out[2]).reshape(p.logits.shape))
    assert not kl_failures(p, shaped)


def test_chunked_statistics_equal_whole(monkeypatch):
    # 4-row chunks (over 6 rows: the last chunk overlaps) and 3 column blocks of 128 columns, merged like shards
    monkeypatch.setattr(kl_mod.chunks, "CHUNK_BYTES", 1)
    monkeypatch.setattr(kl_mod.chunks, "COLUMN_BLOCK", 50)
    case = KL_CASES[3]
    p = make_kl(case)
    z, r = jnp.asarray(p.logits, jnp.float32), jnp.asarray(p.ref_logits, jnp.float32)
    outs = [np.asarray(kl_mod._apply_jit(z, r, None, axis_name=None, opt=kl_mod.KLOptions(1.0, "forward", path)))
            for path in ("whole", "chunked")]
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-6, atol=1e-7)


def test_per_shard_function_unsharded_and_public_exports():
    p = make_kl(KL_CASES[8])
    c = p.case
    z, r = jnp.asarray(p.logits, jnp.float32), jnp.asarray(p.ref_logits, jnp.float32)
    g = jnp.asarray(p.grad, jnp.float32)
    f = lambda z, r: jnp.sum(g * dualvp_jax.kl_divergence(z, r, temperature=c.temperature,  # noqa: E731
                                                          direction=c.direction))
    kl = dualvp_jax.kl_divergence(z, r, temperature=c.temperature, direction=c.direction)
    dz, dr = jax.grad(f, argnums=(0, 1))(z, r)
    assert not kl_failures(p, (np.asarray(kl), np.asarray(dz), np.asarray(dr)))
    assert {"kl_divergence", "sharded_kl_divergence"} <= set(dualvp_jax.__all__)


@pytest.mark.parametrize("change, name", [
    (dict(logits=[1.0, 2.0]), "logits"),
    (dict(logits=np.zeros((3, 8), np.int32)), "logits"),
    (dict(ref_logits=np.zeros((3, 7), np.float32)), "ref_logits"),
    (dict(ref_logits=None), "ref_logits"),
    (dict(row_mask=np.ones(3, np.float32)), "row_mask"),
    (dict(row_mask=np.ones(4, bool)), "row_mask"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(temperature=jnp.asarray(1.0)), "temperature"),
    (dict(direction="sideways"), "direction"),
])
def test_bad_inputs_name_the_argument(change, name):
    kw = dict(logits=np.zeros((3, 8), np.float32), ref_logits=np.zeros((3, 8), np.float32), row_mask=None,
              temperature=1.0, direction="forward")
    kw.update(change)
    with pytest.raises((TypeError, ValueError), match=f"^{name}:"):
        dualvp_jax.kl_divergence(kw.pop("logits"), kw.pop("ref_logits"), **kw)
    kw2 = dict(kw)
    with pytest.raises((TypeError, ValueError), match=f"^{name}:"):
        dualvp_jax.sharded_kl_divergence(change.get("logits", np.zeros((3, 8), np.float32)),
                                         change.get("ref_logits", np.zeros((3, 8), np.float32)), mesh_1d(2), "tp",
                                         **kw2)


def test_sharded_vocab_not_divisible():
    with pytest.raises(ValueError, match="^logits:"):
        dualvp_jax.sharded_kl_divergence(np.zeros((2, 6), np.float32), np.zeros((2, 6), np.float32), mesh_1d(4))


@pytest.mark.slow
@pytest.mark.parametrize("v, dtype", [(300, "float32"), (512, "bfloat16")])
def test_batch_invariant_rows(v, dtype):
    # a row's KL and both gradient rows are bitwise the same alone (T = 1) and inside calls of T = 7, 64, 1000
    # rows at random positions, and from run to run. V_local = 300: a block of 13 rows is below XLA:CPU's
    # switch to its YNNPACK reduction, one of 16 above (docs/decisions.md, "JAX: one block shape per V").
    rng = np.random.default_rng(0)
    n = 1003
    z_all = (rng.standard_normal((n, v)) * 3).astype(np.float32)
    r_all = z_all + rng.standard_normal((n, v)).astype(np.float32)
    m_all = rng.random(n) < 0.9
    g_all = rng.standard_normal(n).astype(np.float32)
    dt = JNP_DTYPES[dtype]

    @jax.jit
    def run(z, r, m, g):
        kl, vjp = jax.vjp(lambda z, r: dualvp_jax.kl_divergence(z, r, row_mask=m, temperature=0.8), z, r)
        dz, dr = vjp(g)
        return kl, dz.astype(jnp.float32), dr.astype(jnp.float32)

    def call(idx):
        out = run(put(z_all[idx], dt), put(r_all[idx], dt), put(m_all[idx]), put(g_all[idx]))
        return [np.asarray(x) for x in out]

    alone = [call(np.array([i])) for i in range(3)]
    for T in (7, 64, 1000):
        idx = 3 + rng.choice(n - 3, size=T, replace=False)
        pos = rng.choice(T, size=3, replace=False)
        idx[pos] = np.arange(3)
        out = call(idx)
        for i, p in enumerate(pos):
            for name, a, b in zip(("kl", "d_logits", "d_ref"), alone[i], out):
                assert np.array_equal(a[0].view(np.uint32), b[p].view(np.uint32)), (T, i, name)
    again = call(idx)
    for a, b in zip(out, again):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
