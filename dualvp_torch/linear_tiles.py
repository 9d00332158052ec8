"""Tiles of the fused LM-head op's torch path (:mod:`dualvp_torch.linear`): their shape, budget and buffer."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "tile_shape", "default_budget", "column_budget", "ranges", "even_ranges", "pad_rows", "TileBuffer", "MIN_SIDE",
    "MIN_BUDGET", "BUDGET_FRACTION", "CUDA_BUDGET_FRACTION", "MIN_ROWS", "MAX_COLS", "MIN_COLUMN_BUDGET",
]

#: Default budget of one tile, as a fraction of ``B`` ...
BUDGET_FRACTION = 1 / 16
#: ... on a CUDA device (fewer, larger tiles: each tile costs host calls and launches).
CUDA_BUDGET_FRACTION = 1 / 4
#: ... but at least this many bytes (tiny problems run in one tile).
MIN_BUDGET = 1 << 20
#: The columns of a tile are those that this many rows of it fit in the column budget (see :func:`tile_shape`).
MIN_SIDE = 128
#: A call of fewer rows runs as this many (its rows repeated, :func:`pad_rows`): MKL multiplies
#: a matrix of 1 to 3 rows along other paths (gemv, small-matrix kernels) than the same rows
#: inside a larger one, and dynamo specialises a tile of one row (batch invariance).
MIN_ROWS = 8
#: At most this many columns per tile: ATen splits no row narrower than its grain between
#: intra-op threads, so the eager stages sum each row of a tile in one order.
MAX_COLS = 32768


def default_budget(n_rows: int, v_local: int, itemsize: int, device_type: str = "cpu", tile_loop: bool = True) -> int:
    """``max(fraction * B, MIN_BUDGET)`` bytes, ``B = n_rows * v_local * itemsize``.

    ``fraction``: :data:`CUDA_BUDGET_FRACTION` for the tile loop on CUDA, else
    :data:`BUDGET_FRACTION` (``tile_loop=False``, the fused Triton kernels: one float32 ``dW`` chunk).
    """
    fraction = CUDA_BUDGET_FRACTION if device_type == "cuda" and tile_loop else BUDGET_FRACTION
    return max(int(fraction * n_rows * v_local * itemsize), MIN_BUDGET)


#: The eager engine's default column budget is at least this many bytes (:func:`column_budget`
#: with ``scratch=True``). Its tile carries ``BLOCK_SCRATCH_BYTES`` (44) of temporaries per element
#: beside the 4-byte tile, so the plain budget gives it ~170 columns at V_local = 32000 (188 blocks
#: per row, each a round of eager calls); at 4 MiB, 681. Measured (float32, T x 1024 x 32000,
#: forward + backward, 1 thread, CPU time): T = 8 380 -> 242 ms, T = 64 753 -> 622 ms, T = 1024
#: unchanged (4.67 -> 4.62 s). Not for the compiled engine: its tile's columns are 2000 at the plain
#: budget, and 4x more columns leave 4x fewer rows per tile, so the weight is read once per token
#: chunk: T = 64 412 -> 493 ms, T = 256 1.09 -> 1.44 s (docs/decisions.md, "Fused op: column budget").
MIN_COLUMN_BUDGET = 4 << 20


def column_budget(v_local: int, itemsize: int, device_type: str = "cpu", scratch: bool = False) -> int:
    """The default budget that sizes a tile's columns, from ``V_local`` alone (no ``T``).

    :func:`default_budget` at ``MIN_SIDE`` rows; with ``scratch`` (an engine whose tile
    carries temporaries per element: eager), at least :data:`MIN_COLUMN_BUDGET`.
    """
    return max(default_budget(MIN_SIDE, v_local, itemsize, device_type), MIN_COLUMN_BUDGET if scratch else 0)


def tile_shape(n_rows: int, v_local: int, budget: int, elem_bytes: int,
               col_budget: Optional[int] = None) -> tuple[int, int]:
    """``(rows, cols)`` of one tile with ``rows * cols * elem_bytes <= budget`` (at least ``1 x 1``).

    Batch invariance: the columns (the vocabulary blocks whose statistics a
    row merges, and whose products its ``dh`` row sums) come from
    ``v_local`` and ``col_budget`` alone, never from ``n_rows``: the columns
    of ``MIN_SIDE`` rows within ``col_budget`` (default ``budget``; the op
    passes :func:`column_budget` when its ``budget`` is the default, itself
    a fraction of ``T x V_local``), at most :data:`MAX_COLS`, evened out over
    the blocks. The rows fill ``budget`` (at least ``2 * MIN_ROWS`` of them, or
    all, unless ``budget`` is below ``MIN_SIDE`` elements).
    """
    cb = budget if col_budget is None else col_budget
    e = max(1, elem_bytes)
    cols = min(v_local, MAX_COLS, max(1, cb // (MIN_SIDE * e)))
    n_blocks = -(-v_local // max(1, cols))
    cols = max(1, -(-v_local // max(1, n_blocks)))
    rows = min(n_rows, max(1, budget // (cols * e)))
    if budget >= MIN_SIDE * e:  # (not for a budget of a few elements: the tests' tiny tiles)
        rows = max(rows, min(n_rows, 2 * MIN_ROWS))  # token chunks of >= MIN_ROWS rows (even_ranges)
    return max(1, rows), cols


def ranges(n: int, step: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering ``[0, n)`` in steps of ``step`` (the last one shorter)."""
    return [(i, min(n, i + step)) for i in range(0, n, step)]


def even_ranges(n: int, step: int) -> list[tuple[int, int]]:
    """``ceil(n / step)`` ranges covering ``[0, n)``, their lengths ``floor`` or ``ceil`` of ``n / k``.

    The token chunks: none is much shorter than ``step`` (a last chunk of 1 to
    3 rows would multiply along MKL's other paths; with ``step >= 2 *
    MIN_ROWS`` every chunk has at least ``MIN_ROWS`` rows).
    """
    k = -(-n // max(1, step))
    return [(n * i // k, n * (i + 1) // k) for i in range(k)]


def pad_rows(n: int) -> Optional[torch.Tensor]:
    """Row indices ``[MIN_ROWS]`` that run a call of ``0 < n < MIN_ROWS`` rows (its rows repeated), else ``None``."""
    if n == 0 or n >= MIN_ROWS:
        return None
    return torch.arange(MIN_ROWS) % n


class TileBuffer:
    """One pass's tiles, formed one after another in a single buffer of the largest tile's size.

    A fresh tile per step costs nothing on CUDA (the caching allocator hands the
    last one back) but on the CPU a tile above glibc's mmap threshold is a new
    mapping whose every 4 KiB page faults on first write: 600-650 thousand
    faults per forward + backward at T=2048, V_local=152064 (float32, 16 tiles
    of 78 MB; ``benchmarks/head_step.py``). The buffer is allocated at the
    first CPU tile and kept for the pass; the peak is one tile either way.
    """

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device):
        self.shape, self.dtype, self.device = (rows, cols), dtype, device
        self._flat: Optional[torch.Tensor] = None

    def take(self, rows: int, cols: int) -> Optional[torch.Tensor]:
        """A contiguous ``[rows, cols]`` view of the buffer, or ``None`` off the CPU."""
        if self.device.type != "cpu":
            return None
        if self._flat is None:
            self._flat = torch.empty(self.shape[0] * self.shape[1], dtype=self.dtype, device=self.device)
        return self._flat[: rows * cols].view(rows, cols)
