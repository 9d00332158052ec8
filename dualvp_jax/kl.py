"""Exact full-vocabulary KL divergence of two vocab-sharded logits, in JAX.

- :func:`kl_divergence`: per shard, inside ``jax.shard_map`` with the
  vocabulary split over ``axis_name`` (or unsharded with ``axis_name=None``).
- :func:`sharded_kl_divergence`: the same on global arrays whose last dim is
  split over a mesh axis.

A ``jax.custom_vjp`` over :mod:`dualvp.kl_spec`: per shard the ``[..., 5]``
statistics of both logits, one ``all_gather(..., to="invarying")`` of them
(the op's only collective), :func:`dualvp.kl_spec.combine_stats` on every
shard; the backward is :func:`dualvp.kl_spec.block_grad` from the saved logits
and the O(T) combined statistics, no collective. On the CPU the statistics are
computed over bounded row chunks and column blocks (:mod:`dualvp_jax.chunks`,
as the log-prob op does: XLA:CPU would otherwise materialise float32 ``[T,
V_local]`` inputs of its reductions); elsewhere XLA fuses the whole shard. The
gradient with respect to ``ref_logits`` is always formed by the backward rule
and dropped by XLA when nothing uses it (under ``jit``).

Outputs are float32 (float64 when either input is float64 under
``jax_enable_x64``), invariant over ``axis_name``; gradients are cast to each
input's dtype. Non-finite semantics: :mod:`dualvp.kl_spec`.
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from dualvp import kl_spec
from dualvp.validation import check_temperature

from . import chunks
from .sharded import is_explicit, lead_spec, mesh_world, place_on_mesh

__all__ = ["kl_divergence", "sharded_kl_divergence"]

_FLOATS = ("float32", "bfloat16", "float16", "float64")


class KLOptions(NamedTuple):
    """The static configuration of one call (hashable: a ``jit`` static argument)."""

    temperature: float
    direction: str
    path: str = "auto"   # "auto" (chunked on the CPU, whole elsewhere), "whole", "chunked"


def _describe(name: str, x, kinds: str):
    """``(shape, dtype name)`` of an array argument, or ``TypeError`` naming it."""
    if isinstance(x, jax.core.Tracer):
        return tuple(x.shape), jnp.dtype(x.dtype).name
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return tuple(int(d) for d in np.shape(x)), jnp.dtype(x.dtype).name
    raise TypeError(f"{name}: expected {kinds}, got {type(x).__name__}")


def _check_varying(name: str, x, axis_name) -> None:
    """Inside shard_map (check_vma) a vocab shard varies over ``axis_name``; with ``check_vma=False`` JAX would
    hand each shard 1/W of the replicated output's cotangent (gradients W times too small)."""
    varying = getattr(getattr(jax.typeof(x), "manual_axis_type", None), "varying", None)
    if varying is None:  # no such type information in this JAX version
        return
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if any(a not in varying for a in names):
        raise ValueError(f"axis_name: expected {name} that vary over mesh axis {axis_name!r} (this shard's vocab "
                         f"columns, inside jax.shard_map with check_vma=True), got {name} varying over "
                         f"{sorted(varying)}")


def _validate(logits, ref_logits, row_mask, temperature, direction) -> KLOptions:
    if isinstance(temperature, (bool, np.bool_, str, bytes)) or isinstance(temperature, jax.core.Tracer) \
            or hasattr(temperature, "shape") and not isinstance(temperature, np.generic):
        raise TypeError(f"temperature: expected a finite float > 0 (a static Python number), "
                        f"got {type(temperature).__name__} {temperature!r}"[:300])
    ls, ld = _describe("logits", logits, "a floating jax.Array or numpy array [..., V_local]")
    rs, rd = _describe("ref_logits", ref_logits, "a floating jax.Array or numpy array shaped like logits")
    if ld not in _FLOATS:
        raise TypeError(f"logits: expected float32, bfloat16, float16 or float64, got {ld}")
    if len(ls) < 1 or ls[-1] < 1:
        raise ValueError(f"logits: expected shape [..., V_local] with V_local >= 1, got {ls}")
    if rd not in _FLOATS:
        raise TypeError(f"ref_logits: expected float32, bfloat16, float16 or float64, got {rd}")
    if rs != ls:
        raise ValueError(f"ref_logits: expected the shape of logits {ls}, got {rs}")
    if row_mask is not None:
        ms, md = _describe("row_mask", row_mask, "None or a bool jax.Array or numpy array [...]")
        if md != "bool":
            raise TypeError(f"row_mask: expected a bool array [...], got {md}")
        if ms != ls[:-1]:
            raise ValueError(f"row_mask: expected the leading shape of logits {ls[:-1]}, got {ms}")
    tau = check_temperature(temperature)
    if not isinstance(direction, str) or direction not in kl_spec.DIRECTIONS:
        raise ValueError(f"direction: expected one of {kl_spec.DIRECTIONS}, got {direction!r}")
    return KLOptions(tau, direction)


def _compute_dtype(*dtypes):
    out = jnp.float32
    for d in dtypes:
        out = jnp.promote_types(out, d)
    return out


def _shard_stats(a, b, tau, cdt, path: str):
    """``kl_spec.block_stats`` of the whole shard ``[..., 5]``; row chunks and column blocks on the CPU."""

    def whole(a, b):
        return kl_spec.block_stats(jnp, a, b, tau, dtype=cdt)

    def blocked(a, b):
        bounds = chunks.column_blocks(a.shape[-1])
        parts = [whole(a[..., i:j], b[..., i:j]) for i, j in bounds]
        return parts[0] if len(parts) == 1 else kl_spec.merge_stats(jnp, jnp.stack(parts), tau, axis=0)

    def chunked(a, b):
        n, v = math.prod(a.shape[:-1]), a.shape[-1]
        rows = chunks.chunk_rows(v)
        out = chunks.map_row_chunks(blocked, (a.reshape(n, v), b.reshape(n, v)), rows)
        return out.reshape(a.shape[:-1] + out.shape[-1:])

    if path == "auto":
        return lax.platform_dependent(a, b, cpu=chunked, default=whole)
    return {"whole": whole, "chunked": chunked}[path](a, b)


def _forward(logits, ref_logits, mask, axis_name, opt: KLOptions):
    cdt = _compute_dtype(logits.dtype, ref_logits.dtype)
    a, b = kl_spec.operands(opt.direction, logits, ref_logits)
    stats = _shard_stats(a, b, opt.temperature, cdt, opt.path)
    # the one collective; to="invarying": the table, and all that follows from it, is the same on every shard
    table = stats[None] if axis_name is None else lax.all_gather(stats, axis_name, axis=0, to="invarying")
    comb = kl_spec.combine_stats(jnp, table, opt.temperature)
    return kl_spec.outputs(jnp, comb, mask), comb


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _op(logits, ref_logits, mask, axis_name, opt: KLOptions):
    return _forward(logits, ref_logits, mask, axis_name, opt)[0]


def _op_fwd(logits, ref_logits, mask, axis_name, opt: KLOptions):
    kl, comb = _forward(logits, ref_logits, mask, axis_name, opt)
    return kl, (logits, ref_logits, mask, comb)  # references to the inputs and O(T) statistics


def _op_bwd(axis_name, opt: KLOptions, res, g):
    logits, ref_logits, mask, comb = res
    cdt = _compute_dtype(logits.dtype, ref_logits.dtype)
    a, b = kl_spec.operands(opt.direction, logits, ref_logits)
    ga, gb = kl_spec.block_grad(jnp, a, b, comb, g, opt.temperature, row_mask=mask, dtype=cdt)
    d_logits, d_ref = (ga, gb) if opt.direction == "forward" else (gb, ga)
    return d_logits.astype(logits.dtype), d_ref.astype(ref_logits.dtype), None


_op.defvjp(_op_fwd, _op_bwd)


def _apply(logits, ref_logits, row_mask, axis_name, opt: KLOptions):
    mask = None if row_mask is None else jnp.asarray(row_mask)
    return _op(jnp.asarray(logits), jnp.asarray(ref_logits), mask, axis_name, opt)


_apply_jit = jax.jit(_apply, static_argnames=("axis_name", "opt"))


def kl_divergence(logits, ref_logits, *, axis_name=None, row_mask=None, temperature: float = 1.0,
                  direction: str = "forward"):
    """Per-row KL divergence over the full vocabulary, from this shard's logits and reference logits.

    ``direction="forward"``: ``KL(p || q)`` with ``p = softmax(logits / tau)``,
    ``q = softmax(ref_logits / tau)`` over all ``W * V_local`` columns;
    ``"reverse"``: ``KL(q || p)``. Call it inside ``jax.shard_map`` with the
    vocabulary split over the mesh axis ``axis_name`` (shard ``r`` holds
    columns ``[r*V_local, (r+1)*V_local)`` of both), or with ``axis_name=None``
    on full logits.

    Args:
      logits: ``[..., V_local]`` float32 / bfloat16 / float16 / float64.
      ref_logits: the same shape and sharding, any of those dtypes.
      axis_name: the mesh axis (or tuple of axes) splitting the vocabulary; ``None``: unsharded.
      row_mask: ``None`` or ``[...]`` bool, the same on every shard: rows where it
        is ``False`` get KL 0 and zero gradients, whatever their logits hold.
      temperature: finite float > 0, a static Python number.
      direction: ``"forward"`` or ``"reverse"``.

    Returns:
      ``[...]`` float32 (float64 if an input is float64), invariant over
      ``axis_name``; differentiable with respect to both logits.

    Raises:
      TypeError / ValueError naming the argument (at trace time).
    """
    opt = _validate(logits, ref_logits, row_mask, temperature, direction)
    if axis_name is not None:
        _check_varying("logits", logits, axis_name)
        _check_varying("ref_logits", ref_logits, axis_name)
    return _apply_jit(logits, ref_logits, row_mask, axis_name=axis_name, opt=opt)


def sharded_kl_divergence(logits, ref_logits, mesh, vocab_axis="tp", *, row_mask=None, temperature: float = 1.0,
                          direction: str = "forward"):
    """:func:`kl_divergence` of global ``[..., V]`` arrays whose vocab is split over the mesh axis ``vocab_axis``.

    ``V`` must divide by the axis size. The leading dims keep their sharding
    over the other axes (explicit-axis meshes read it from the type; auto-axis
    meshes leave it to the compiler), as in
    :func:`dualvp_jax.sharded_logprob_entropy`. ``ref_logits`` and
    ``row_mask`` follow ``logits``. Returns the global ``[...]`` KL, replicated
    over ``vocab_axis``.
    """
    opt = _validate(logits, ref_logits, row_mask, temperature, direction)
    world = mesh_world(mesh, vocab_axis)
    shape = tuple(logits.shape) if isinstance(logits, jax.core.Tracer) else tuple(np.shape(logits))
    if shape[-1] % world:
        raise ValueError(f"logits: expected the vocab size V = logits.shape[-1] divisible by the size {world} "
                         f"of mesh axis {vocab_axis!r}, got shape {shape}")
    ndim = len(shape)
    explicit = is_explicit(mesh, mesh.axis_names)
    if explicit:
        lead = lead_spec(logits, mesh, vocab_axis, ndim)
        logits = place_on_mesh(logits, mesh, P(*lead, vocab_axis), True)
        ref_logits = place_on_mesh(ref_logits, mesh, P(*lead, vocab_axis), True)
        row_mask = place_on_mesh(row_mask, mesh, P(*lead), True)
    else:
        lead = (None,) * (ndim - 1)
        logits, ref_logits = jnp.asarray(logits), jnp.asarray(ref_logits)
        row_mask = None if row_mask is None else jnp.asarray(row_mask)
    return _run(logits, ref_logits, row_mask, mesh=mesh, axis_name=vocab_axis, opt=opt, lead=lead,
                all_manual=explicit)


@partial(jax.jit, static_argnames=("mesh", "axis_name", "opt", "lead", "all_manual"))
def _run(logits, ref_logits, row_mask, *, mesh, axis_name, opt, lead, all_manual):
    has_mask = row_mask is not None
    z_spec, t_spec = P(*lead, axis_name), P(*lead)

    def body(z, r, *m):
        return _apply(z, r, m[0] if has_mask else None, axis_name, opt)

    in_specs = (z_spec, z_spec) + ((t_spec,) if has_mask else ())
    args = (logits, ref_logits) + ((row_mask,) if has_mask else ())
    axis_names = frozenset(mesh.axis_names) if all_manual else frozenset({axis_name})
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=t_spec, axis_names=axis_names,
                         check_vma=True)(*args)
