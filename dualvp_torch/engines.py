"""The engines of the logits op, and the one table that names them.

An engine computes the op's three shard-local steps; everything around them
(checks, the agreement, the collectives, autograd) is the same for every
engine and lives in :mod:`dualvp_torch.library`:

* ``stats(z, y, keep, call) -> (stats [T, 6], bad, rows)``: the shard's
  ``spec.block_stats``; ``bad`` is the engine's own count of out-of-range
  targets (0-d, or ``None``: the op counts them when it validates), ``rows``
  whatever :func:`merge` wants again (``None`` or the target's mapping);
* ``merge(all_stats [W, T, 6], y, rows, call) -> (logprob [T], entropy [T],
  res [5, T])``: ``spec.reduce_stats``, ``spec.finalize``, ``spec.outputs``;
  ``res`` holds the row statistics ``(M, log S, c, Mk, log Sk)`` (the fields
  of ``spec.Combined``, one value);
* ``grad(z, y, keep, res, gl, ge, call, out) -> [T, V_local]``:
  ``spec.block_grad`` into ``out`` (``z`` itself for the in-place gradient)
  or a fresh buffer.

``z`` is ``[T, V_local]``, ``y`` the ``[T]`` global target ids, ``keep`` the
``[T, V_local]`` mask or ``None``, ``call`` the checked call
(:class:`dualvp_torch.checks.Call`: options, rank, shapes and the engine's
per-metadata ``plan``).

=============  ==================================================================  ==========================
engine         how the spec runs                                                   devices
=============  ==================================================================  ==========================
``compiled``   ``torch.compile`` of the spec stages (:mod:`.compiled`, one fused   every device
               pass per stage, no ``[T, V_local]`` intermediate)
``eager``      the same stages op by op over row chunks (:mod:`.eager`)           every device
``triton``     the hand-written kernels of :mod:`dualvp_torch.triton_kernels`     CUDA; CPU under
                                                                                   ``TRITON_INTERPRET=1``
=============  ==================================================================  ==========================

Selection (:func:`select`, from :mod:`dualvp_torch.selection`, the one place that reads an engine's
name; the checks import it, and no engine, from there): the
``impl`` argument when given; else ``"triton"`` on the device types of
``Tuning.triton_default_devices`` (none by default) when the ``triton``
package is installed, else the environment variable ``DUALVP_COMPILE`` read
at each call (``0`` / ``false`` / ``no``: ``"eager"``; else ``"compiled"``).
If compiling a stage fails (the exception types in ``COMPILE_ERRORS``), a
warning is issued once and ``"compiled"`` selects ``"eager"`` for the rest of
the process; a runtime error of a compiled kernel propagates. The fused
LM-head op (:mod:`dualvp_torch.linear`) has Triton kernels of its own, which
``impl=None`` never picks (``triton_default=False``): they are opt-in until a
GPU run has measured them against its tile loop.

The shard-stage entry points below (:func:`shard_stats`, :func:`merge`,
:func:`shard_grad`, :func:`block_stats`, :func:`block_grad_`) are how the
``compiled`` and ``eager`` engines, and the fused op's tile loop, run a spec
stage; ``compiled=True`` tries the compiled stage first.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch

from dualvp import spec

from . import compiled as _compiled_path
from . import eager as _eager_path
from . import stages as _stages
from . import tuning
from .engine_names import FIXED, NAMES, Engine
from .selection import TRAITS, select
from .stages import compute_dtype, xp

__all__ = [
    "Engine",
    "NAMES",
    "FIXED",
    "ENGINES",
    "EngineEntry",
    "BLOCK_SCRATCH_BYTES",
    "COMPILE_ERRORS",  # noqa: F822 - built on first use by the module __getattr__
    "select",
    "accumulation_dtype",
    "shard_stats",
    "shard_grad",
    "merge",
    "block_stats",
    "block_grad_",
]

# Engine, NAMES, FIXED (dualvp_torch.engine_names) and select (dualvp_torch.selection) are re-exported here:
# choosing an engine, which the checks do, imports no engine.

#: The eager path's temporaries per block element of the fused op, in bytes,
#: for either stage (the larger of the eager stages' per-element scratch; the
#: in-place gradient writes no separate output).
BLOCK_SCRATCH_BYTES = max(_eager_path.STATS_SCRATCH_BYTES, _eager_path.GRAD_SCRATCH_BYTES)


def __getattr__(name: str):
    # COMPILE_ERRORS is built on first use (see dualvp_torch.compiled).
    if name == "COMPILE_ERRORS":
        return _compiled_path.COMPILE_ERRORS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class EngineEntry(NamedTuple):
    """One row of :data:`ENGINES`: an engine's steps (see the module docstring) and its traits
    (:data:`dualvp_torch.selection.TRAITS`: what it serves)."""

    name: str
    #: device types it serves; ``None``: every device
    devices: Optional[frozenset]
    #: ``unavailable(device) -> reason or None``: why it cannot run on ``device`` (the ``impl`` error's text)
    unavailable: Callable[[torch.device], Optional[str]]
    #: ``plan(call) -> anything``: per-metadata launch state, cached with the call's checks
    plan: Callable[[Any], Any]
    stats: Callable
    merge: Callable
    grad: Callable
    #: the spec stages run compiled (the fused op's tile loop reads it too)
    compiled: bool
    #: the fused op runs its tile loop over the spec stages (else the fused Triton kernels)
    spec_stages: bool
    #: the fused op's scratch per tile element besides the float32 tile, in bytes
    tile_scratch_bytes: int


def accumulation_dtype(z: torch.Tensor, compiled: bool = True) -> Optional[torch.dtype]:
    """float64 row sums for compiled kernels on ``Tuning.float64_sums_devices`` (CPU and CUDA), else ``None``.

    Inductor's kernels sum a row sequentially in a few vector lanes, so a
    float32 sum over ~1e5 columns drifts by about sqrt(V) eps; summing in
    float64 costs one conversion per element inside the fused loop
    (docs/decisions.md, "float64 row sums in compiled kernels"). Eager torch
    sums are cascaded (as precise as the float64 path here), and there a
    float64 sum would cost a float64 copy of the chunk and two more passes.
    """
    return torch.float64 if compiled and z.device.type in tuning.current().float64_sums_devices else None


def _eager_tau(tau, temperature):
    # The eager path hands the spec the number 1 rather than a tensor holding
    # 1, and the spec skips that division (exact either way): one op fewer per
    # chunk at the common tau = 1. The compiled stages keep the tensor (a
    # temperature that changes must not recompile them; they fuse the
    # division anyway).
    return 1 if temperature == 1 else tau


def shard_stats(
    z, local, owns, keep, tau, *, with_entropy: bool = True, compiled: bool = True,
    temperature: Optional[float] = None,
) -> torch.Tensor:
    """``[T, 6]`` statistics ``spec.block_stats`` of the shard ``z [T, V_local]``.

    ``tau`` is a 0-d tensor of the compute dtype; ``with_entropy=False``
    skips the entropy's statistic (see ``spec.block_stats``; the compiled CPU
    stage computes it anyway for ``Tuning.full_stats_cpu_dtypes``);
    ``compiled``: try the compiled stage first; ``temperature``: the same
    temperature as a Python number, when the caller has it (the eager path
    skips dividing by 1).
    """
    n = z.shape[0]
    if n == 0:
        return torch.zeros((0, spec.N_STATS), dtype=tau.dtype, device=z.device)
    if compiled:  # one row: as two (compiled._run_one_row: batch invariance)
        shift = _stages.kept_shift(z, keep)
        full = with_entropy or (z.device.type == "cpu" and z.dtype in tuning.current().full_stats_cpu_dtypes)
        args = (z, local, owns, _stages.mask_arg(keep, z), tau, accumulation_dtype(z), full, shift)
        out, ok = _compiled_path.run(_stages.stats_stage, args, full)
        if ok:
            if shift == "max":
                _eager_path.redo_marked_rows(out, z, local, owns, keep, _eager_tau(tau, temperature), with_entropy)
            return out
    return _eager_path.stats(z, local, owns, keep, _eager_tau(tau, temperature), with_entropy)


def merge(all_stats, valid, tau, *, compiled: bool = True, on_cpu: Optional[bool] = None) -> tuple:
    """``(res [5, T], logprob [T], entropy [T])``: ``spec.reduce_stats`` over the ranks' ``[W, T, 6]``, finalized.

    ``valid`` is ``[T]`` and ``tau`` the 0-d compute-dtype temperature;
    ``res`` holds ``(M, log S, c, Mk, log Sk)``. Compiled, the merge is one
    region instead of some 34 eager ops on ``[T]`` vectors: on a GPU each
    eager op is a kernel launch that the CPU issues while the GPU waits for
    it. On the CPU the eager ops cost what the compiled region costs and
    compiling it would add to every process's first call, so there it stays
    eager unless ``on_cpu=False`` is passed (the tests)
    (docs/decisions.md, "Eager merge on CPU").
    """
    on_cpu = all_stats.device.type == "cpu" if on_cpu is None else on_cpu
    out = None
    if compiled and not on_cpu and all_stats.shape[1] > 0:
        out, _ = _compiled_path.run(_stages.merge_stage, (all_stats, valid, tau), False, has_keep=False)
    if out is None:
        out = _stages.merge_stage(all_stats, valid, tau)
    return torch.stack(out[:5]), out[6], out[7]


def _unpack(res: torch.Tensor, with_c: bool) -> tuple:
    # res [5, T] -> (M, log_s, c or None, mk, log_sk), views
    M, log_s, c, mk, log_sk = res.unbind(0)
    return M, log_s, (c if with_c else None), mk, log_sk


def shard_grad(
    z, local, owns, keep, res, valid, gl, ge, tau, *, inplace: bool = False, compiled: bool = True,
    temperature: Optional[float] = None,
):
    """Gradient ``spec.block_grad`` of the shard ``z [T, V_local]``, in ``z.dtype``.

    ``res``: the ``[5, T]`` row statistics of :func:`merge` (``c`` is read
    only with ``ge``); ``valid, gl, ge``: ``[T]`` (``ge`` may be ``None``: no
    entropy term); ``tau``: 0-d tensor of the compute dtype.
    ``inplace=True`` writes the gradient into ``z`` itself (``z`` must be
    contiguous) and returns ``z``. ``temperature``: as in :func:`shard_stats`.
    """
    n = z.shape[0]
    if n == 0:
        return z if inplace else torch.empty_like(z, memory_format=torch.contiguous_format)
    args = (z, local, owns, keep, *_unpack(res, ge is not None), valid, gl, ge, tau)
    if compiled:  # one row: as two (compiled._run_one_row: batch invariance)
        stage_args = (z, local, owns, _stages.mask_arg(keep, z)) + args[4:]
        if inplace:
            _, ok = _compiled_path.run(_stages.grad_inplace_stage, stage_args, ge is not None)
            out = z
        else:  # the compiled stage allocates its own output
            out, ok = _compiled_path.run(_stages.grad_stage, stage_args, ge is not None)
        if ok:
            return out
    return _eager_path.grad(z, z if inplace else None, *args[1:-1], _eager_tau(tau, temperature))


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


def block_stats(z, local, owns, keep, tau, *, start: int = 0, compiled: bool = True) -> torch.Tensor:
    """``[n, 6]`` statistics ``spec.block_stats`` of the block ``z [n, b]`` = columns ``[start, start + b)``.

    ``local, owns``: ``[n]`` from ``spec.target_to_local`` (columns within the
    *shard*); ``keep``: ``[n, b]`` bool or ``None``; ``tau``: 0-d tensor of
    the compute dtype.
    """
    if z.shape[0] == 0:
        return torch.zeros((0, spec.N_STATS), dtype=tau.dtype, device=z.device)
    args = (z, local, owns, keep, tau, int(start))
    stage = _stages.block_stats_stage
    if compiled:
        out, ok = _compiled_path.run(stage, args + (accumulation_dtype(z, True),), False)
        if ok:
            return out
    return stage(*args, accumulation_dtype(z, False))


def block_grad_(
    z, local, owns, keep, res, valid, gl, ge, tau, *, start: int = 0, compiled: bool = True,
) -> torch.Tensor:
    """Write ``spec.block_grad`` of the block ``z [n, b]`` (columns ``[start, start + b)``) over ``z``; return ``z``.

    ``z`` must be contiguous and is typically a float32 scratch block;
    ``res`` the ``[5, n]`` row statistics of this block's rows, the other
    arguments as in :func:`shard_grad`.
    """
    if z.shape[0] == 0:
        return z
    args = (z, local, owns, keep, *_unpack(res, ge is not None), valid, gl, ge, tau, int(start))
    stage = _stages.block_grad_inplace_stage
    if compiled:
        _, ok = _compiled_path.run(stage, args, ge is not None)
        if ok:
            return z
    stage(*args)
    return z


# --- the engines' steps ------------------------------------------------------------------


def _rows_of(y: torch.Tensor, call) -> tuple:
    # (valid, owns, local) [T] of the global ids y on this rank's shard
    return spec.target_to_local(xp, y.to(torch.int64), call.rank, call.v_local, call.opt.ignore_index)


def _tau(call, device) -> torch.Tensor:
    return torch.full((), call.opt.temperature, dtype=compute_dtype(call.dtype), device=device)


def _spec_stages(compiled: bool) -> tuple:
    """``(stats, merge, grad)`` of the engine that runs the spec stages, compiled or eager."""

    def stats(z, y, keep, call):
        rows = _rows_of(y, call)
        valid, owns, local = rows
        if compiled:
            st = shard_stats(z, local, owns, keep, _tau(call, z.device), with_entropy=call.opt.with_entropy,
                             temperature=call.opt.temperature)
        elif z.shape[0]:  # shard_stats(compiled=False), without its frame: the eager path itself
            t = call.opt.temperature
            st = _eager_path.stats(z, local, owns, keep, 1 if t == 1 else _tau(call, z.device), call.opt.with_entropy)
        else:
            st = torch.zeros((0, spec.N_STATS), dtype=compute_dtype(call.dtype), device=z.device)
        return st, None, rows

    def merge_(all_stats, y, rows, call):
        valid = _rows_of(y, call)[0] if rows is None else rows[0]
        res, logprob, entropy = merge(all_stats, valid, _tau(call, all_stats.device), compiled=compiled)
        return logprob, entropy, res

    def grad(z, y, keep, res, gl, ge, call, out=None):
        valid, owns, local = _rows_of(y, call)
        cdt = compute_dtype(call.dtype)
        # Contiguous O(T) vectors: upstream gradients often arrive expanded
        # (stride 0), and a stride change would recompile the kernel.
        gl = gl.to(cdt).contiguous()
        ge = None if ge is None else ge.to(cdt).contiguous()
        return shard_grad(z, local, owns, keep, res, valid, gl, ge, _tau(call, z.device), inplace=out is not None,
                          compiled=compiled, temperature=call.opt.temperature)

    return stats, merge_, grad


# The Triton engine: a thin adapter over the launchers of dualvp_torch/logits_triton.py (imported at the
# first call: triton is optional). Its plan is logits_triton.Plan, made once per call metadata with the
# call's checks; the checks, the agreement and the bad-target count are the op's own (dualvp_torch.checks),
# so the plan is a validate=False one (no counter in the kernels). At W = 1 with one column split
# (plan.finalize) the statistics kernel writes the outputs itself: stats passes them to merge in ``rows``.


#: dualvp_torch.logits_triton, imported at the first step (its plan, made with the call's checks by
#: dualvp_torch.selection, imported it already; an import statement per step cost ~1 us of host time each).
_lt = None


def _launchers():
    global _lt
    from . import logits_triton

    _lt = logits_triton
    return logits_triton


def _triton_stats(z, y, keep, call):
    # z, keep: [T, V_local] from the op; the kernels want unit column stride (a copy only where it is not)
    z = z if z.stride(-1) == 1 else z.contiguous()
    keep = None if keep is None else (keep if keep.stride(-1) == 1 else keep.contiguous()).view(torch.uint8)
    plan = call.plan
    lt = _lt or _launchers()
    if plan.finalize:  # one launch: logprob, entropy, res; "stats" is any tensor (a group of 1 gathers it)
        logprob, entropy, res, _ = lt.stats_outputs(z, y, keep, plan)
        return res, None, (logprob, entropy, res)
    st, _ = lt.stats(z, y, keep, plan)  # [S, T, 6]
    return st, None, None


def _triton_merge(all_stats, y, rows, call):
    if rows is not None:
        return rows
    # [W, S, T, 6] -> [W S, T, 6]: the merge is associative over ranks and column splits alike
    return (_lt or _launchers()).merge(all_stats.flatten(0, 1), y, call.plan)  # (T may be 0: no reshape(-1, ...))


def _triton_grad(z, y, keep, res, gl, ge, call, out=None):
    z = z if z.stride(-1) == 1 else z.contiguous()
    keep = None if keep is None else (keep if keep.stride(-1) == 1 else keep.contiguous()).view(torch.uint8)
    return (_lt or _launchers()).grad(z, y, keep, res, gl, ge, call.plan, out=out)


def _entry(name: str, stats, merge_, grad, *, compiled: bool, tile_scratch_bytes: int) -> EngineEntry:
    t = TRAITS[name]
    return EngineEntry(name, t.devices, t.unavailable, t.plan, stats, merge_, grad, compiled=compiled,
                       spec_stages=t.spec_stages, tile_scratch_bytes=tile_scratch_bytes)


#: The registry: engine name -> its steps and traits.
ENGINES: dict[str, EngineEntry] = {
    "compiled": _entry("compiled", *_spec_stages(True), compiled=True, tile_scratch_bytes=0),
    "eager": _entry("eager", *_spec_stages(False), compiled=False, tile_scratch_bytes=BLOCK_SCRATCH_BYTES),
    "triton": _entry("triton", _triton_stats, _triton_merge, _triton_grad, compiled=False, tile_scratch_bytes=0),
}
assert tuple(ENGINES) == NAMES
