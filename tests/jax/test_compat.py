"""dualvp_jax.compat.softmax_cross_entropy_with_integer_labels against optax's documented semantics.

The expected values and gradients are written here, in float64 NumPy, from
optax's definition (``logsumexp`` over ``where`` minus the label's logit;
0 on rows with no element in ``where``; labels index like ``take_along_axis``,
so ``-C <= y < 0`` counts from the end and anything else is NaN, whose
gradient is the ``where``-softmax alone). optax itself is not needed; one
test cross-checks against it when it happens to be installed.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from dualvp_jax import compat  # noqa: E402

ce = compat.softmax_cross_entropy_with_integer_labels


# --- the independent formulation ---------------------------------------------


def expected(z, y, cot, axis=-1, where=None):
    """``(loss, d(sum(cot * loss))/dz)`` in float64, from optax's semantics.

    ``z``: logits (any float dtype, evaluated exactly in float64); ``axis``:
    an int or a tuple of ints; ``where``: None, the shape of ``y`` or
    broadcastable to ``z``.
    """
    z = np.asarray(z, np.float64)
    nd = z.ndim
    axes = tuple(a % nd for a in (axis if isinstance(axis, tuple) else (axis,)))
    batch = tuple(a for a in range(nd) if a not in axes)
    if where is None:
        w = np.ones(z.shape, bool)
    else:
        w = np.asarray(where)
        if w.ndim != nd:
            w = np.expand_dims(w, axes[0])
        w = np.broadcast_to(w, z.shape)
    perm = batch + axes
    flat = lambda x: np.transpose(x, perm).reshape(tuple(z.shape[a] for a in batch) + (-1,))  # noqa: E731
    zf, wf = flat(z), flat(w)
    n = zf.shape[-1]
    y = np.asarray(y).astype(np.int64)
    y = np.where(y < 0, y + n, y)
    ok = (y >= 0) & (y < n)
    log_sm = np.where(wf, zf, -np.inf)
    m = np.max(log_sm, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(wf, np.exp(zf - m), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):  # rows with nothing in `where`: zeroed below
        lse = m[..., 0] + np.log(np.sum(e, axis=-1))
        softmax_w = e / np.sum(e, axis=-1, keepdims=True)  # log_softmax over `where`, exponentiated
    zy = np.take_along_axis(zf, np.where(ok, y, 0)[..., None], axis=-1)[..., 0]
    zy = np.where(ok, zy, np.nan)
    row_in = np.any(wf, axis=-1)
    with np.errstate(invalid="ignore"):
        loss = np.where(row_in, lse - zy, 0.0)
    onehot = (np.arange(n) == y[..., None]) & ok[..., None]
    g = np.where(row_in[..., None], softmax_w - onehot, 0.0) * np.asarray(cot, np.float64)[..., None]
    # back to the logits' layout
    g = g.reshape(np.transpose(z, perm).shape)
    g = np.transpose(g, np.argsort(perm))
    return loss, g


def value_and_grad(fn, z, cot, *, jit=True):
    """``fn(z)`` and the gradient of ``sum(cot * fn(z))``: forward and backward one jitted program (eager,
    each is its own, and every new shape's input conversion another); ``jit=False``: op by op."""
    if not jit:
        out, vjp = jax.vjp(fn, z)
        (g,) = vjp(jnp.asarray(cot, out.dtype))
        return out, g

    @jax.jit
    def run(z, cot):
        out, vjp = jax.vjp(fn, z)
        return out, vjp(cot.astype(out.dtype))[0]

    return run(z, np.asarray(cot).astype(z.dtype))  # rounded on the host, straight from float64


def put(x, dtype=None):
    """A NumPy array on the device, converted on the host (``jnp.asarray`` compiles a program per shape)."""
    x = np.asarray(x)
    return jax.device_put(x if dtype is None else x.astype(jnp.dtype(dtype)))


def check(out, g, want, want_g, *, dtype=jnp.float32, vtol=2e-6, gtol=2e-6):
    assert out.dtype == dtype and g.dtype == dtype, (out.dtype, g.dtype)
    out, g = np.asarray(out, np.float64), np.asarray(g, np.float64)
    assert np.array_equal(np.isnan(out), np.isnan(want)), (out, want)
    np.testing.assert_allclose(out, want, rtol=vtol, atol=vtol, equal_nan=True)
    np.testing.assert_allclose(g, want_g, rtol=gtol, atol=gtol)


def problem(shape=(12, 16), axis=-1, seed=0):
    """Logits, labels (some wrapped, some out of range) and per-class / per-row masks.

    Rows 0-1: label outside ``where``; row 2: ``where`` all False; row 3: a
    negative label (counts from the end); row 4: a label out of range; row 5:
    only the label in ``where``.
    """
    rng = np.random.default_rng(seed)
    z = (rng.normal(size=shape) * 3).astype(np.float32)
    ax = axis % len(shape)
    n = shape[ax]
    bshape = tuple(s for i, s in enumerate(shape) if i != ax)
    y = rng.integers(0, n, bshape)
    w = rng.random(shape) < 0.5
    wm = np.moveaxis(w, ax, -1).copy()
    wl = wm.reshape(-1, n)  # a view into wm, one row per label
    yl = y.reshape(-1)
    wl[0, yl[0]] = False
    wl[1, yl[1]] = False
    wl[1, (yl[1] + 1) % n] = True
    wl[2] = False
    yl[3] = -1
    yl[4] = n + 3
    wl[5] = False
    wl[5, yl[5]] = True
    w = np.moveaxis(wm, -1, ax)
    row = rng.random(bshape) < 0.7
    row.reshape(-1)[2] = False
    cot = rng.normal(size=bshape)
    return z, y, w, row, cot


# --- unsharded ------------------------------------------------------------------


# Every where kind under jit; eager (op by op, the same code) with the class mask and without where.
_WHERE_JIT = [(k, True) for k in ("none", "class", "row", "row_unit_axis", "class_broadcast")] + [
    ("none", False), ("class", False)]


@pytest.mark.slow
@pytest.mark.parametrize("where_kind,use_jit", _WHERE_JIT, ids=[f"{j}-{k}" for k, j in _WHERE_JIT])
def test_unsharded_where_variants(where_kind, use_jit):
    z, y, w, row, cot = problem()
    where = {"none": None, "class": w, "row": row, "row_unit_axis": row[:, None],
             "class_broadcast": w[:1]}[where_kind]
    fn = lambda z: ce(z, jnp.asarray(y), where=None if where is None else jnp.asarray(where))  # noqa: E731
    out, g = value_and_grad(jax.jit(fn) if use_jit else fn, put(z), cot, jit=use_jit)
    want, want_g = expected(z, y, cot, where=where)
    check(out, g, want, want_g)
    if where_kind == "class":
        # the rows this test is about: a label outside `where` is not in the normaliser
        assert want[0] < np.log(np.sum(np.exp(z[0].astype(np.float64)))) - z[0, y[0]]
        assert want[2] == 0 and np.all(want_g[2] == 0)
        assert np.isnan(want[4]) and np.all(np.isfinite(want_g[4]))


# Every where kind at each axis 0, 1, 2; the negative axes (the same axes, normalised first) with the
# class mask, the one laid out along the axis.
_AXIS_WHERE = [(a, k) for k in ("none", "class", "row") for a in (0, 1, 2)] + [(a, "class") for a in (-1, -2, -3)]


@pytest.mark.slow
@pytest.mark.parametrize("axis,where_kind", _AXIS_WHERE, ids=[f"{k}-{a}" for a, k in _AXIS_WHERE])
def test_unsharded_axis_variants(axis, where_kind):
    z, y, w, row, cot = problem(shape=(6, 10, 8), axis=axis, seed=1)
    where = {"none": None, "class": w, "row": row}[where_kind]
    fn = jax.jit(lambda z: ce(z, jnp.asarray(y), axis=axis, where=None if where is None else jnp.asarray(where)))
    out, g = value_and_grad(fn, put(z), cot)
    check(out, g, *expected(z, y, cot, axis=axis, where=where))


@pytest.mark.slow
@pytest.mark.parametrize("axis", [(1, 2), (2, 1), (-1, 0)])
def test_unsharded_tuple_axis(axis):
    rng = np.random.default_rng(2)
    z = rng.normal(size=(4, 3, 5)).astype(np.float32)
    nd = z.ndim
    axes = tuple(a % nd for a in axis)
    n = int(np.prod([z.shape[a] for a in axes]))
    bshape = tuple(z.shape[a] for a in range(nd) if a not in axes)
    y = rng.integers(0, n, bshape)
    w = rng.random(z.shape) < 0.6
    cot = rng.normal(size=bshape)
    for where in (None, w):
        fn = lambda z: ce(z, jnp.asarray(y), axis=axis, where=None if where is None else jnp.asarray(where))  # noqa: E731,B023
        out, g = value_and_grad(fn, put(z), cot)
        check(out, g, *expected(z, y, cot, axis=axis, where=where))


@pytest.mark.slow
@pytest.mark.parametrize("dtype,vtol,gtol", [("bfloat16", 3e-2, 1e-2), ("float16", 4e-3, 2e-3)])
def test_16_bit_logits_keep_their_dtype(dtype, vtol, gtol):
    z, y, w, row, cot = problem(seed=3)
    zt = put(z, dtype)
    for where in (None, w):
        out, g = value_and_grad(lambda z: ce(z, jnp.asarray(y), where=where), zt, cot)  # noqa: B023
        # the oracle judges the rounded input the function saw
        check(out, g, *expected(np.asarray(zt, np.float64), y, cot, where=where), dtype=zt.dtype,
              vtol=vtol, gtol=gtol)


@pytest.mark.slow
def test_float64_under_x64():
    with jax.enable_x64(True):
        z, y, w, row, cot = problem(seed=4)
        z64 = put(z.astype(np.float64) + np.random.default_rng(0).normal(size=z.shape) * 1e-3)
        out, g = value_and_grad(lambda z: ce(z, jnp.asarray(y), where=jnp.asarray(w)), z64, cot)
        check(out, g, *expected(np.asarray(z64), y, cot, where=w), dtype=jnp.float64, vtol=1e-12, gtol=1e-12)


@pytest.mark.slow
def test_banned_tokens_minus_inf():
    z, y, w, row, cot = problem(seed=5)
    z[6:, ::3] = -np.inf
    y[6:] = 1  # a finite column
    for where in (None, w):
        out, g = value_and_grad(lambda z: ce(z, jnp.asarray(y), where=where), put(z), cot)  # noqa: B023
        want, want_g = expected(z, y, cot, where=where)
        check(out, g, want, want_g)


def test_matches_optax_when_installed():
    optax = pytest.importorskip("optax")
    z, y, w, row, cot = problem(seed=6)
    for axis, where in ((-1, None), (-1, w), (-1, row), (0, None)):
        zz, yy, ww = (z, y, where) if axis == -1 else (z.T.copy(), y, None)
        a, ga = value_and_grad(
            lambda z: optax.softmax_cross_entropy_with_integer_labels(z, jnp.asarray(yy), axis, ww),  # noqa: B023
            jnp.asarray(zz), cot)
        b, gb = value_and_grad(lambda z: ce(z, jnp.asarray(yy), axis, ww), jnp.asarray(zz), cot)  # noqa: B023
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-6, atol=2e-6, equal_nan=True)
        np.testing.assert_allclose(np.asarray(gb), np.asarray(ga), rtol=2e-6, atol=2e-6)


# --- sharded --------------------------------------------------------------------


def _auto_mesh(world):
    return Mesh(np.array(jax.devices()[:world]), ("tp",))


# W = 2 with every where x axis (x mesh kind); W = 4 with the class mask, the one sharded with the logits
# (the other kinds repeat at W = 4 what W = 2 pins: the same code with more shards)
_WORLD_WHERE = [(2, "none"), (2, "class"), (2, "row"), (4, "class")]


# axis -1 with every (W, where); axis 0 (the classes on the first axis, sharded there) with the class
# mask, the one sharded with the logits, at both W.
_SM_AXIS = [(w, k, -1) for w, k in _WORLD_WHERE] + [(w, k, 0) for w, k in _WORLD_WHERE if k == "class"]


@pytest.mark.slow
@pytest.mark.parametrize("world,where_kind,axis", _SM_AXIS, ids=[f"{a}-{w}-{k}" for w, k, a in _SM_AXIS])
def test_inside_shard_map(world, where_kind, axis):
    shape = (16, 12) if axis == -1 else (16, 12)  # axis 0: 16 classes, 12 rows
    z, y, w, row, cot = problem(shape=shape, axis=axis, seed=7)
    where = {"none": None, "class": w, "row": row}[where_kind]
    cls_spec = P(None, "tp") if axis == -1 else P("tp", None)
    specs = (cls_spec, P(None))
    args = (jnp.asarray(y),)
    if where is not None:
        specs += (cls_spec if where_kind == "class" else P(None),)
        args += (jnp.asarray(where),)

    def body(z, y, *ww):
        return ce(z, y, axis=axis, where=ww[0] if ww else None, axis_name="tp")

    sm = jax.jit(jax.shard_map(body, mesh=_auto_mesh(world), in_specs=specs, out_specs=P(None)))
    out, g = value_and_grad(lambda z: sm(z, *args), put(z), cot)
    check(out, g, *expected(z, y, cot, axis=axis, where=where))


# Every (W, where) on an explicit mesh; on an auto mesh (the same op, a different sharding mode) W = 2
# without where and W = 4 with the class mask.
_MESH_FORM = [(w, "explicit", k) for w, k in _WORLD_WHERE] + [(2, "auto", "none"), (4, "auto", "class")]


@pytest.mark.slow
@pytest.mark.parametrize("world,mesh_kind,where_kind", _MESH_FORM, ids=[f"{w}-{k}-{m}" for w, m, k in _MESH_FORM])
def test_mesh_form(world, mesh_kind, where_kind):
    z, y, w, row, cot = problem(seed=8)
    where = {"none": None, "class": w, "row": row}[where_kind]
    mesh = jax.make_mesh((world,), ("tp",), devices=jax.devices()[:world]) if mesh_kind == "explicit" \
        else _auto_mesh(world)
    fn = jax.jit(lambda z: ce(z, jnp.asarray(y), where=None if where is None else jnp.asarray(where),
                              mesh=mesh, vocab_axis="tp"))
    out, g = value_and_grad(fn, put(z), cot)
    check(out, g, *expected(z, y, cot, where=where))


@pytest.mark.slow
def test_mesh_form_2d_rows_sharded():
    """Rows over "dp", classes over "tp" on an explicit (dp, tp) mesh."""
    from jax.sharding import NamedSharding

    mesh = jax.make_mesh((2, 4), ("dp", "tp"))
    z, y, w, row, cot = problem(seed=9)
    zs = jax.device_put(z, NamedSharding(mesh, P("dp", "tp")))
    ys = jax.device_put(y.astype(np.int32), NamedSharding(mesh, P("dp")))
    ws = jax.device_put(w, NamedSharding(mesh, P("dp", "tp")))
    out, g = value_and_grad(jax.jit(lambda z: ce(z, ys, where=ws, mesh=mesh)), zs, cot)
    check(out, g, *expected(z, y, cot, where=w))


# --- errors -----------------------------------------------------------------------


def test_bad_arguments_name_the_argument():
    z = jnp.zeros((4, 8))
    y = jnp.zeros((4,), jnp.int32)
    mesh = _auto_mesh(2)
    bad = [
        (dict(logits=jnp.zeros((4, 8), jnp.int32)), TypeError, "logits:"),
        (dict(labels=jnp.zeros((4,), jnp.float32)), TypeError, "labels:"),
        (dict(labels=jnp.zeros((5,), jnp.int32)), ValueError, "labels:"),
        (dict(labels=[0, 1, 2, 3]), TypeError, "labels:"),
        (dict(axis=2), ValueError, "axis:"),
        (dict(axis=1.0), TypeError, "axis:"),
        (dict(where=jnp.ones((4, 8), jnp.int32)), TypeError, "where:"),
        (dict(where=jnp.ones((4, 3), bool)), ValueError, "where:"),
        (dict(where=jnp.ones((2,), bool)), ValueError, "where:"),
        (dict(axis=(0, 1), labels=jnp.zeros((), jnp.int32), mesh=mesh), ValueError, "axis:"),
        (dict(axis_name="tp", mesh=mesh), ValueError, "axis_name:"),
        (dict(logits=jnp.zeros((4, 7)), mesh=mesh), ValueError, "logits:"),
        (dict(mesh=mesh, vocab_axis="dp"), ValueError, "vocab_axis:"),
        (dict(mesh="tp"), TypeError, "mesh:"),
    ]
    for change, err, start in bad:
        kw = dict(logits=z, labels=y)
        kw.update(change)
        with pytest.raises(err) as info:
            ce(**kw)
        assert str(info.value).startswith(start), (change, str(info.value))
