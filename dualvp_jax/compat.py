"""Drop-in for optax's ``softmax_cross_entropy_with_integer_labels``, plain or vocab-sharded.

:func:`softmax_cross_entropy_with_integer_labels` takes the arguments of
``optax.losses.softmax_cross_entropy_with_integer_labels(logits, labels,
axis=-1, where=None)`` and returns what optax returns (values, shape, dtype,
gradients), computed by :func:`dualvp_jax.logprob_entropy`. Two keyword-only
extras make it sharded:

- ``axis_name="tp"`` inside ``jax.shard_map``: ``logits`` is this device's
  slice of the class axis (split contiguously over that mesh axis), ``labels``
  are *global* class ids, the same on every device; a per-class ``where`` is
  sliced like the logits. The result is invariant over ``axis_name``.
- ``mesh=..., vocab_axis="tp"`` on global arrays (under ``jit`` or eager): the
  function runs the ``shard_map`` itself, like
  :func:`dualvp_jax.sharded_logprob_entropy`.

Semantics (optax 0.2.x, ``axis`` an int or, unsharded, a tuple of ints)::

    y   = labels, wrapped like an index: y + C for -C <= y < 0   (C classes)
    out = logsumexp(logits[where]) - logits[y]      over the class axis
    out = 0                                         on rows where ``where`` is all False
    out = NaN (gradient: softmax over ``where``)    when y is outside [-C, C)

``where`` has the shape of ``labels`` (one flag per row; optax expands it
along ``axis``) or any shape broadcastable to ``logits`` (per class). A label
*outside* ``where`` is not part of the normaliser (optax takes the label's
logit but sums only over ``where``), so ``out`` can be negative there; the
gradient is ``softmax_where(logits) - onehot(y)`` with the softmax zero
outside ``where``.

How it maps onto the op, whose keep mask always keeps the target: a row whose
label lies in ``where`` (the usual case) is ``-log_prob`` of the op with
``keep_mask = where``. A row whose label lies outside ``where`` (or out of
range) is evaluated at a stand-in label ``y*`` inside ``where`` (the largest
included logit, so ``z[y*] - log_prob(y*)`` is ``logsumexp(logits[where])``
to the precision optax itself gets) and corrected by ``z[y*] - z[y]``; both
terms are differentiable, so value and gradient are exact. Rows excluded by
``where`` are zeroed on the output (so their gradient is zero).

Cost: a per-row ``where`` (or none) needs no keep mask; a per-class ``where``
is the op's keep mask (a ``[..., C]`` bool, broadcast if it was smaller).
``axis`` other than the last moves the class axis last, which XLA may
materialise as a transposed copy of the logits. Sharded calls issue, besides
the op's one all-gather of O(T) statistics, one ``psum`` of ``[T]`` (the
correction above), and with a per-class ``where`` one more all-gather of
``[W, T, 4]`` (where the stand-in label lives); nothing of size
``[T, C_local]`` crosses devices.

Precision and dtypes: computed in float32 (float64 for float64 logits under
``jax_enable_x64``) and cast to the logits' dtype at the end, as optax returns
the logits' dtype; for 16-bit logits dualvp is the more accurate of the two
(optax runs ``logsumexp`` in the 16-bit dtype).
"""

from __future__ import annotations

import operator
from functools import partial
from typing import NamedTuple, Optional, Union

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from .function import logprob_entropy

__all__ = ["softmax_cross_entropy_with_integer_labels"]

# The op's ignore_index inside this module: every label handed to the op is
# in [0, C), so no row is ignored (excluded rows are zeroed on the output).
_IGNORE = -1


class _Cfg(NamedTuple):
    axis_name: object  # None (unsharded), or a mesh axis name / tuple of names
    where_kind: str  # "none", "row" (one flag per row) or "class" (per class)


# --- argument handling --------------------------------------------------------


def _shape_dtype(name: str, x, kind: str):
    if not (isinstance(x, (jax.Array, np.ndarray, np.generic)) or isinstance(x, jax.core.Tracer)):
        raise TypeError(f"{name}: expected {kind}, got {type(x).__name__}")
    return tuple(x.shape), jnp.dtype(x.dtype)


def _canonical_axis(axis, ndim: int) -> int:
    try:
        a = operator.index(axis)
    except TypeError:
        raise TypeError(f"axis: expected an int or a tuple of ints, got {type(axis).__name__} {axis!r}") from None
    if isinstance(axis, (bool, np.bool_)):
        raise TypeError(f"axis: expected an int or a tuple of ints, got bool {axis!r}")
    if not -ndim <= a < ndim:
        raise ValueError(f"axis: expected an axis of logits with {ndim} dims (in [{-ndim}, {ndim})), got {axis}")
    return a % ndim


def _prepare(logits, labels, axis, where, sharded: bool):
    """Validate; move the class axis last. Returns ``(z, y, where_row, where_class)``.

    ``z [..., C]``; ``y [...]``; at most one of ``where_row [...]`` (one flag
    per row) and ``where_class [..., C]`` (per class) is not ``None``.
    """
    ls, ld = _shape_dtype("logits", logits, "a floating jax.Array or numpy array")
    if not jnp.issubdtype(ld, jnp.floating):
        raise TypeError(f"logits: expected a floating dtype, got {ld.name}")
    if len(ls) < 1:
        raise ValueError(f"logits: expected at least 1 dim (the class axis), got shape {ls}")
    ys, yd = _shape_dtype("labels", labels, "an integer jax.Array or numpy array")
    if not jnp.issubdtype(yd, jnp.integer):
        raise TypeError(f"labels: expected an integer dtype, got {yd.name}")
    ndim = len(ls)
    if isinstance(axis, tuple):
        if sharded:
            raise ValueError(
                f"axis: a tuple of axes is only supported unsharded (without axis_name / mesh), got {axis}")
        if not axis:
            raise ValueError("axis: expected a non-empty tuple of axes, got ()")
        class_axes = tuple(_canonical_axis(a, ndim) for a in axis)
        if len(set(class_axes)) != len(class_axes):
            raise ValueError(f"axis: repeated axes in {axis}")
    else:
        class_axes = (_canonical_axis(axis, ndim),)
    batch_axes = tuple(a for a in range(ndim) if a not in class_axes)
    batch_shape = tuple(ls[a] for a in batch_axes)
    if ys != batch_shape:
        raise ValueError(
            f"labels: expected shape {batch_shape} (logits shape {ls} without the class axis {axis}), got shape {ys}"
        )
    logits = jnp.asarray(logits)
    labels = jnp.asarray(labels)
    if where is not None:
        ws, wd = _shape_dtype("where", where, "None or a bool jax.Array or numpy array")
        if wd != jnp.bool_:
            raise TypeError(f"where: expected dtype bool, got {wd.name}")
        where = jnp.asarray(where)
        if len(ws) != ndim:
            # optax: a `where` of another rank gets a unit class axis.
            if len(ws) != ndim - len(class_axes) or len(class_axes) != 1:
                raise ValueError(
                    f"where: expected the shape of labels {ys} or a shape broadcastable to logits {ls}, got shape {ws}"
                )
            where = jnp.expand_dims(where, class_axes[0])
            ws = tuple(where.shape)
        try:
            np.broadcast_shapes(ws, ls)
            ok = np.broadcast_shapes(ws, ls) == ls
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"where: expected a shape broadcastable to logits {ls}, got shape {tuple(np.shape(where))}")

    perm = batch_axes + class_axes

    def to_last(x):
        x = x if perm == tuple(range(ndim)) else jnp.transpose(x, perm)
        return x.reshape(batch_shape + (-1,)) if len(class_axes) > 1 else x

    z = to_last(logits)
    where_row = where_class = None
    if where is not None:
        if all(where.shape[a] == 1 for a in class_axes):
            # One flag per row: rows are in or out, no keep mask needed.
            w = jnp.broadcast_to(where, tuple(ls[a] if a in batch_axes else 1 for a in range(ndim)))
            where_row = to_last(w).reshape(batch_shape)
        else:
            where_class = to_last(jnp.broadcast_to(where, ls))
    return z, labels, where_row, where_class


# --- the computation on one shard ----------------------------------------------


def _pick(z, col, owns):
    """``z[..., col]`` where ``owns``, else 0, as a masked sum (fuses; its VJP is a select)."""
    cols = lax.broadcasted_iota(col.dtype, z.shape, z.ndim - 1)
    hit = (cols == col[..., None]) & owns[..., None]
    return jnp.sum(jnp.where(hit, z, jnp.zeros_like(z)), axis=-1)


def _has(mask, col, owns):
    """``mask[..., col]`` where ``owns``, else False (a reduction, no gather)."""
    cols = lax.broadcasted_iota(col.dtype, mask.shape, mask.ndim - 1)
    return jnp.any(mask & (cols == col[..., None]) & owns[..., None], axis=-1)


def _shard(cfg: _Cfg, z, labels, where_row, where_class):
    """optax's loss on one shard ``z [..., C_local]`` (the whole class axis when unsharded)."""
    cdt = jnp.promote_types(z.dtype, jnp.float32)
    c_local = z.shape[-1]
    if cfg.axis_name is None:
        r, w = 0, 1
    else:
        r, w = lax.axis_index(cfg.axis_name), lax.axis_size(cfg.axis_name)
    n_cls = w * c_local
    ity = jnp.int64 if jax.config.jax_enable_x64 else jnp.int32
    y = labels.astype(ity)
    y = jnp.where(y < 0, y + n_cls, y)  # optax indexes like take_along_axis: -1 is the last class
    in_range = (y >= 0) & (y < n_cls)
    lo = r * c_local

    if cfg.where_kind == "class":
        # The stand-in label y*: the largest included logit over all shards
        # (argmax, so its logit is the op's own kept max and the correction
        # loses nothing). Only indices and flags come out of this table.
        zs = lax.stop_gradient(z).astype(cdt)
        zk = jnp.where(where_class, zs, jnp.full_like(zs, -jnp.inf))
        km = jnp.max(zk, axis=-1)
        ki = jnp.argmax(zk, axis=-1).astype(ity)
        own_y = in_range & (y >= lo) & (y < lo + c_local)
        y_kept = _has(where_class, jnp.where(own_y, y - lo, 0), own_y)
        any_kept = jnp.any(where_class, axis=-1)
        table = jnp.stack([km, ki.astype(cdt), y_kept.astype(cdt), any_kept.astype(cdt)], axis=0)
        if cfg.axis_name is None:
            table = table[:, None]
        else:
            table = lax.all_gather(table, cfg.axis_name, axis=1, to="invarying")  # [4, W, ...]
        r_star = jnp.argmax(table[0], axis=0)
        ki_star = jnp.take_along_axis(table[1], r_star[None], axis=0)[0].astype(ity)
        y_star = r_star.astype(ity) * c_local + ki_star
        y_in = jnp.any(table[2] > 0, axis=0)
        include = jnp.any(table[3] > 0, axis=0)
        keep = where_class
    else:
        y_star = jnp.zeros_like(y)  # every class is included: any stand-in will do
        y_in = jnp.ones(y.shape, bool)
        include = jnp.ones(y.shape, bool) if where_row is None else where_row
        keep = None

    direct = in_range & y_in
    # Excluded rows are evaluated at y* too and zeroed below (zero cotangent),
    # not given the op's ignore_index: an ignored row whose keep mask is all
    # False has no finite distribution, and its (unused) gradient would be NaN.
    target = jnp.where(direct, y, y_star)
    lp, _ = logprob_entropy(z, target, axis_name=cfg.axis_name, keep_mask=keep, with_entropy=False,
                            ignore_index=_IGNORE)
    # Correction for rows evaluated at y*: + z[y*] - z[y]  (z[y] = NaN when y is out of range).
    own_star = (y_star >= lo) & (y_star < lo + c_local)
    own_y = in_range & (y >= lo) & (y < lo + c_local)
    zc = z.astype(cdt)
    corr = _pick(zc, jnp.where(own_star, y_star - lo, 0), own_star) - _pick(zc, jnp.where(own_y, y - lo, 0), own_y)
    if cfg.axis_name is not None:
        corr = lax.psum(corr, cfg.axis_name)
    corr = corr + jnp.where(in_range, 0.0, jnp.nan).astype(cdt)
    out = -lp + jnp.where(direct, jnp.zeros_like(corr), corr)
    out = jnp.where(include, out, jnp.zeros_like(out))
    return out.astype(z.dtype)


@partial(jax.jit, static_argnames=("cfg",))
def _local_jit(z, labels, where_row, where_class, *, cfg: _Cfg):
    # jit: eager calls are one compiled program and the labels the op sees are
    # traced (no host round trip); under an outer jit / shard_map it is inlined.
    return _shard(cfg, z, labels, where_row, where_class)


@partial(jax.jit, static_argnames=("cfg", "mesh", "lead", "all_manual"))
def _mesh_jit(z, labels, where_row, where_class, *, cfg: _Cfg, mesh, lead, all_manual):
    z_spec, y_spec = P(*lead, cfg.axis_name), P(*lead)
    args, specs = [z, labels], [z_spec, y_spec]
    if where_row is not None:
        args.append(where_row)
        specs.append(y_spec)
    if where_class is not None:
        args.append(where_class)
        specs.append(z_spec)

    def body(z, y, *w):
        return _shard(cfg, z, y, w[0] if cfg.where_kind == "row" else None,
                      w[0] if cfg.where_kind == "class" else None)

    axis_names = frozenset(mesh.axis_names) if all_manual else frozenset({cfg.axis_name})
    return jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=y_spec, axis_names=axis_names,
                         check_vma=True)(*args)


def softmax_cross_entropy_with_integer_labels(
    logits,
    labels,
    axis: Union[int, tuple] = -1,
    where=None,
    *,
    axis_name=None,
    mesh: Optional[Mesh] = None,
    vocab_axis: str = "tp",
):
    """Softmax cross entropy with integer labels, as optax defines it, on dualvp's op.

    ``out = logsumexp(logits[where]) - logits[labels]`` along ``axis``; 0 on
    rows where ``where`` is all False; NaN for labels outside ``[-C, C)``
    (negative labels count from the end, as in optax). See the module
    docstring for the details and the cost.

    Args:
      logits: ``[..., C, ...]`` floating; the class axis is ``axis``. Sharded:
        this device's slice ``C_local`` of the classes (``axis_name``), or the
        global array (``mesh``).
      labels: integer, the shape of ``logits`` without the class axis: global
        class ids.
      axis: the class axis, an int (negative counts from the end) or,
        unsharded, a tuple of axes flattened in order (a label is then a flat
        index into that block, as in optax).
      where: ``None``, a bool array of the shape of ``labels`` (rows in or
        out), or a bool array broadcastable to ``logits`` (classes in or out;
        sharded: sliced like the logits).
      axis_name: keyword only. Inside ``jax.shard_map``: the mesh axis (or
        tuple of axes) that splits the class axis; the shard of index ``r``
        holds classes ``[r*C_local, (r+1)*C_local)``. ``None``: unsharded.
      mesh, vocab_axis: keyword only. Global arrays whose class axis is split
        over the mesh axis ``vocab_axis`` of ``mesh``; the function runs the
        ``shard_map`` (other dims keep their sharding, as in
        :func:`dualvp_jax.sharded_logprob_entropy`). Not with ``axis_name``.

    Returns:
      ``[...]`` (the shape of ``labels``), the logits' dtype. Sharded:
      invariant over the class axis' mesh axis.

    Raises:
      TypeError / ValueError naming the argument (at trace time).
    """
    if mesh is not None and axis_name is not None:
        raise ValueError(f"axis_name: give axis_name (inside shard_map) or mesh (global arrays), not both; "
                         f"got axis_name={axis_name!r} and a mesh")
    sharded = mesh is not None or axis_name is not None
    z, y, where_row, where_class = _prepare(logits, labels, axis, where, sharded)
    kind = "class" if where_class is not None else ("row" if where_row is not None else "none")
    if mesh is None:
        return _local_jit(z, y, where_row, where_class, cfg=_Cfg(axis_name, kind))

    from .sharded import is_explicit, lead_spec, mesh_world, place_on_mesh  # the same placement rules as the sharded op

    world = mesh_world(mesh, vocab_axis)
    if z.shape[-1] % world:
        raise ValueError(f"logits: expected the number of classes {z.shape[-1]} divisible by the size {world} "
                         f"of mesh axis {vocab_axis!r}, got shape {tuple(np.shape(logits))}")
    ndim = z.ndim
    explicit = is_explicit(mesh, mesh.axis_names)
    if explicit:
        lead = lead_spec(z, mesh, vocab_axis, ndim)
        z = place_on_mesh(z, mesh, P(*lead, vocab_axis), True)
        y = place_on_mesh(y, mesh, P(*lead), True)
        where_row = place_on_mesh(where_row, mesh, P(*lead), True)
        where_class = place_on_mesh(where_class, mesh, P(*lead, vocab_axis), True)
    else:
        lead = (None,) * (ndim - 1)
    return _mesh_jit(z, y, where_row, where_class, cfg=_Cfg(vocab_axis, kind), mesh=mesh, lead=lead,
                     all_manual=explicit)
