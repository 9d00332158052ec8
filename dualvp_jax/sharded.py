"""Global-array entry point: ``shard_map`` of the per-shard op over a mesh.

``logits [..., V]`` is split on its last dimension over the mesh axis
``vocab_axis``; its leading dimensions keep whatever sharding they already
have over the other mesh axes (for example tokens split over a data-parallel
axis). On a mesh with explicit axes (``jax.make_mesh``'s default) that
sharding is read from the array's type and the whole mesh is manual inside
the op; on a mesh with auto axes only ``vocab_axis`` is manual
(``shard_map(axis_names={vocab_axis})``) and the compiler partitions the
leading dims over the other axes. ``target`` and
``keep_mask`` follow the logits; ``keep_ids`` (global ids) follows the
leading dims and is replicated over ``vocab_axis``. Outputs are sharded like the leading
dimensions of the logits and replicated over ``vocab_axis``.
"""

from __future__ import annotations

from functools import partial

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from ._tuning import DEFAULT, Tuning
from . import extended, multiprocess
from .function import (
    apply_op, call_record, check_ids_range, check_target_range, check_temperature_values, validated_options,
)

__all__ = ["sharded_logprob_entropy"]


def _axes_of(entry):
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _current_spec(x, mesh):
    """The PartitionSpec of ``x`` over ``mesh`` if known, else ``None``."""
    try:
        sh = jax.typeof(x).sharding
        if isinstance(sh, NamedSharding) and tuple(sh.mesh.axis_names) == tuple(mesh.axis_names):
            if any(e is not None for e in sh.spec):
                return sh.spec
    except Exception:  # noqa: BLE001 - not a JAX value / no typed sharding
        pass
    sh = getattr(x, "sharding", None) if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) else None
    if isinstance(sh, NamedSharding) and tuple(sh.mesh.axis_names) == tuple(mesh.axis_names):
        return sh.spec
    return None


def lead_spec(logits, mesh, vocab_axis, ndim: int) -> tuple:
    """Leading-dim spec entries: the logits' own, minus any use of ``vocab_axis``."""
    cur = _current_spec(logits, mesh)
    lead = [None] * (ndim - 1)
    if cur is None:
        return tuple(lead)
    cur = tuple(cur) + (None,) * (ndim - len(tuple(cur)))
    for i in range(ndim - 1):
        axes = tuple(a for a in _axes_of(cur[i]) if a != vocab_axis)
        lead[i] = None if not axes else (axes[0] if len(axes) == 1 else axes)
    return tuple(lead)


def mesh_world(mesh, vocab_axis) -> int:
    """The size ``W`` of ``vocab_axis`` in ``mesh``; ``TypeError`` / ``ValueError`` naming the argument otherwise."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    if vocab_axis not in mesh.axis_names:
        raise ValueError(f"vocab_axis: expected one of the mesh axes {tuple(mesh.axis_names)}, got {vocab_axis!r}")
    return int(mesh.shape[vocab_axis])


def mesh_processes(mesh, *arrays) -> tuple:
    """The JAX processes of ``mesh`` and the arrays (:func:`dualvp_jax.multiprocess.processes_of`).

    A ``mesh`` that is not a ``Mesh`` counts for nothing here: the local
    check names it.
    """
    return multiprocess.processes_of(*arrays, mesh=mesh if isinstance(mesh, Mesh) else None)


def mesh_record(mesh) -> dict:
    """The mesh as the processes must agree on it: axis names, sizes and types."""
    return {"axes": [str(a) for a in mesh.axis_names], "shape": [int(mesh.shape[a]) for a in mesh.axis_names],
            "types": [str(t) for t in (getattr(mesh, "axis_types", ()) or ())]}


def is_explicit(mesh, axes) -> bool:
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()) or ()))
    return any(types.get(a) == AxisType.Explicit for a in axes)


def place_on_mesh(x, mesh, spec, explicit: bool):
    """Give ``x`` the sharding ``spec`` (needed by shard_map on explicit axes)."""
    if x is None:
        return None
    x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
    if explicit:
        cur = _current_spec(x, mesh)
        if cur is None or tuple(cur) + (None,) * (x.ndim - len(tuple(cur))) != tuple(spec):
            x = jax.reshard(x, NamedSharding(mesh, spec))
    return x


def sharded_logprob_entropy(
    logits,
    target,
    mesh,
    vocab_axis="tp",
    *,
    keep_mask=None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    ignore_index: int = -100,
    validate: bool = True,
    keep_ids=None,
    multi_target: bool = False,
    with_sum_p2: bool = False,
):
    """Log-prob and entropy of global logits whose vocab is split over ``vocab_axis``.

    Args:
      logits: ``[..., V]`` global array; ``V`` divisible by the size of
        ``vocab_axis``. Shard ``r`` of the axis holds columns
        ``[r*V/W, (r+1)*V/W)``.
      target: ``[...]`` global token ids in ``[0, V)`` or ``ignore_index``.
      mesh: a ``jax.sharding.Mesh`` (from ``jax.make_mesh``, explicit axes, or
        ``Mesh(...)``, auto axes).
      vocab_axis: name of the mesh axis splitting the vocabulary.
      keep_mask, temperature, with_entropy, entropy_grad, ignore_index, multi_target, with_sum_p2: as in
        :func:`dualvp_jax.logprob_entropy` (a temperature array is broadcast
        to the rows and sharded like them; with ``multi_target`` the target
        is ``[..., K]`` and its K dim is not split).
      keep_ids: ``None`` or ``[..., K]`` global token ids (padding -1), the
        kept set as ids (as in :func:`dualvp_jax.logprob_entropy`; never with
        ``keep_mask``); replicated over ``vocab_axis`` inside the op, each
        shard uses the ids in its columns.
      validate: ``True``: a concrete ``target`` is range-checked on the host
        (each process reads only its addressable shards); when ``mesh`` spans
        several JAX processes (``jax.distributed``), the processes also
        agree on the options, the global shapes and dtypes and every
        process's checks before the op runs, so that they all raise the same
        error or none does (:mod:`dualvp_jax.multiprocess`: a few small RPCs
        to the coordinator per eager call, once per trace under ``jit``).
        ``False``: no check, no synchronisation, no agreement; out-of-range
        ids give NaN rows on every process.

    Returns:
      ``(logprob, entropy)`` global ``[...]`` arrays (``entropy`` ``None``
      when ``with_entropy=False``; ``logprob`` ``[..., K]`` with
      ``multi_target``), plus ``sum_p2 [...]`` with ``with_sum_p2``.

    Raises:
      TypeError / ValueError naming the argument; ``ValueError`` for
      out-of-range targets when ``target`` is concrete (not traced) and
      ``validate`` is on; ``RuntimeError`` on every process when the
      processes of ``mesh`` disagree (or one of them never arrives within
      ``dualvp_jax.multiprocess.timeout_s()``).
    """
    return _sharded_logprob_entropy(logits, target, mesh, vocab_axis, keep_mask, temperature, with_entropy,
                                    entropy_grad, ignore_index, DEFAULT, validate=validate,
                                    multi_target=multi_target, with_sum_p2=with_sum_p2, keep_ids=keep_ids)


def _sharded_logprob_entropy(logits, target, mesh, vocab_axis, keep_mask, temperature, with_entropy, entropy_grad,
                             ignore_index, tuning: Tuning, validate: bool = True, multi_target: bool = False,
                             with_sum_p2: bool = False, keep_ids=None):
    """:func:`sharded_logprob_entropy` with an explicit :class:`~dualvp_jax._tuning.Tuning`."""
    multiprocess.check_flag(validate)

    def checks():
        opt = validated_options(logits, target, keep_mask, temperature, ignore_index, with_entropy, entropy_grad,
                        multi_target, with_sum_p2, keep_ids)
        world = mesh_world(mesh, vocab_axis)
        shape = tuple(np.shape(logits)) if not isinstance(logits, jax.core.Tracer) else tuple(logits.shape)
        if shape[-1] % world:
            raise ValueError(
                f"logits: expected the vocab size V = logits.shape[-1] divisible by the size {world} "
                f"of mesh axis {vocab_axis!r}, got shape {shape}"
            )
        if validate:
            check_ids_range(keep_ids, shape[-1])
            check_temperature_values(temperature)
        return (opt, shape), shape[-1]

    procs = mesh_processes(mesh, logits, target, keep_mask, keep_ids, temperature) if validate else ()
    if len(procs) > 1:
        opt, shape = multiprocess.checked(
            procs, "sharded_logprob_entropy", checks, target, ignore_index,
            lambda r: dict(call_record(r[0], logits=logits, target=target, keep_mask=keep_mask, keep_ids=keep_ids),
                           mesh=mesh_record(mesh), vocab_axis=str(vocab_axis)))
    else:
        (opt, shape), vocab = checks()
        if validate:
            check_target_range(target, vocab, ignore_index, processes=procs)

    ndim = len(shape)
    tau = None
    if opt.row_temperature:
        tau = jnp.broadcast_to(jnp.asarray(temperature), shape[:-1])
    explicit = is_explicit(mesh, mesh.axis_names)
    if explicit:
        # Explicit axes: the leading dims' sharding is part of the type, even under
        # jit; the whole mesh goes manual and the inputs are resharded to the spec.
        lead = lead_spec(logits, mesh, vocab_axis, ndim)
        logits = place_on_mesh(logits, mesh, P(*lead, vocab_axis), True)
        target = place_on_mesh(target, mesh, P(*lead, None) if opt.n_targets else P(*lead), True)
        keep_mask = place_on_mesh(keep_mask, mesh, P(*lead, vocab_axis), True)
        keep_ids = place_on_mesh(keep_ids, mesh, P(*lead, None), True)
        tau = place_on_mesh(tau, mesh, P(*lead), True)
    else:
        # Auto axes: only the vocab axis goes manual; the compiler keeps the
        # leading dims sharded as they come over the other axes.
        lead = (None,) * (ndim - 1)
        logits, target = jnp.asarray(logits), jnp.asarray(target)
        keep_mask = None if keep_mask is None else jnp.asarray(keep_mask)
        keep_ids = None if keep_ids is None else jnp.asarray(keep_ids)
    if extended.uses_extended(opt):
        # check_args refuses keep_ids with the extended options: keep_mask is the mask here
        lp, h, p2 = _run_ext(logits, target, keep_mask, tau, mesh=mesh, axis_name=vocab_axis, opt=opt, lead=lead,
                             all_manual=explicit, tuning=tuning)
        return (lp, h, p2) if opt.with_sum_p2 else (lp, h)
    # One "keep" argument: the mask, or the ids (opt.has_ids says which).
    keep = keep_ids if opt.has_ids else keep_mask
    lp, h = _run(logits, target, keep, mesh=mesh, axis_name=vocab_axis, opt=opt, lead=lead, all_manual=explicit,
                 tuning=tuning)
    return lp, (h if with_entropy else None)


@partial(jax.jit, static_argnames=("mesh", "axis_name", "opt", "lead", "all_manual", "tuning"))
def _run_ext(logits, target, keep_mask, tau, *, mesh, axis_name, opt, lead, all_manual, tuning):
    """:func:`_run` of the extended op (:mod:`dualvp_jax.extended`): K targets, a temperature array, sum p^2."""
    present = [a is not None for a in (keep_mask, tau)]
    z_spec, t_spec = P(*lead, axis_name), P(*lead)
    y_spec = P(*lead, None) if opt.n_targets else t_spec
    outs = [y_spec] + ([t_spec] if opt.with_entropy else []) + ([t_spec] if opt.with_sum_p2 else [])

    def body(z, y, *rest):
        it = iter(rest)
        k = next(it) if present[0] else None
        t = next(it) if present[1] else None
        lp, h, p2 = extended.ext_apply(z, y, k, t, axis_name, opt, tuning)
        return tuple([lp] + ([h] if opt.with_entropy else []) + ([p2] if opt.with_sum_p2 else []))

    opt_args = [a for a in (keep_mask, tau) if a is not None]
    opt_specs = [s for s, a in ((z_spec, keep_mask), (t_spec, tau)) if a is not None]
    axis_names = frozenset(mesh.axis_names) if all_manual else frozenset({axis_name})
    out = jax.shard_map(body, mesh=mesh, in_specs=(z_spec, y_spec, *opt_specs), out_specs=tuple(outs),
                        axis_names=axis_names, check_vma=True)(logits, target, *opt_args)
    lp = out[0]
    h = out[1] if opt.with_entropy else None
    p2 = out[-1] if opt.with_sum_p2 else None
    return lp, h, p2


@partial(jax.jit, static_argnames=("mesh", "axis_name", "opt", "lead", "all_manual", "tuning"))
def _run(logits, target, keep_mask, *, mesh, axis_name, opt, lead, all_manual, tuning):
    # jit here so that eager calls are one compiled program, not op-by-op
    # dispatch; under an outer jit it is inlined.
    has_mask = keep_mask is not None
    z_spec, t_spec = P(*lead, axis_name), P(*lead)
    # keep_ids: global ids, replicated over the vocab axis (every shard picks its own).
    k_spec = P(*lead, None) if opt.has_ids else z_spec

    def body(z, y, *k):
        lp, h = apply_op(z, y, k[0] if has_mask else None, axis_name, opt, tuning)
        return (lp, h) if opt.with_entropy else (lp,)

    in_specs = (z_spec, t_spec) + ((k_spec,) if has_mask else ())
    out_specs = (t_spec, t_spec) if opt.with_entropy else (t_spec,)
    args = (logits, target) + ((keep_mask,) if has_mask else ())
    axis_names = frozenset(mesh.axis_names) if all_manual else frozenset({axis_name})
    out = jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=axis_names, check_vma=True
    )(*args)
    return out[0], (out[1] if opt.with_entropy else None)
