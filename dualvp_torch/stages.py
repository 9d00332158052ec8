"""The shard-local stages of the op: the spec functions themselves, over torch.

No math here: each stage calls :mod:`dualvp.spec` with the array namespace
:data:`xp` (``array_api_compat.torch``). The compiled path
(:mod:`dualvp_torch.compiled`) compiles these functions; the eager path
(:mod:`dualvp_torch.eager`) runs them op by op over row chunks.
"""

from __future__ import annotations

import types
from typing import Optional

import array_api_compat.torch as _compat_torch
import torch

from dualvp import spec

__all__ = ["xp", "compute_dtype"]


def _take_along_axis(x: torch.Tensor, indices: torch.Tensor, /, *, axis: int = -1) -> torch.Tensor:
    # array_api_compat maps take_along_axis to torch.take_along_dim, whose
    # meta function makes dynamo guard on the exact sizes: every new
    # (T, V_local) would recompile the stage, and past dynamo's recompile
    # limit the op would fall back to eager for good. torch.gather takes the
    # same indices (same rank, int64) and keeps the sizes symbolic.
    return torch.gather(x, axis, indices)


#: The array namespace the stages run the spec over: ``array_api_compat.torch``
#: with ``take_along_axis`` as :func:`torch.gather` (see ``_take_along_axis``).
xp = types.SimpleNamespace(**{k: getattr(_compat_torch, k) for k in dir(_compat_torch) if not k.startswith("__")})
xp.take_along_axis = _take_along_axis


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 input, float32 for every 16/32-bit float."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def kept_shift(z: torch.Tensor, keep: Optional[torch.Tensor]) -> str:
    """``"max"`` for masked statistics on CPU, else ``"kept"`` (see ``spec.block_stats``).

    On CPU the masked statistics shift the kept sum by the overall max (one
    read of the mask, one exponential with no blended argument), and the
    rows that marks are recomputed after a host-side check
    (:func:`dualvp_torch.eager.redo_marked_rows`), which on a GPU would be a
    synchronisation (docs/decisions.md, "One-pass masked statistics on CPU").
    """
    return "max" if keep is not None and z.device.type == "cpu" else "kept"


def as_bool(keep: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The keep mask as bool, inside the stage: a uint8 view (:func:`mask_arg`) becomes a float compare.

    The generated CPU code then converts 16 bytes to 16 floats with one
    vector instruction and compares them as floats; ``keep != 0`` builds a
    uint8 lane mask whose conversion to a float blend mask is slow
    (docs/decisions.md, "The CPU mask as uint8, compared as float").
    """
    return keep if keep is None or keep.dtype == torch.bool else keep.to(torch.float32) > 0


def mask_arg(keep: Optional[torch.Tensor], z: torch.Tensor) -> Optional[torch.Tensor]:
    """What the compiled stages receive as the mask: its uint8 view on CPU (the same bytes, no copy).

    Inductor's CPU code loads a bool tensor lane by lane, a uint8 tensor as
    one vector load (docs/decisions.md, "The CPU mask as uint8, compared as float").
    """
    return keep.view(torch.uint8) if keep is not None and z.device.type == "cpu" else keep


# --- the stages (their names key the compile cache: dualvp_torch.compiled) ------------


def stats_stage(
    z, local, owns, keep: Optional[torch.Tensor], tau, acc_dtype: Optional[torch.dtype] = None,
    with_entropy: bool = True, kept_shift: str = "kept",
):
    """``spec.block_stats`` of the shard ``z [T, V_local]`` in the compute dtype: ``[T, 6]``."""
    return spec.block_stats(
        xp, z, local, owns, as_bool(keep), tau, dtype=compute_dtype(z.dtype), acc_dtype=acc_dtype,
        with_entropy=with_entropy, kept_shift=kept_shift,
    )


def grad_stage(z, local, owns, keep: Optional[torch.Tensor], M, log_s, c, mk, log_sk, valid, gl, ge, tau):
    """``spec.block_grad`` of the shard, in ``z.dtype``."""
    comb = spec.Combined(M=M, log_s=log_s, c=c, mk=mk, log_sk=log_sk, zy=None)
    g = spec.block_grad(xp, z, local, owns, as_bool(keep), comb, valid, gl, ge, tau, dtype=compute_dtype(z.dtype))
    # (the array API's astype copies even to the same dtype: a pass over the block on the eager path)
    return g if g.dtype == z.dtype else xp.astype(g, z.dtype)


def grad_inplace_stage(z, local, owns, keep: Optional[torch.Tensor], M, log_s, c, mk, log_sk, valid, gl, ge, tau):
    """:func:`grad_stage` written over ``z``: compiled, one kernel reads each element and writes its gradient."""
    z.copy_(grad_stage(z, local, owns, keep, M, log_s, c, mk, log_sk, valid, gl, ge, tau))


def merge_stage(all_stats, valid, tau):
    """``(*comb, logprob, entropy)`` from the ranks' ``[W, T, 6]`` statistics.

    One rank's statistics are already reduced: ``spec.reduce_stats`` over
    one block gives back ``m, s, t, mk, sk`` bit for bit (weights ``e^0 = 1``,
    shifts ``s * 0 = +0``; a stage's ``t`` is never ``-0``: torch's row sums
    start from ``+0``), and ``zy`` as torch's one-term sum, ``zy + 0``
    (a target logit ``-0`` becomes ``+0``). So ``W = 1`` skips its ~35 ops.
    """
    if all_stats.shape[0] == 1:
        one = all_stats[0]
        stats = torch.cat([one[:, :spec.N_STATS - 1], one[:, spec.N_STATS - 1:] + 0.0], dim=-1)
    else:
        stats = spec.reduce_stats(xp, all_stats, axis=0, temperature=tau)
    comb = spec.finalize(xp, stats, tau)
    return (*comb, *spec.outputs(xp, comb, valid, tau))


def block_stats_stage(z, local, owns, keep: Optional[torch.Tensor], tau, start, acc_dtype=None):
    """``spec.block_stats`` of the block ``z [n, b]`` = columns ``[start, start + b)`` of the shard."""
    return spec.block_stats(xp, z, local, owns, keep, tau, start=start, dtype=tau.dtype, acc_dtype=acc_dtype)


def block_grad_inplace_stage(
    z, local, owns, keep: Optional[torch.Tensor], M, log_s, c, mk, log_sk, valid, gl, ge, tau, start
):
    """``spec.block_grad`` of the block written over ``z``."""
    comb = spec.Combined(M=M, log_s=log_s, c=c, mk=mk, log_sk=log_sk, zy=None)
    g = spec.block_grad(xp, z, local, owns, keep, comb, valid, gl, ge, tau, start=start, dtype=tau.dtype)
    z.copy_(xp.astype(g, z.dtype))


#: The stages over a whole shard (``Tuning.static_vocab_devices`` applies to these).
SHARD_STAGES = (stats_stage, grad_stage, grad_inplace_stage)
