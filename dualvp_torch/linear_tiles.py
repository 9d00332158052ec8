"""Tiles of the fused LM-head op's torch path (:mod:`dualvp_torch.linear`): their shape, budget and buffer."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "tile_shape", "default_budget", "ranges", "TileBuffer", "MIN_SIDE", "MIN_BUDGET", "BUDGET_FRACTION",
    "CUDA_BUDGET_FRACTION",
]

#: Default budget of one tile, as a fraction of ``B`` ...
BUDGET_FRACTION = 1 / 16
#: ... on a CUDA device (fewer, larger tiles: each tile costs host calls and launches).
CUDA_BUDGET_FRACTION = 1 / 4
#: ... but at least this many bytes (tiny problems run in one tile).
MIN_BUDGET = 1 << 20
#: A tile spans the whole shorter side when this many of the other side fit the budget.
MIN_SIDE = 128


def default_budget(n_rows: int, v_local: int, itemsize: int, device_type: str = "cpu", tile_loop: bool = True) -> int:
    """``max(fraction * B, MIN_BUDGET)`` bytes, ``B = n_rows * v_local * itemsize``.

    ``fraction``: :data:`CUDA_BUDGET_FRACTION` for the tile loop on CUDA, else
    :data:`BUDGET_FRACTION` (``tile_loop=False``, the fused Triton kernels: one float32 ``dW`` chunk).
    """
    fraction = CUDA_BUDGET_FRACTION if device_type == "cuda" and tile_loop else BUDGET_FRACTION
    return max(int(fraction * n_rows * v_local * itemsize), MIN_BUDGET)


def tile_shape(n_rows: int, v_local: int, budget: int, elem_bytes: int) -> tuple[int, int]:
    """``(rows, cols)`` of one tile with ``rows * cols * elem_bytes <= budget`` (at least ``1 x 1``).

    Vocabulary-major (``n_rows <= v_local``): all rows when ``MIN_SIDE``
    columns of them fit, then as many columns as fit; token-major the other
    way round.
    """
    cap = max(1, budget // max(1, elem_bytes))
    if n_rows <= v_local:
        rows = min(n_rows, max(1, cap // min(v_local, MIN_SIDE)))
        cols = min(v_local, max(1, cap // max(1, rows)))
    else:
        cols = min(v_local, max(1, cap // min(n_rows, MIN_SIDE)))
        rows = min(n_rows, max(1, cap // max(1, cols)))
    return max(1, rows), max(1, cols)


def ranges(n: int, step: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering ``[0, n)`` in steps of ``step`` (the last one shorter)."""
    return [(i, min(n, i + step)) for i in range(0, n, step)]


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
