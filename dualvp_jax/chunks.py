"""Row-chunked evaluation of per-row functions under ``jit`` (the op's forward on XLA:CPU).

XLA:CPU runs a row reduction as a library fusion that does not absorb the
elementwise operation feeding it, so a reduction over ``[T, V_local]`` logits
gets a materialised float32 ``[T, V_local]`` input: the upcast of bfloat16
logits, ``exp(d)``, ``e * d``, the masked logits. :func:`map_row_chunks` runs
such a function over bounded blocks of rows instead, so each of those
intermediates is ``[rows, V_local]`` (a few MiB, see :data:`CHUNK_BYTES`).

Three things each brought a full-size copy back while this was written, and
``tests/jax/test_jax_memory.py`` pins each one:

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

__all__ = ["CHUNK_BYTES", "chunk_rows", "map_row_chunks"]

#: Budget, in bytes, of one float32 ``[rows, V_local]`` intermediate of a chunk.
#: A chunk of the op's statistics holds two or three such buffers at once next
#: to its rows of logits, so about 4 x 512 KiB = 2 MiB is live per chunk: one
#: core's L2 cache on common server CPUs (measured on a 2-core Xeon with 2 MiB
#: L2 per core: 4 rows per chunk at ``V_local = 32000`` were ~10 % faster
#: than 16, 64 rows ~35 % slower). The scratch is then ~1.5 MiB whatever ``T``
#: (0.002-0.01 B at T = 2048, B = bytes of the shard). 512 KiB gives 4 rows
#: at ``V_local = 32000`` and 1 row at ``V_local >= 131072`` (the loop's
#: per-step overhead stays small next to a row's work there).
CHUNK_BYTES = 512 << 10


def chunk_rows(n_rows: int, width: int, budget: Optional[int] = None) -> int:
    """Rows per chunk so that one float32 ``[rows, width]`` buffer fits ``budget`` bytes.

    ``budget`` defaults to :data:`CHUNK_BYTES` (read at call time, i.e. at
    trace time of the op). At least 1, at most ``n_rows`` (a single chunk: no
    loop).
    """
    budget = CHUNK_BYTES if budget is None else budget
    rows = max(1, int(budget) // max(1, 4 * int(width)))
    return max(1, min(rows, int(n_rows)))


def map_row_chunks(fn: Callable, arrays: Sequence[Optional[jnp.ndarray]], rows: int):
    """``fn(*arrays)`` evaluated over blocks of ``rows`` rows.

    Args:
      fn: maps arrays with leading dim ``r`` (``None`` entries passed as
        ``None``) to a pytree of arrays ``[r, ...]`` whose row ``i`` depends
        only on row ``i`` of the inputs (row-wise; the overlapping last chunk
        relies on it).
      arrays: arrays with the same leading dim ``N`` (``[N, ...]``), or ``None``.
      rows: chunk size (see :func:`chunk_rows`); ``rows >= N`` calls ``fn``
        once on the whole arrays.

    Returns:
      ``fn``'s pytree with leaves ``[N, ...]``: the rows of the chunks in order.
    """
    present = [a for a in arrays if a is not None]
    n = present[0].shape[0]
    if rows >= n:
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
