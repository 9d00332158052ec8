"""How the spec runs in torch: the shard-local stages of the op, compiled or eager.

The entry points of the op's two local stages, over the shard ``z [T, V_local]``:

* statistics (forward): :func:`shard_stats` -> ``[T, 6]`` in the compute
  dtype (``spec.block_stats``), and :func:`merge` of the ranks' statistics;
* gradient (backward): :func:`shard_grad` -> ``[T, V_local]`` in the input
  dtype (``spec.block_grad``), into a fresh buffer or (``inplace=True``)
  into the logits' own storage;
* per logits block of the fused LM-head op: :func:`block_stats`,
  :func:`block_grad_`.

The compute dtype is float64 for float64 input and float32 otherwise
(:func:`compute_dtype`); the row sums of the compiled kernels accumulate in
float64 (:func:`accumulation_dtype`).

Implementations (the registry :data:`IMPLEMENTATIONS`)
------------------------------------------------------
``"compiled"``
    ``torch.compile`` of the spec stage (:mod:`dualvp_torch.compiled`): a
    fused single pass with no ``[T, V_local]`` intermediate, one graph per
    stage variant for every ``T`` and ``V_local``. On CPU the masked
    statistics shift the kept sum by the overall max (one pass over the
    mask) and recompute the rows that marks on the eager path
    (:func:`dualvp_torch.stages.kept_shift`). The in-place gradient ends in
    ``z.copy_(grad)``, which inductor fuses into the one kernel (O(T) extra
    memory).
``"eager"``
    The same stages op by op over row chunks of bounded scratch
    (:mod:`dualvp_torch.eager`), for environments without a compiler.

Selection (:func:`select`): the ``impl`` argument when given; otherwise the
environment variable ``DUALVP_COMPILE``, read at each call (``0`` / ``false``
/ ``no``: ``"eager"``; anything else or unset: ``"compiled"``). If compiling a
stage fails (the exception types in :data:`COMPILE_ERRORS`), a warning is
issued once and ``"compiled"`` selects ``"eager"`` for the rest of the
process; a runtime error of a compiled kernel propagates.

The measured choices (float64 sums, static widths, ...) are fields of one
frozen :class:`dualvp_torch.tuning.Tuning`; a block can run under another
with ``dualvp_torch.tuning.using``.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from dualvp import spec

from . import compiled as _compiled_path
from . import eager as _eager_path
from . import stages as _stages
from . import tuning
from .eager import (
    GRAD_FRACTION,
    GRAD_SCRATCH_BYTES,
    INPLACE_FRACTION,
    MIN_CHUNK_ELEMENTS,
    STATS_FRACTION,
    STATS_SCRATCH_BYTES,
    chunk_rows,
)
from .stages import accumulation_dtype, compute_dtype, xp

__all__ = [
    "IMPLEMENTATIONS",
    "COMPILE_ERRORS",  # noqa: F822 - built on first use by the module __getattr__
    "STATS_SCRATCH_BYTES",
    "GRAD_SCRATCH_BYTES",
    "STATS_FRACTION",
    "GRAD_FRACTION",
    "INPLACE_FRACTION",
    "MIN_CHUNK_ELEMENTS",
    "BLOCK_SCRATCH_BYTES",
    "xp",
    "compute_dtype",
    "accumulation_dtype",
    "compile_enabled",
    "select",
    "chunk_rows",
    "shard_stats",
    "shard_grad",
    "merge",
    "block_stats",
    "block_grad_",
]

#: The registered implementations, in order of preference.
IMPLEMENTATIONS = ("compiled", "eager")

#: The eager path's temporaries per block element of the fused op, in bytes,
#: for either stage (the larger of :data:`STATS_SCRATCH_BYTES` and
#: :data:`GRAD_SCRATCH_BYTES`; the in-place gradient writes no separate output).
BLOCK_SCRATCH_BYTES = max(STATS_SCRATCH_BYTES, GRAD_SCRATCH_BYTES)


def __getattr__(name: str):
    # COMPILE_ERRORS is built on first use (see dualvp_torch.compiled).
    if name == "COMPILE_ERRORS":
        return _compiled_path.COMPILE_ERRORS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def compile_enabled() -> bool:
    """``False`` when ``DUALVP_COMPILE=0`` (read at call time) or compiling failed before."""
    return select() == "compiled"


def select(impl: Optional[str] = None) -> str:
    """The implementation a call runs: ``impl`` if given, else from ``DUALVP_COMPILE``.

    ``"compiled"`` becomes ``"eager"`` once compiling has failed in this process.

    Raises:
      ValueError: ``impl`` is not ``None`` or one of :data:`IMPLEMENTATIONS`.
    """
    if impl is None:
        off = os.environ.get("DUALVP_COMPILE", "1").strip().lower() in ("0", "false", "no")
        impl = "eager" if off else "compiled"
    elif impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl: expected None or one of {IMPLEMENTATIONS}, got {impl!r}")
    if impl == "compiled" and _compiled_path.failed():
        return "eager"
    return impl


def _eager_tau(tau, temperature):
    # The eager path hands the spec the number 1 rather than a tensor holding
    # 1, and the spec skips that division (exact either way): one op fewer per
    # chunk at the common tau = 1. The compiled stages keep the tensor (a
    # temperature that changes must not recompile them; they fuse the
    # division anyway).
    return 1 if temperature == 1 else tau


def shard_stats(
    z, local, owns, keep, tau, *, with_entropy: bool = True, impl: Optional[str] = None,
    temperature: Optional[float] = None,
) -> torch.Tensor:
    """``[T, 6]`` statistics ``spec.block_stats`` of the shard ``z [T, V_local]``.

    ``tau`` is a 0-d tensor of the compute dtype; ``with_entropy=False``
    skips the entropy's statistic (see ``spec.block_stats``; the compiled CPU
    stage computes it anyway for ``Tuning.full_stats_cpu_dtypes``); ``impl``
    as in :func:`select`; ``temperature``: the same temperature as a Python
    number, when the caller has it (the eager path skips dividing by 1).
    """
    n = z.shape[0]
    if n == 0:
        return torch.zeros((0, spec.N_STATS), dtype=tau.dtype, device=z.device)
    if select(impl) == "compiled":  # one row: as two (compiled._run_one_row)
        shift = _stages.kept_shift(z, keep)
        full = with_entropy or (z.device.type == "cpu" and z.dtype in tuning.current().full_stats_cpu_dtypes)
        stage = _stages.stats_stage
        args = (z, local, owns, _stages.mask_arg(keep, z), tau, accumulation_dtype(z), full, shift)
        out, ok = _compiled_path.run(stage, args, full)
        if ok:
            if shift == "max":
                _eager_path.redo_marked_rows(out, z, local, owns, keep, _eager_tau(tau, temperature), with_entropy)
            return out
    return _eager_path.stats(z, local, owns, keep, _eager_tau(tau, temperature), with_entropy)


def merge(all_stats, valid, tau, *, impl: Optional[str] = None, compiled: Optional[bool] = None) -> tuple:
    """``(comb, logprob, entropy)``: ``spec.reduce_stats`` over the ranks' ``[W, T, 6]`` statistics, finalized.

    ``valid`` is ``[T]`` and ``tau`` the 0-d compute-dtype temperature; the
    outputs are ``[T]``. Compiled, the merge is one region instead of some
    34 eager ops on ``[T]`` vectors: on a GPU each eager op is a kernel
    launch that the CPU issues while the GPU waits for it. ``compiled``:
    ``None`` compiles it off the CPU when ``impl`` selects the compiled path;
    on the CPU the eager ops cost what the compiled region costs and
    compiling it would add to every process's first call, so there it stays
    eager unless ``compiled=True`` (the tests)
    (docs/decisions.md, "Eager merge on CPU").
    """
    if compiled is None:
        compiled = all_stats.device.type != "cpu"
    res = None
    stage = _stages.merge_stage
    if compiled and select(impl) == "compiled" and all_stats.shape[1] > 0:
        res, _ = _compiled_path.run(stage, (all_stats, valid, tau), False, has_keep=False)
    if res is None:
        res = stage(all_stats, valid, tau)
    return spec.Combined(*res[:6]), res[6], res[7]


def shard_grad(
    z, local, owns, keep, M, log_s, c, mk, log_sk, valid, gl, ge, tau, *, inplace: bool = False,
    impl: Optional[str] = None, temperature: Optional[float] = None,
):
    """Gradient ``spec.block_grad`` of the shard ``z [T, V_local]``, in ``z.dtype``.

    ``M, log_s, c, mk, log_sk``: the finalized statistics (``c`` may be
    ``None`` with ``ge`` ``None``: no entropy term); ``valid, gl, ge``:
    ``[T]``; ``tau``: 0-d tensor of the compute dtype. ``inplace=True``
    writes the gradient into ``z`` itself (``z`` must be contiguous) and
    returns ``z``. ``temperature``: as in :func:`shard_stats`.
    """
    n = z.shape[0]
    if n == 0:
        return z if inplace else torch.empty_like(z, memory_format=torch.contiguous_format)
    args = (z, local, owns, keep, M, log_s, c, mk, log_sk, valid, gl, ge, tau)
    if select(impl) == "compiled":  # one row: as two (compiled._run_one_row)
        stage_args = (z, local, owns, _stages.mask_arg(keep, z)) + args[4:]
        if inplace:
            _, ok = _compiled_path.run(_stages.grad_inplace_stage, stage_args, ge is not None)
            out = z
        else:  # the compiled stage allocates its own output
            out, ok = _compiled_path.run(_stages.grad_stage, stage_args, ge is not None)
        if ok:
            return out
    out = z if inplace else torch.empty(z.shape, dtype=z.dtype, device=z.device)
    _eager_path.grad(z, out, *args[1:-1], _eager_tau(tau, temperature))
    return out


# --- block-level entry points (the fused LM-head op) -----------------------------------
#
# The fused op (dualvp_torch/linear.py) forms one float32 logits block
# ``z = h_i W_j^T`` at a time and runs the spec on it: ``spec.block_stats``
# with ``start=`` the block's first column in the shard, and ``spec.block_grad``
# written over the block itself (the block is the op's own scratch). The block
# is already sized to the op's memory budget, so the eager path runs each
# stage on the whole block (the op counts BLOCK_SCRATCH_BYTES per element into
# its tile size instead of row chunks). ``start`` is a Python int, traced as a
# symbolic int: new block offsets do not recompile.


def block_stats(z, local, owns, keep, tau, *, start: int = 0, impl: Optional[str] = None) -> torch.Tensor:
    """``[n, 6]`` statistics ``spec.block_stats`` of the block ``z [n, b]`` = columns ``[start, start + b)``.

    ``local, owns``: ``[n]`` from ``spec.target_to_local`` (columns within the
    *shard*); ``keep``: ``[n, b]`` bool or ``None``; ``tau``: 0-d tensor of
    the compute dtype; ``impl`` as in :func:`select`.
    """
    if z.shape[0] == 0:
        return torch.zeros((0, spec.N_STATS), dtype=tau.dtype, device=z.device)
    args = (z, local, owns, keep, tau, int(start))
    stage = _stages.block_stats_stage
    if select(impl) == "compiled":
        out, ok = _compiled_path.run(stage, args + (accumulation_dtype(z, "compiled"),), False)
        if ok:
            return out
    return stage(*args, accumulation_dtype(z, "eager"))


def block_grad_(
    z, local, owns, keep, M, log_s, c, mk, log_sk, valid, gl, ge, tau, *, start: int = 0,
    impl: Optional[str] = None,
) -> torch.Tensor:
    """Write ``spec.block_grad`` of the block ``z [n, b]`` (columns ``[start, start + b)``) over ``z``; return ``z``.

    ``z`` must be contiguous and is typically a float32 scratch block; the
    other arguments as in :func:`shard_grad` (rows of this block only).
    """
    if z.shape[0] == 0:
        return z
    args = (z, local, owns, keep, M, log_s, c, mk, log_sk, valid, gl, ge, tau, int(start))
    stage = _stages.block_grad_inplace_stage
    if select(impl) == "compiled":
        _, ok = _compiled_path.run(stage, args, ge is not None)
        if ok:
            return z
    stage(*args)
    return z
