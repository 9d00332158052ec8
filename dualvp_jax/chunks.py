"""Row-chunked evaluation of per-row functions under ``jit`` (the op's forward on XLA:CPU without its kernel).

The op's CPU forward takes its row sums from :mod:`dualvp_jax.cpu_kernel`
where it can; this is the XLA program it falls back to (float16 and float64
logits, no compiler), and the one that computes masked rows again with
``kept_shift="kept"``.

XLA:CPU runs a row reduction as a library fusion that does not absorb the
elementwise operation feeding it, so a reduction over ``[T, V_local]`` logits
gets a materialised float32 ``[T, V_local]`` input: the upcast of bfloat16
logits, ``exp(d)``, ``e * d``, the masked logits. :func:`map_row_chunks` runs
such a function over bounded blocks of rows instead, so each of those
intermediates is ``[rows, V_local]`` (a few MiB, see :data:`CHUNK_BYTES`).
The same library runs a reduction over more than 2**15 columns on about one
core: :func:`column_blocks` splits wider rows into blocks within that
(:data:`COLUMN_BLOCK`), whose statistics the caller merges (as the op does).

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

__all__ = ["CHUNK_BYTES", "COLUMN_BLOCK", "chunk_rows", "column_blocks", "map_row_chunks"]

#: Budget, in bytes, of one float32 ``[rows, V_local]`` intermediate of a chunk.
#: A chunk of the op's statistics holds two or three such buffers at once, so
#: the scratch is about 3 x 2 MiB = 6 MiB whatever ``T`` (0.01-0.03 B at
#: T = 2048, V_local = 32000, B = bytes of the shard). 2 MiB gives 16 rows at
#: ``V_local = 32000`` and 4 (the minimum, see :func:`chunk_rows`) at
#: ``V_local = 152064``. Measured on a 2-core Xeon
#: (2 MiB L2 per core): the forward's time moves little between 0.25 and
#: 16 MiB (4 rows at 32000 were ~10 % faster than 16, 64 rows ~35 % slower;
#: one row per chunk at 152064 costs no more than 6). Smaller budgets were
#: not taken because of the 2-device ``shard_map`` case on host devices: there
#: the process's peak RSS grows beyond the compiled scratch with the number of
#: loop steps (+0.08 B at 4 rows per chunk, +0.02-0.04 B at 16), while one
#: device stays within +0.01 B at any budget. Re-checked on a 2-core Xeon with
#: AVX-512 BF16 (docs/measurements.md, eleventh session): 2 MiB the fastest or
#: within 5 % of it at 32000 columns.
CHUNK_BYTES = 2 << 20


def chunk_rows(n_rows: int, width: int, budget: Optional[int] = None) -> int:
    """Rows per chunk so that one float32 ``[rows, width]`` buffer fits ``budget`` bytes.

    ``budget`` defaults to :data:`CHUNK_BYTES` (read at call time, i.e. at
    trace time of the op). A multiple of 4 and at least 4 (so over budget for
    ``width > budget / 16``): XLA:CPU reduces blocks of 1 or 3 rows along
    another path, whose float32 entropy was 1 ulp further from float64 than
    the whole shard's at ``V_local = 152064``; with 4, 8, ... rows the
    results matched it. At most ``n_rows`` (a single chunk: no loop).
    """
    budget = CHUNK_BYTES if budget is None else budget
    rows = int(budget) // max(1, 4 * int(width))
    rows = max(4, rows - rows % 4)
    return max(1, min(rows, int(n_rows)))


#: Widest column block, in columns, of one row reduction on XLA:CPU. XLA's
#: reduction library (YNNPACK fusions, jax 0.10) runs a row reduction on both
#: cores of the 2-core test machine up to 2**15 columns and on about one core
#: from 2**15 + 1 (measured, float32 log-prob forward, T = 2048: 0.26-0.28
#: ns per element up to 32768 columns, 0.45-0.67 from 32769). Wider
#: shards are therefore reduced in column blocks of at most this many
#: columns, merged with ``spec.reduce_stats`` (the merge that combines
#: shards): the forward at V_local = 152064 took 0.63-0.85x the time of whole
#: rows, and 16384-column blocks were slower than 32768
#: (``benchmarks/jax_columns.py``). With a keep mask (since its one-pass
#: ``kept_shift="max"``) the masked forward took 0.77-0.93x the time of
#: whole rows, and the peak of 2 host devices in one process rose by 0.04 B
#: (bfloat16; ``dualvp_jax.function._MASKED_BLOCKS``); before it, 1.0-1.07x,
#: and masked rows stayed whole. Reshaping each row into
#: ``[k, V_local / k]`` instead of slicing took 0.89-1.24x the time of whole
#: rows (slices: 0.63-0.85x).
COLUMN_BLOCK = 1 << 15


def column_blocks(width: int, max_width: Optional[int] = None) -> list[tuple[int, int]]:
    """``[(start, stop), ...]``: ``width`` columns in the fewest blocks of at most ``max_width``.

    ``max_width`` defaults to :data:`COLUMN_BLOCK` (read at call time, i.e. at
    trace time of the op). The blocks are contiguous, in order, and their
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
