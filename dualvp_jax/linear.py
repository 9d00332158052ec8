"""Fused LM-head op for JAX: log-prob and entropy from hidden states and the vocab-parallel weight.

:func:`linear_logprob_entropy` (per shard, inside ``jax.shard_map`` or
unsharded) and :func:`sharded_linear_logprob_entropy` (global arrays on a
mesh): argument checks that name the argument, then the blocked
``custom_vjp`` of :mod:`dualvp_jax.linear_blocks`, which never materialises
the ``[T, V_local]`` logits.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Optional

import numpy as np

import jax
import jax.numpy as jnp

from dualvp.validation import Options, check_linear_args

from . import multiprocess
from .function import check_temperature_type, describe, describe_ids, check_ids_range, check_target_range
from .linear_blocks import DEFAULT_MEMORY_BUDGET, apply_jit, Config, axis_world, plan

__all__ = ["linear_logprob_entropy", "sharded_linear_logprob_entropy", "DEFAULT_MEMORY_BUDGET"]


# --- argument handling --------------------------------------------------------


def _varying(x) -> Optional[frozenset]:
    """The mesh axes ``x`` varies over (inside ``shard_map`` with check_vma), or None if unknown."""
    try:
        mat = getattr(jax.typeof(x), "manual_axis_type", None)
    except Exception:  # noqa: BLE001 - not a JAX value
        return None
    v = getattr(mat, "varying", None)
    return None if v is None else frozenset(v)


def _names(axis_name) -> tuple:
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def _check_block(name: str, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected None or an int >= 1, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name}: expected None or an int >= 1, got {value}")


def _validate(hidden, weight, target, keep_mask, *, axis_name, temperature, ignore_index, with_entropy,
              entropy_grad, reduce_hidden_grad, sequence_parallel, token_block, vocab_block, memory_budget,
              world: Optional[int] = None, keep_ids=None) -> Config:
    """Static checks; every error names the argument. Returns the static configuration.

    The checks shared with the torch op (shapes, dtypes, options, flags,
    sequence-parallel divisibility, keep-mask shape, memory budget) are
    :func:`dualvp.validation.check_linear_args`; only what is JAX's own is
    checked here: array types, a static temperature, ``axis_name`` bound by
    an enclosing ``shard_map``, the varying types under it, and the block
    sizes.
    """
    check_temperature_type(temperature)
    hs, hd = describe("hidden", hidden, "a floating jax.Array or numpy array [..., H]")
    ws, wd = describe("weight", weight, "a floating jax.Array or numpy array [V_local, H]")
    ts, td = describe("target", target, "an integer jax.Array or numpy array [...]")
    ks = kd = None
    if keep_mask is not None:
        ks, kd = describe("keep_mask", keep_mask, "None or a bool jax.Array or numpy array [..., V_local]")
    ids_shape, ids_dtype = describe_ids(keep_ids)
    for name, value in (("token_block", token_block), ("vocab_block", vocab_block)):
        _check_block(name, value)
    w = axis_world(axis_name) if world is None else world
    if sequence_parallel is True and axis_name is None and world is None:
        raise ValueError("sequence_parallel: expected False without axis_name (nothing to gather), got True")
    opt = check_linear_args(
        hidden_shape=hs, hidden_dtype=hd, weight_shape=ws, weight_dtype=wd, target_shape=ts, target_dtype=td,
        keep_shape=ks, keep_dtype=kd, temperature=temperature, ignore_index=ignore_index,
        with_entropy=with_entropy, entropy_grad=entropy_grad, reduce_hidden_grad=reduce_hidden_grad,
        sequence_parallel=sequence_parallel, world_size=w, memory_budget=memory_budget, ids_shape=ids_shape,
        ids_dtype=ids_dtype,
    )
    if axis_name is not None:
        _check_types(hidden, weight, axis_name, opt)
    n_rows = int(np.prod(ts, dtype=np.int64))
    tc, bv = plan(n_rows, ws[0], token_block, vocab_block, memory_budget)
    return Config(opt, tc, bv)


def _record(cfg: Config, **arrays) -> dict:
    """What must agree across processes: options, block plan and global shapes and dtypes."""
    return {"options": dataclasses.asdict(cfg.opt), "blocks": [int(cfg.token_block), int(cfg.vocab_block)],
            "arrays": multiprocess.describe_arrays(**arrays)}


def _check_types(hidden, weight, axis_name, opt: Options) -> None:
    """Inside shard_map (check_vma on): the varying axes must fit the flags.

    The types decide how JAX transposes the caller's graph, so a mismatch
    would scale the hidden gradient silently (summed twice, or a partial sum
    taken for the whole); refuse it instead.
    """
    names = _names(axis_name)
    reduce_hidden_grad, sequence_parallel = opt.reduce_hidden_grad, opt.sequence_parallel
    wv, hv = _varying(weight), _varying(hidden)
    if wv is not None and not all(a in wv for a in names):
        raise ValueError(
            f"weight: expected this shard's rows, varying over mesh axis {axis_name!r} (inside jax.shard_map "
            f"with check_vma=True), got weight varying over {sorted(wv)}"
        )
    if hv is None:
        return
    h_varies = all(a in hv for a in names)
    if sequence_parallel and not h_varies:
        raise ValueError(
            f"hidden: with sequence_parallel=True expected this shard's rows, varying over {axis_name!r}, "
            "got hidden that is replicated (invariant) over it"
        )
    if not sequence_parallel and reduce_hidden_grad and h_varies:
        raise ValueError(
            f"hidden: expected hidden replicated (invariant) over {axis_name!r} with reduce_hidden_grad=True, "
            "got hidden varying over it; its cotangent would be summed over the axis twice (by the op and by "
            "the transpose of whatever made it vary): pass reduce_hidden_grad=False"
        )
    if not sequence_parallel and not reduce_hidden_grad and not h_varies:
        raise ValueError(
            f"reduce_hidden_grad: expected True for hidden replicated (invariant) over {axis_name!r}: a partial "
            f"gradient cannot be the cotangent of a replicated value; got False. Make hidden vary first "
            f"(lax.pcast(hidden, {axis_name!r}, to='varying'), whose transpose sums the partial gradients)"
        )


def linear_logprob_entropy(
    hidden,
    weight,
    target,
    *,
    axis_name=None,
    keep_mask=None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    ignore_index: int = -100,
    reduce_hidden_grad: bool = True,
    sequence_parallel: bool = False,
    token_block: Optional[int] = None,
    vocab_block: Optional[int] = None,
    memory_budget: Optional[int] = None,
    validate: bool = True,
    keep_ids=None,
    multi_target: bool = False,
    with_sum_p2: bool = False,
):
    """Log-prob of ``target`` and entropy of ``softmax(hidden @ weight.T / tau)``, fused.

    ``multi_target`` / ``with_sum_p2`` are not implemented in the fused op yet (``True`` raises
    ``NotImplementedError``; :func:`dualvp_jax.logprob_entropy` takes them); neither is a temperature
    array (``TypeError``).

    Call it inside ``jax.shard_map`` (check_vma on) with the vocabulary split
    over ``axis_name`` (shard ``r = lax.axis_index`` holds the weight rows
    ``[r*V_local, (r+1)*V_local)``), or with ``axis_name=None`` on the full
    weight. The logits are never materialised at ``[T, V_local]``: they are
    computed in float32 blocks ``[token_block, vocab_block]``, in the forward
    and again in the backward.

    Args:
      hidden: ``[..., H]`` float32 / bfloat16 / float16 / float64, replicated
        (invariant) over ``axis_name``; with ``sequence_parallel=True`` this
        shard's rows ``[T/W, ..., H]`` of the ``[T, ..., H]`` hidden states
        (varying over ``axis_name``).
      weight: ``[V_local, H]`` this shard's rows of the LM-head weight, same
        dtype as ``hidden``.
      target: ``[...]`` integer *global* token ids in ``[0, W*V_local)`` or
        ``ignore_index``; the full ``[T, ...]`` under sequence parallelism.
      axis_name: the mesh axis (or tuple of axes) splitting the vocabulary;
        ``None``: unsharded.
      keep_mask: ``None`` or ``[..., V_local]`` bool, this shard's columns
        (top-p / top-k replay); the target is always kept; the entropy
        ignores it.
      keep_ids: ``None`` or ``[..., K]`` integer global token ids (padding
        -1; target's shape + ``(K,)``, the full ``[T, ..., K]`` under
        sequence parallelism), the kept set as ids: the alternative to
        ``keep_mask`` (never both), as in :func:`dualvp_jax.logprob_entropy`;
        each block gathers the logits at the kept columns it holds, no mask
        is built.
      temperature: finite float > 0, a static Python number.
      with_entropy: ``False``: the entropy output is ``None``.
      entropy_grad: ``False``: the entropy carries no gradient.
      ignore_index: rows with this target get log-prob 0 and no log-prob
        gradient.
      reduce_hidden_grad: ``True``: the hidden gradient is ``psum``-ed over
        ``axis_name`` in float32 (``hidden`` must be invariant over it).
        ``False``: this shard's partial gradient ``sum_j G_j W_j`` is
        returned (``hidden`` must vary over ``axis_name``, e.g. through
        ``lax.pcast(h, axis_name, to="varying")``, whose transpose sums the
        partials: the reduce of Megatron's copy-to-tensor-parallel region).
      sequence_parallel: ``True``: ``hidden`` holds this shard's rows; they
        are all-gathered in the forward (and again in the backward) and the
        hidden gradient is ``psum_scatter``-ed back to them.
      token_block: rows per logits block; default ``min(T, 4096)``.
      vocab_block: columns per logits block; default from ``memory_budget``.
      memory_budget: bytes of one float32 logits block ``[token_block,
        vocab_block]`` (default :data:`DEFAULT_MEMORY_BUDGET`, 2 MiB); the
        scratch of the op is a small multiple of it plus the float32
        ``[T, H]`` accumulator of the hidden gradient.
      validate: as in :func:`dualvp_jax.logprob_entropy`: range-check a
        concrete target (and, with ``axis_name=None`` on arrays spanning
        several JAX processes, agree across them); ``False``: no check, NaN
        rows for out-of-range ids.

    Returns:
      ``(logprob, entropy)``, each of target's shape, float32 (float64 for
      float64 inputs under ``jax_enable_x64``), invariant over ``axis_name``;
      ``entropy`` is ``None`` when ``with_entropy=False``. Gradients come back
      in the inputs' dtypes.

    Raises:
      TypeError / ValueError naming the argument for bad shapes, dtypes,
      options or varying types (at trace time, before any collective), and
      ``ValueError`` for out-of-range concrete targets with ``axis_name=None``.
      A traced out-of-range target gives NaN log-prob and entropy for its row
      and a NaN hidden gradient row, which also makes ``dW`` NaN.
    """
    multiprocess.check_flag(validate)
    _not_yet(multi_target, with_sum_p2)

    def checks():
        cfg = _validate(hidden, weight, target, keep_mask, axis_name=axis_name, temperature=temperature,
                        ignore_index=ignore_index, with_entropy=with_entropy, entropy_grad=entropy_grad,
                        reduce_hidden_grad=reduce_hidden_grad, sequence_parallel=sequence_parallel,
                        token_block=token_block, vocab_block=vocab_block, memory_budget=memory_budget,
                        keep_ids=keep_ids)
        if validate and axis_name is None:
            check_ids_range(keep_ids, int(weight.shape[0]))
        return cfg, int(weight.shape[0])

    procs = (multiprocess.processes_of(hidden, weight, target, keep_mask, keep_ids)
             if validate and axis_name is None else ())
    if len(procs) > 1:
        cfg = multiprocess.checked(procs, "linear_logprob_entropy", checks, target, ignore_index,
                                   lambda cfg: _record(cfg, hidden=hidden, weight=weight, target=target,
                                                       keep_mask=keep_mask, keep_ids=keep_ids))
    else:
        cfg, vocab = checks()
        if validate and axis_name is None:
            check_target_range(target, vocab, ignore_index, processes=procs)
    # One "keep" argument: the mask, or the ids (cfg.opt.has_ids says which).
    return apply_jit(hidden, weight, target, keep_ids if cfg.opt.has_ids else keep_mask, axis_name=axis_name,
                      cfg=cfg)


def _not_yet(multi_target, with_sum_p2) -> None:
    for name, on in (("multi_target", multi_target), ("with_sum_p2", with_sum_p2)):
        if on is not False:
            raise NotImplementedError(
                f"{name}: the fused LM-head op does not take it yet, got {on!r}; form the logits and call "
                "dualvp_jax.logprob_entropy, which does"
            )


# --- global arrays on a mesh ----------------------------------------------------


def sharded_linear_logprob_entropy(
    hidden,
    weight,
    target,
    mesh,
    vocab_axis="tp",
    *,
    keep_mask=None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    entropy_grad: bool = True,
    ignore_index: int = -100,
    sequence_parallel: bool = False,
    token_block: Optional[int] = None,
    vocab_block: Optional[int] = None,
    memory_budget: Optional[int] = None,
    validate: bool = True,
    keep_ids=None,
    multi_target: bool = False,
    with_sum_p2: bool = False,
):
    """:func:`linear_logprob_entropy` on global arrays, the weight's rows split over ``vocab_axis``.

    ``multi_target`` / ``with_sum_p2``: not implemented yet (``NotImplementedError``).

    Args:
      hidden: ``[..., H]`` global hidden states. Replicated over
        ``vocab_axis`` inside the op; its leading dims keep the sharding they
        have over the other mesh axes (tokens split over a data-parallel
        axis stay split: each data-parallel replica computes its own rows).
        With ``sequence_parallel=True`` its first dim ``T`` is split over
        ``vocab_axis`` as well (after any data-parallel axes it is split
        over; ``T`` divisible by the product).
      weight: ``[V, H]`` global LM-head weight; ``V`` divisible by the size
        ``W`` of ``vocab_axis``; shard ``r`` holds rows ``[r*V/W, (r+1)*V/W)``.
      target: ``[...]`` global token ids in ``[0, V)`` or ``ignore_index``;
        sharded like the leading dims of ``hidden`` inside the op.
      mesh: a ``jax.sharding.Mesh`` (explicit axes from ``jax.make_mesh``, or
        auto axes).
      vocab_axis: the mesh axis splitting the vocabulary.
      keep_mask: ``None`` or ``[..., V]`` bool, split like the vocabulary.
      keep_ids: ``None`` or ``[..., K]`` global token ids (padding -1), the
        kept set as ids (never with ``keep_mask``); sharded like the leading
        dims of ``hidden`` and replicated over ``vocab_axis``.
      temperature, with_entropy, entropy_grad, ignore_index, token_block,
        vocab_block, memory_budget: as in :func:`linear_logprob_entropy`
        (the block sizes are per shard).
      validate: as in :func:`dualvp_jax.sharded_logprob_entropy` (range
        check of a concrete target on each process's addressable shards;
        agreement across the JAX processes of ``mesh``).

    Returns:
      ``(logprob, entropy)`` global arrays of target's shape, sharded like the
      leading dims of ``hidden`` and replicated over ``vocab_axis``
      (``entropy`` ``None`` when ``with_entropy=False``).

    Raises:
      TypeError / ValueError naming the argument; ``ValueError`` for
      out-of-range concrete targets (``validate`` on); ``RuntimeError`` on
      every process when the processes of ``mesh`` disagree.
    """
    from jax.sharding import PartitionSpec as P

    from .sharded import is_explicit, lead_spec, mesh_record, mesh_world, place_on_mesh, mesh_processes

    multiprocess.check_flag(validate)
    _not_yet(multi_target, with_sum_p2)

    def checks():
        world = mesh_world(mesh, vocab_axis)
        # The global shapes first (world=1: hidden and target have the same T, also with sequence_parallel).
        cfg = _validate(hidden, weight, target, keep_mask, axis_name=None, temperature=temperature,
                        ignore_index=ignore_index, with_entropy=with_entropy, entropy_grad=entropy_grad,
                        reduce_hidden_grad=True, sequence_parallel=sequence_parallel, token_block=token_block,
                        vocab_block=vocab_block, memory_budget=memory_budget, world=1, keep_ids=keep_ids)
        if validate:
            check_ids_range(keep_ids, int(weight.shape[0]))
        ws, hs = tuple(weight.shape), tuple(hidden.shape)
        if ws[0] % world:
            raise ValueError(
                f"weight: expected the vocab size V = weight.shape[0] divisible by the size {world} of mesh axis "
                f"{vocab_axis!r}, got shape {ws}"
            )
        explicit = is_explicit(mesh, mesh.axis_names)
        # Explicit axes: the leading dims keep hidden's sharding over the other
        # axes (data parallelism); the vocab axis never splits them.
        lead = lead_spec(hidden, mesh, vocab_axis, len(hs)) if explicit else (None,) * (len(hs) - 1)
        split = world * math.prod(int(mesh.shape[a]) for a in _axes(lead[0] if lead else None))
        if sequence_parallel and (len(hs) < 2 or hs[0] % split):
            raise ValueError(
                f"hidden: with sequence_parallel=True expected shape [T, ..., H] with T divisible by {split} (the "
                f"size {world} of mesh axis {vocab_axis!r} times the data-parallel split of T), got shape {hs}"
            )
        return (cfg, ws, hs, explicit, lead), ws[0]

    procs = mesh_processes(mesh, hidden, weight, target, keep_mask, keep_ids) if validate else ()
    if len(procs) > 1:
        _, ws, hs, explicit, lead = multiprocess.checked(
            procs, "sharded_linear_logprob_entropy", checks, target, ignore_index,
            lambda r: dict(_record(r[0], hidden=hidden, weight=weight, target=target, keep_mask=keep_mask,
                                   keep_ids=keep_ids),
                           mesh=mesh_record(mesh), vocab_axis=str(vocab_axis), lead=[str(e) for e in r[4]]))
    else:
        (_, ws, hs, explicit, lead), vocab = checks()
        if validate:
            check_target_range(target, vocab, ignore_index, processes=procs)
    if sequence_parallel:
        # rows split over the data-parallel axes of T first, then over the vocab axis: an
        # all-gather over vocab_axis inside the op gives this data-parallel block's rows
        rows = _axes(lead[0]) + (vocab_axis,)
        h_spec = P(rows if len(rows) > 1 else vocab_axis, *lead[1:])
    else:
        h_spec = P(*lead)
    has_ids = keep_ids is not None
    # keep_ids: global ids, replicated over the vocab axis (every shard picks its own).
    specs = (h_spec, P(vocab_axis, None), P(*lead), P(*lead, None if has_ids else vocab_axis))
    args = [hidden, weight, target, keep_ids if has_ids else keep_mask]
    args = [place_on_mesh(a, mesh, s, explicit) if explicit else (None if a is None else jnp.asarray(a))
            for a, s in zip(args, specs)]
    static = dict(temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad, has_ids=has_ids,
                  ignore_index=ignore_index, sequence_parallel=sequence_parallel, token_block=token_block,
                  vocab_block=vocab_block, memory_budget=memory_budget)
    lp, h = _run(*args, mesh=mesh, axis_name=vocab_axis, specs=specs, all_manual=explicit,
                 static=tuple(sorted(static.items())))
    return lp, (h if with_entropy else None)


def _axes(entry) -> tuple:
    """The mesh axes of one PartitionSpec entry, as a tuple."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


@partial(jax.jit, static_argnames=("mesh", "axis_name", "specs", "all_manual", "static"))
def _run(hidden, weight, target, keep_mask, *, mesh, axis_name, specs, all_manual, static):
    kw = dict(static)
    has_mask = keep_mask is not None
    keep_name = "keep_ids" if kw.pop("has_ids") else "keep_mask"

    def body(h, w, y, *k):
        lp, ent = linear_logprob_entropy(h, w, y, axis_name=axis_name, **{keep_name: k[0] if has_mask else None},
                                         **kw)
        return (lp, ent) if kw["with_entropy"] else (lp,)

    t_spec = specs[2]
    in_specs = specs[:3] + ((specs[3],) if has_mask else ())
    out_specs = (t_spec, t_spec) if kw["with_entropy"] else (t_spec,)
    args = (hidden, weight, target) + ((keep_mask,) if has_mask else ())
    axis_names = frozenset(mesh.axis_names) if all_manual else frozenset({axis_name})
    out = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=axis_names,
                        check_vma=True)(*args)
    return out[0], (out[1] if kw["with_entropy"] else None)
