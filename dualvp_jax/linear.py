"""Fused LM-head op for JAX: log-prob and entropy from hidden states and the vocab-parallel weight.

The logits ``z = h W_r^T`` of this shard are never materialised at
``[T, V_local]``; they are made one block ``[token_block, vocab_block]`` at a
time, and everything else is the math of :mod:`dualvp.spec`, block by block::

    forward, per token chunk, over vocab blocks (nested lax.fori_loop):
        stats  = spec.reduce_stats(spec.block_stats(z_block) ...)    [T, 6]  O(T)
    table = all_gather(stats, axis_name, to="invarying")          the only collective
    comb  = spec.finalize(spec.reduce_stats(table)); spec.outputs(comb)

    backward, per vocab block j (outer), per token chunk i (inner):
        z_ij = h_i W_j^T (recomputed)      G_ij = spec.block_grad(z_ij)   float32
        dh_i += G_ij W_j                    dW_j += G_ij^T h_i            float32
    dh: psum over axis_name (reduce_hidden_grad=True, in float32), or the
        partial sum (False), or psum_scatter (sequence_parallel=True).

Residuals for the backward: the inputs (references) and the O(T) combined
statistics. The loop order is vocabulary-major in the backward, so the
float32 accumulators are ``dh [T, H]`` (needed whole anyway for the float32
reduce over ``axis_name``) and one ``dW_j [vocab_block, H]``; ``dW`` is
written block by block into its output buffer.

Frozen weight or frozen hidden (``jax.grad`` w.r.t. one of them, under
``jit``): the backward's unused accumulator is dead code, and XLA drops its
GEMM (and, for a frozen hidden, the ``psum`` of ``dh``); the compiled HLO then
has no ``dW`` (resp. ``dh``) dot, pinned by
``tests/jax/test_jax_linear.py::test_frozen_input_skips_its_gemm``.

Blocks that do not divide the sizes: the last token chunk and the last
vocabulary block are a separate, smaller block of static shape (never a
padded or overlapping one), so no padded column or row ever enters a sum.

Precision: logits blocks are float32 (float64 for float64 inputs) from
``lax.dot_general(..., preferred_element_type=float32, precision=HIGHEST)``,
also for bfloat16 operands; the gradient blocks ``G`` are float32 and the
backward GEMMs take float32 ``G`` against the (exactly up-cast) bfloat16
operands; ``dh`` and ``dW`` accumulate in float32 and are cast to the inputs'
dtypes once, at the end (``dW`` block by block: each ``dW_j`` is complete).

Memory (XLA ``memory_analysis`` temp bytes of forward + backward, beyond the
arguments and returned gradients; T=2048, H=1024, V_local=32000, default
budget): 0.044 B in float32 and 0.20 B in bfloat16 (B: the logits shard in the
input dtype); the bfloat16 figure includes the float32 ``dh`` accumulator
(``T * H * 4``), which for float32 is the returned gradient itself.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from dualvp import spec
from dualvp.validation import Options, check_linear_args

from . import function as _function
from .function import (
    _check_temperature_type,
    _compute_dtype,
    _describe,
    _int_dtype,
    _outputs,
    _shard_position,
    _gather,
    check_target_range,
)

__all__ = ["linear_logprob_entropy", "sharded_linear_logprob_entropy", "DEFAULT_MEMORY_BUDGET"]

#: Default bytes of one float32 logits block ``[token_block, vocab_block]``.
#: The op's scratch is a small multiple of it (the block, its gradient and
#: XLA's fused temporaries) plus the float32 ``[T, H]`` accumulator of ``dh``.
DEFAULT_MEMORY_BUDGET = 2 * 2**20
#: Default longest token chunk (rows of one block).
_DEFAULT_TOKEN_BLOCK = 4096
#: Vocabulary blocks are a multiple of this many columns (unless V_local is smaller).
_VOCAB_ALIGN = 128


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static configuration of one call (hashable, a ``jit`` static argument).

    The shared :class:`~dualvp.validation.Options` (the same object the torch
    op carries and the agreement record is made from) plus the JAX block sizes.
    """

    opt: Options
    token_block: int
    vocab_block: int


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


def _world(axis_name) -> int:
    if axis_name is None:
        return 1
    try:
        return int(lax.axis_size(axis_name))
    except NameError:
        raise ValueError(
            f"axis_name: expected a mesh axis bound by an enclosing jax.shard_map (or None), got {axis_name!r}"
        ) from None


def _validate(hidden, weight, target, keep_mask, *, axis_name, temperature, ignore_index, with_entropy,
              entropy_grad, reduce_hidden_grad, sequence_parallel, token_block, vocab_block, memory_budget,
              world: Optional[int] = None) -> _Config:
    """Static checks; every error names the argument. Returns the static configuration.

    The checks shared with the torch op (shapes, dtypes, options, flags,
    sequence-parallel divisibility, keep-mask shape, memory budget) are
    :func:`dualvp.validation.check_linear_args`; only what is JAX's own is
    checked here: array types, a static temperature, ``axis_name`` bound by
    an enclosing ``shard_map``, the varying types under it, and the block
    sizes.
    """
    _check_temperature_type(temperature)
    hs, hd = _describe("hidden", hidden, "a floating jax.Array or numpy array [..., H]")
    ws, wd = _describe("weight", weight, "a floating jax.Array or numpy array [V_local, H]")
    ts, td = _describe("target", target, "an integer jax.Array or numpy array [...]")
    ks = kd = None
    if keep_mask is not None:
        ks, kd = _describe("keep_mask", keep_mask, "None or a bool jax.Array or numpy array [..., V_local]")
    for name, value in (("token_block", token_block), ("vocab_block", vocab_block)):
        _check_block(name, value)
    w = _world(axis_name) if world is None else world
    if sequence_parallel is True and axis_name is None and world is None:
        raise ValueError("sequence_parallel: expected False without axis_name (nothing to gather), got True")
    opt = check_linear_args(
        hidden_shape=hs, hidden_dtype=hd, weight_shape=ws, weight_dtype=wd, target_shape=ts, target_dtype=td,
        keep_shape=ks, keep_dtype=kd, temperature=temperature, ignore_index=ignore_index,
        with_entropy=with_entropy, entropy_grad=entropy_grad, reduce_hidden_grad=reduce_hidden_grad,
        sequence_parallel=sequence_parallel, world_size=w, memory_budget=memory_budget,
    )
    if axis_name is not None:
        _check_types(hidden, weight, axis_name, opt)
    n_rows = int(np.prod(ts, dtype=np.int64))
    tc, bv = _plan(n_rows, ws[0], token_block, vocab_block, memory_budget)
    return _Config(opt, tc, bv)


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


def _plan(n_rows: int, v_local: int, token_block, vocab_block, memory_budget) -> tuple:
    """``(token_block, vocab_block)``: explicit sizes, else from the memory budget.

    ``token_block`` defaults to ``min(T, 4096)``; ``vocab_block`` to the
    largest multiple of 128 columns whose float32 block ``[token_block,
    vocab_block]`` fits ``memory_budget`` bytes (at least 128), both capped
    by the actual sizes.
    """
    budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else int(memory_budget)
    tc = int(token_block) if token_block is not None else _DEFAULT_TOKEN_BLOCK
    tc = max(1, min(tc, n_rows))
    if vocab_block is not None:
        bv = int(vocab_block)
    else:
        bv = max(_VOCAB_ALIGN, (budget // (4 * tc)) // _VOCAB_ALIGN * _VOCAB_ALIGN)
    return tc, max(1, min(bv, v_local))


# --- the blocks ---------------------------------------------------------------


def _dot(a, b, contract, cdt):
    # float32 (float64) result from any operand dtype; HIGHEST so that an
    # accelerator does not drop float32 operands to bf16/tf32 passes.
    return lax.dot_general(a, b, (contract, ((), ())), precision=lax.Precision.HIGHEST, preferred_element_type=cdt)


def _logits(h, w, cdt):
    """``h [n, H] @ w [m, H]^T`` -> ``[n, m]`` in the compute dtype."""
    return _dot(h, w, ((1,), (1,)), cdt)


def _vary(x, axis_name):
    # Fresh constants (loop-carry inits) are invariant; the carried values
    # vary like the weight, and a loop carry must keep its type.
    return x if axis_name is None else lax.pcast(x, axis_name, to="varying")


def _slice(x, start, size, axis=0):
    if x is None:
        return None
    if isinstance(start, int):
        return lax.slice_in_dim(x, start, start + size, axis=axis)
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _over_blocks(n: int, size: int, step, carry, operands=(), lo: int = 0):
    """``carry = step(carry, operands, start, size)`` over the blocks ``[start, start+size)`` of ``range(n)``.

    The full blocks from number ``lo`` on run in a ``lax.fori_loop``
    (``start`` traced); the last, smaller block, if any, runs once with a
    static ``start`` and its own static size, so no padded element ever
    exists.

    ``operands`` (hidden, weight) are sliced by ``step``. They travel in the
    loop carry through an optimisation barrier, so that XLA sees them as
    loop-variant: otherwise a backend that up-casts bf16 GEMM operands
    (XLA:CPU) hoists the cast out of the loop as one float32 copy of the
    whole weight (``V_local * H * 4`` bytes). Carried unchanged, they cost
    no copy.
    """
    nfull, rem = divmod(n, size)
    if nfull - lo == 1:
        carry = step(carry, operands, lo * size, size)
    elif nfull - lo > 1:
        def body(j, c):
            acc, ops = c
            # One barrier per operand: a joint one would merge their varying axes.
            ops = tuple(lax.optimization_barrier(o) for o in ops)
            return step(acc, ops, j * size, size), ops

        carry, _ = lax.fori_loop(lo, nfull, body, (carry, operands))
    if rem:
        carry = step(carry, operands, nfull * size, rem)
    return carry


def _row_stats(h, w, keep, local, owns, cfg: _Config, cdt):
    """``[n, N_STATS]`` statistics of the rows ``h [n, H]`` over all columns of ``w [V_local, H]``.

    ``spec.block_stats`` needs a static ``start`` (it builds the block's
    column ids with ``arange``); inside the loop the target's column is made
    block-relative instead (``local - start``, with ``start=0``), which is the
    same test ``column == local``.
    """
    tau = cfg.opt.temperature

    def stats(w, j0, size):
        z = _logits(h, _slice(w, j0, size), cdt)
        k = _slice(keep, j0, size, 1)
        if isinstance(j0, int):
            return spec.block_stats(jnp, z, local, owns, k, tau, start=j0, dtype=cdt)
        return spec.block_stats(jnp, z, local - j0, owns, k, tau, start=0, dtype=cdt)

    def step(acc, ops, j0, size):
        return spec.merge_stats(jnp, acc, stats(ops[0], j0, size), tau)

    first = stats(w, 0, min(cfg.vocab_block, w.shape[0]))
    return _over_blocks(w.shape[0], cfg.vocab_block, step, first, (w,), lo=1)


def _all_stats(h, w, keep, local, owns, cfg: _Config, cdt, axis_name):
    """``[T, N_STATS]`` statistics of every row, token chunk by token chunk."""
    T = h.shape[0]
    out = _vary(jnp.zeros((T, spec.N_STATS), cdt), axis_name)
    if T == 0:
        return out

    def step(out, ops, i0, n):
        h, w = ops
        st = _row_stats(_slice(h, i0, n), w, _slice(keep, i0, n), _slice(local, i0, n), _slice(owns, i0, n),
                        cfg, cdt)
        return lax.dynamic_update_slice_in_dim(out, st, i0, axis=0)

    return _over_blocks(T, cfg.token_block, step, out, (h, w))


# --- the op -------------------------------------------------------------------


def _gather_hidden(h, axis_name, cfg: _Config):
    if not cfg.opt.sequence_parallel:
        return h
    # Sequence parallel: this shard's T/W rows -> all T rows, identical everywhere.
    return lax.all_gather(h, axis_name, axis=0, tiled=True, to="invarying")


def _flat(h, target, keep):
    """``[T, H]``, ``[T]``, ``[T, V_local]`` views of the (gathered) inputs."""
    H = h.shape[-1]
    h2 = h.reshape(-1, H)
    y = target.reshape(-1)
    k = None if keep is None else keep.reshape(y.shape[0], -1)
    return h2, y, k


def _forward(hidden, weight, target, keep, axis_name, cfg: _Config):
    opt = cfg.opt
    cdt = _compute_dtype(hidden.dtype)
    tau = opt.temperature
    h2, y, k = _flat(_gather_hidden(hidden, axis_name, cfg), target, keep)
    valid, owns, local, bad = _shard_position(axis_name, opt, y, weight.shape[0])
    stats = _all_stats(h2, weight, k, local, owns, cfg, cdt, axis_name)
    comb = spec.finalize(jnp, spec.reduce_stats(jnp, _gather(axis_name, stats), axis=0, temperature=tau), tau)
    logprob, entropy = spec.outputs(jnp, comb, valid, tau)
    nan = jnp.full_like(logprob, jnp.nan)
    logprob = jnp.where(bad, nan, logprob).reshape(target.shape)
    entropy = jnp.where(bad, nan, entropy).reshape(target.shape)
    return (logprob, entropy), comb


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _op(hidden, weight, target, keep, axis_name, cfg: _Config):
    return _forward(hidden, weight, target, keep, axis_name, cfg)[0]


def _op_fwd(hidden, weight, target, keep, axis_name, cfg: _Config):
    out, comb = _forward(hidden, weight, target, keep, axis_name, cfg)
    # Residuals: references to the inputs (this shard's rows of hidden under
    # sequence parallelism: gathered again in the backward) and O(T) statistics.
    return out, (hidden, weight, target, keep, comb)


def _op_bwd(axis_name, cfg: _Config, res, cotangents):
    hidden, weight, target, keep, comb = res
    opt = cfg.opt
    tau = opt.temperature
    cdt = _compute_dtype(hidden.dtype)
    h2, y, k = _flat(_gather_hidden(hidden, axis_name, cfg), target, keep)
    T, H = h2.shape
    valid, owns, local, bad = _shard_position(axis_name, opt, y, weight.shape[0])
    gl = jnp.asarray(cotangents[0], cdt).reshape(-1)
    ge = jnp.asarray(cotangents[1], cdt).reshape(-1) if opt.need_entropy_grad else None

    def tile(carry, ops, i0, n, j0, size, wj):
        # One [n, size] tile: recompute z; G in float32; both GEMMs take the
        # float32 G against exactly up-cast operands and accumulate in float32.
        dh, dwj = carry
        hi = _slice(ops[0], i0, n).astype(cdt)
        rows = lambda a: _slice(a, i0, n)  # noqa: E731
        z = _logits(hi, wj, cdt)
        kij = None if k is None else _slice(rows(k), j0, size, 1)
        if isinstance(j0, int):
            loc, start = rows(local), j0
        else:
            loc, start = rows(local) - j0, 0
        g = spec.block_grad(jnp, z, loc, rows(owns), kij, spec.Combined(*(rows(f) for f in comb)), rows(valid),
                            rows(gl), None if ge is None else rows(ge), tau, start=start, dtype=cdt,
                            indicator=_function._INDICATOR)
        g = jnp.where(rows(bad)[:, None], jnp.full_like(g, jnp.nan), g)
        dh = lax.dynamic_update_slice_in_dim(dh, rows(dh) + _dot(g, wj, ((1,), (0,)), cdt), i0, axis=0)
        return dh, dwj + _dot(g, hi, ((0,), (0,)), cdt)

    def vocab_block(carry, ops, j0, size):
        dh, dw = carry
        h2, w = ops
        wj = _slice(w, j0, size).astype(cdt)
        dwj = _vary(jnp.zeros((size, H), cdt), axis_name)
        dh, dwj = _over_blocks(T, cfg.token_block, lambda c, o, i0, n: tile(c, o, i0, n, j0, size, wj),
                               (dh, dwj), (h2,))
        # dW_j is complete (all tokens): written once, in the weight's dtype.
        return dh, lax.dynamic_update_slice_in_dim(dw, dwj.astype(weight.dtype), j0, axis=0)

    dh = _vary(jnp.zeros((T, H), cdt), axis_name)
    dw = _vary(jnp.zeros(weight.shape, weight.dtype), axis_name)
    if T:
        dh, dw = _over_blocks(weight.shape[0], cfg.vocab_block, vocab_block, (dh, dw), (h2, weight))
    if axis_name is not None:
        if cfg.opt.sequence_parallel:
            full = (hidden.shape[0] * _world(axis_name),) + hidden.shape[1:]
            dh = lax.psum_scatter(dh.reshape(full), axis_name, scatter_dimension=0, tiled=True)
        elif cfg.opt.reduce_hidden_grad:
            dh = lax.psum(dh, axis_name)  # in float32: the partial sums of every shard
    dh = dh.reshape(hidden.shape).astype(hidden.dtype)
    return dh, dw, None, None


_op.defvjp(_op_fwd, _op_bwd)


def _apply(hidden, weight, target, keep_mask, axis_name, cfg: _Config):
    """The op on validated arguments (per shard)."""
    hidden = jnp.asarray(hidden)
    weight = jnp.asarray(weight)
    target = jnp.asarray(target).astype(_int_dtype())
    keep = None if keep_mask is None else jnp.asarray(keep_mask)
    return _outputs(*_op(hidden, weight, target, keep, axis_name, cfg), cfg.opt)


_apply_jit = jax.jit(_apply, static_argnames=("axis_name", "cfg"))


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
):
    """Log-prob of ``target`` and entropy of ``softmax(hidden @ weight.T / tau)``, fused.

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
    cfg = _validate(hidden, weight, target, keep_mask, axis_name=axis_name, temperature=temperature,
                    ignore_index=ignore_index, with_entropy=with_entropy, entropy_grad=entropy_grad,
                    reduce_hidden_grad=reduce_hidden_grad, sequence_parallel=sequence_parallel,
                    token_block=token_block, vocab_block=vocab_block, memory_budget=memory_budget)
    if axis_name is None:
        check_target_range(target, int(np.shape(weight)[0]), ignore_index)
    return _apply_jit(hidden, weight, target, keep_mask, axis_name=axis_name, cfg=cfg)


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
):
    """:func:`linear_logprob_entropy` on global arrays, the weight's rows split over ``vocab_axis``.

    Args:
      hidden: ``[..., H]`` global hidden states. Replicated over the mesh
        inside the op; with ``sequence_parallel=True`` its first dim ``T``
        is split over ``vocab_axis`` instead (``T`` divisible by its size).
      weight: ``[V, H]`` global LM-head weight; ``V`` divisible by the size
        ``W`` of ``vocab_axis``; shard ``r`` holds rows ``[r*V/W, (r+1)*V/W)``.
      target: ``[...]`` global token ids in ``[0, V)`` or ``ignore_index``.
      mesh: a ``jax.sharding.Mesh`` (explicit axes from ``jax.make_mesh``, or
        auto axes).
      vocab_axis: the mesh axis splitting the vocabulary.
      keep_mask: ``None`` or ``[..., V]`` bool, split like the vocabulary.
      temperature, with_entropy, entropy_grad, ignore_index, token_block,
        vocab_block, memory_budget: as in :func:`linear_logprob_entropy`
        (the block sizes are per shard).

    Returns:
      ``(logprob, entropy)`` global arrays of target's shape, replicated
      (``entropy`` ``None`` when ``with_entropy=False``).

    Raises:
      TypeError / ValueError naming the argument; ``ValueError`` for
      out-of-range concrete targets.
    """
    from jax.sharding import PartitionSpec as P

    from .sharded import _is_explicit, _mesh_world, _place

    world = _mesh_world(mesh, vocab_axis)
    # The global shapes first (world=1: hidden and target have the same T, also with sequence_parallel).
    _validate(hidden, weight, target, keep_mask, axis_name=None, temperature=temperature,
              ignore_index=ignore_index, with_entropy=with_entropy, entropy_grad=entropy_grad,
              reduce_hidden_grad=True, sequence_parallel=sequence_parallel, token_block=token_block,
              vocab_block=vocab_block, memory_budget=memory_budget, world=1)
    ws, hs = tuple(weight.shape), tuple(hidden.shape)
    if ws[0] % world:
        raise ValueError(
            f"weight: expected the vocab size V = weight.shape[0] divisible by the size {world} of mesh axis "
            f"{vocab_axis!r}, got shape {ws}"
        )
    if sequence_parallel and (len(hs) < 2 or hs[0] % world):
        raise ValueError(
            f"hidden: with sequence_parallel=True expected shape [T, ..., H] with T divisible by the size "
            f"{world} of mesh axis {vocab_axis!r}, got shape {hs}"
        )
    check_target_range(target, ws[0], ignore_index)
    lead = (None,) * (len(hs) - 1)
    h_spec = P(vocab_axis) if sequence_parallel else P()
    specs = (h_spec, P(vocab_axis, None), P(*lead), P(*lead, vocab_axis))
    explicit = _is_explicit(mesh, mesh.axis_names)
    args = [hidden, weight, target, keep_mask]
    args = [_place(a, mesh, s, explicit) if explicit else (None if a is None else jnp.asarray(a))
            for a, s in zip(args, specs)]
    static = dict(temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad,
                  ignore_index=ignore_index, sequence_parallel=sequence_parallel, token_block=token_block,
                  vocab_block=vocab_block, memory_budget=memory_budget)
    lp, h = _run(*args, mesh=mesh, axis_name=vocab_axis, specs=specs, all_manual=explicit,
                 static=tuple(sorted(static.items())))
    return lp, (h if with_entropy else None)


@partial(jax.jit, static_argnames=("mesh", "axis_name", "specs", "all_manual", "static"))
def _run(hidden, weight, target, keep_mask, *, mesh, axis_name, specs, all_manual, static):
    kw = dict(static)
    has_mask = keep_mask is not None

    def body(h, w, y, *k):
        lp, ent = linear_logprob_entropy(h, w, y, axis_name=axis_name, keep_mask=k[0] if has_mask else None, **kw)
        return (lp, ent) if kw["with_entropy"] else (lp,)

    t_spec = specs[2]
    in_specs = specs[:3] + ((specs[3],) if has_mask else ())
    out_specs = (t_spec, t_spec) if kw["with_entropy"] else (t_spec,)
    args = (hidden, weight, target) + ((keep_mask,) if has_mask else ())
    axis_names = frozenset(mesh.axis_names) if all_manual else frozenset({axis_name})
    out = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=axis_names,
                        check_vma=True)(*args)
    return out[0], (out[1] if kw["with_entropy"] else None)
