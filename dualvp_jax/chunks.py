"""Row-chunked evaluation of per-row functions under ``jit`` (the op's forward on XLA:CPU).

XLA:CPU runs a row reduction as a library fusion that does not absorb the
elementwise operation feeding it, so a reduction over ``[T, V_local]`` logits
gets a materialised float32 ``[T, V_local]`` input: the upcast of bfloat16
logits, ``exp(d)``, ``e * d``, the masked logits. :func:`map_row_chunks` runs
such a function over bounded blocks of rows instead, so each of those
intermediates is ``[rows, V_local]`` (a few MiB, see :data:`CHUNK_BYTES`).
The same library runs a reduction over very wide rows on about one core:
:func:`column_blocks` splits wider rows into blocks of at most
:data:`COLUMN_BLOCK` columns, whose statistics the caller merges (as the op
does).

Three things each brought a full-size copy back while this was written, and
``tests/jax/test_memory.py`` pins each one:

- XLA:CPU has no native bfloat16 dynamic slice: it upcasts the sliced operand
  to float32, and since the operand is loop-invariant it hoists that upcast of
  the *whole* array out of the loop (``fori_loop``, ``scan`` and ``lax.map``
  alike). The big operands are therefore loop-*carried*, and pass through
  ``lax.optimization_barrier`` in the body, which hides that they never
  change.
- ``lax.map(batch_size=...)`` handles a row count that is not a multiple of
  the batch by concatenating a padded remainder (a copy of the input). Here
  the last chunk instead starts at ``N - rows`` and overlaps the one before
  it; its rows that were already covered are dropped from the (``O(N)``)
  result.
- Under ``shard_map`` with ``check_vma`` a loop carry must keep its type
  (including the mesh axes it varies over). The results are the scan's
  stacked outputs, which need no initial value, and the carry is the inputs
  themselves, so no accumulator is ever built with ``jnp.zeros``.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["CHUNK_BYTES", "COLUMN_BLOCK", "chunk_rows", "column_blocks", "map_row_chunks",
           "stats_with_redo"]

#: Default budget, in bytes, of one float32 ``[rows, V_local]`` intermediate
#: of a chunk. A chunk of the op's statistics holds two or three such buffers
#: at once, so the forward's scratch is a few such budgets whatever ``T``.
#: Smaller budgets mean more loop steps, which cost time and, with several
#: host devices in one process, peak memory beyond the compiled scratch
#: (docs/decisions.md, "dualvp_jax: row-chunk budget").
CHUNK_BYTES = 2 << 20


def chunk_rows(width: int, budget: Optional[int] = None) -> int:
    """Rows of every reduction block of a ``width``-column shard: one float32 ``[rows, width]`` fits ``budget`` bytes.

    ``budget`` defaults to :data:`CHUNK_BYTES` (the op passes its
    :class:`~dualvp_jax._tuning.Tuning`'s). A multiple of 4 and at least 4
    (so over budget for ``width > budget / 16``). A function of the width
    alone, never of the row count: :func:`map_row_chunks` runs every call,
    however few rows it has, as blocks of exactly this many rows, so each
    reduction of the forward compiles to one program whatever ``T`` (batch
    invariance). XLA:CPU picks a row reduction's code from its operand's
    *shape*: below 4096 elements (jax 0.10.2) a tree of 32-column windows
    or a plain loop, above it a YNNPACK kernel, and their float32 roundings
    differ (a ``[T, 300]`` sum of exponentials: rows of T <= 13 and
    T >= 16 1 ulp apart; docs/decisions.md, "JAX: one block shape per V").
    """
    budget = CHUNK_BYTES if budget is None else budget
    rows = int(budget) // max(1, 4 * int(width))
    return max(4, rows - rows % 4)


#: Default widest column block, in columns, of one row reduction on XLA:CPU,
#: whose reduction library runs wider rows on about one core. Wider shards
#: are reduced in blocks of at most this many columns, masked or not, merged
#: with ``spec.reduce_stats`` (the merge that combines shards)
#: (docs/decisions.md, "dualvp_jax: column blocks").
COLUMN_BLOCK = 1 << 15


def column_blocks(width: int, max_width: Optional[int] = None) -> list[tuple[int, int]]:
    """``[(start, stop), ...]``: ``width`` columns in the fewest blocks of at most ``max_width``.

    ``max_width`` defaults to :data:`COLUMN_BLOCK` (the op passes its
    :class:`~dualvp_jax._tuning.Tuning`'s). The blocks are contiguous, in order, and their
    widths differ by at most one (152064 -> 5 blocks of 30412-30413). A width
    of at most ``max_width`` (or 0) is one block.
    """
    max_width = COLUMN_BLOCK if max_width is None else int(max_width)
    if max_width < 1:
        raise ValueError(f"max_width: expected >= 1, got {max_width}")
    width = int(width)
    k = max(1, -(-width // max_width))
    edges = [width * i // k for i in range(k + 1)]
    return list(zip(edges[:-1], edges[1:]))


def map_row_chunks(fn: Callable, arrays: Sequence[Optional[jnp.ndarray]], rows: int):
    """``fn(*arrays)`` evaluated over blocks of ``rows`` rows.

    Args:
      fn: maps arrays with leading dim ``r`` (``None`` entries passed as
        ``None``) to a pytree of arrays ``[r, ...]`` whose row ``i`` depends
        only on row ``i`` of the inputs (row-wise; the overlapping last chunk
        relies on it).
      arrays: arrays with the same leading dim ``N`` (``[N, ...]``), or ``None``.
      rows: block size (see :func:`chunk_rows`): ``fn`` always sees exactly
        ``rows`` rows; ``N < rows`` pads the arrays with zero rows to one block
        (their results dropped), ``N > rows`` loops over blocks, the last one
        overlapping the one before it.

    Returns:
      ``fn``'s pytree with leaves ``[N, ...]``: the rows of the chunks in order.
    """
    present = [a for a in arrays if a is not None]
    n = present[0].shape[0]
    if n < rows:
        # Batch invariance: a call of fewer rows than a block runs as one block
        # of ``rows`` rows (zero rows appended: a copy of at most ``rows`` rows,
        # one chunk's budget), so its reductions compile to the same program as
        # every block of a longer call and a row gets the same bits in any T.
        pad = rows - n
        padded = [None if a is None else jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) for a in arrays]
        return jax.tree_util.tree_map(lambda y: y[:n], fn(*padded))
    if rows == n:
        return fn(*arrays)
    k = -(-n // rows)  # chunks; the last one starts at n - rows (overlap, no padding)

    def rebuild(xs):
        it = iter(xs)
        return [None if a is None else next(it) for a in arrays]

    def body(carry, i):
        # The barrier hides from XLA that the carried arrays never change, so
        # it cannot hoist a whole-array conversion out of the loop.
        carry = lax.optimization_barrier(carry)
        start = jnp.minimum(i * rows, n - rows)
        chunk = [lax.dynamic_slice_in_dim(a, start, rows, axis=0) for a in carry]
        return carry, fn(*rebuild(chunk))

    def assemble(ys):  # [k, rows, ...] -> [n, ...]; O(N) statistics, not logits
        head = ys[: k - 1].reshape((-1,) + ys.shape[2:])  # rows [0, (k-1)*rows)
        tail = ys[k - 1, (k - 1) * rows - (n - rows):]  # the last chunk's new rows
        return jnp.concatenate([head, tail], axis=0)

    _, ys = lax.scan(body, tuple(present), jnp.arange(k, dtype=jnp.int32))
    return jax.tree_util.tree_map(assemble, ys)


def stats_with_redo(run: Callable, args: tuple, has_keep: bool):
    """A shard's statistics ``run(args, kept_shift)``: without a mask ``"kept"``; with one the fast
    ``"max"`` pass, then the ``"kept"`` pass for the rows that pass marked (``spec.redo_marked``).

    A row that a block marks stays marked through the merge (its sk is NaN). The predicate is on the
    device: no host synchronisation. Only the marked rows take the second pass's statistics, as in every
    backend: a row's result does not depend on another's mark.
    """
    from dualvp import spec

    if not has_keep:
        return run(args, "kept")
    fast = run(args, "max")
    return lax.cond(jnp.any(spec.marked_rows(jnp, fast)),
                    lambda: spec.redo_marked(jnp, fast, run(args, "kept")), lambda: fast)

