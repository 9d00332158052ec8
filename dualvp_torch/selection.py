"""Which engine a call runs, and what the checks need to know of it: the engines' traits.

:func:`select` (the engine of a call: ``impl``, else the default for the device, see
:mod:`dualvp_torch.engines`) and :data:`TRAITS` (per engine: the devices it serves, why it cannot run
on a device, its per-metadata launch plan, whether it runs the spec stages). The checks
(:mod:`dualvp_torch.checks`) read these and nothing else of the engines; :data:`dualvp_torch.engines.ENGINES`
adds each engine's steps to its traits.
"""

from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple, Optional

import torch

from . import triton_kernels as _triton
from . import tuning
from .engine_names import NAMES, compile_failed

__all__ = ["Traits", "TRAITS", "select"]


class Traits(NamedTuple):
    """What an engine is, apart from its steps (see :class:`dualvp_torch.engines.EngineEntry`)."""

    #: device types it serves; ``None``: every device
    devices: Optional[frozenset]
    #: ``unavailable(device) -> reason or None``: why it cannot run on ``device`` (the ``impl`` error's text)
    unavailable: Callable[[torch.device], Optional[str]]
    #: ``plan(call) -> anything``: per-metadata launch state, cached with the call's checks
    plan: Callable[[Any], Any]
    #: the fused op runs its tile loop over the spec stages (else the fused Triton kernels)
    spec_stages: bool


def select(impl: Optional[str] = None, device: Optional[torch.device] = None, *, triton_default: bool = True) -> str:
    """The engine a call runs: ``impl`` if given, else the default for ``device`` (see :mod:`dualvp_torch.engines`).

    ``"compiled"`` becomes ``"eager"`` once compiling has failed in this
    process. ``triton_default=False``: ``impl=None`` never selects
    ``"triton"`` (the fused op).

    Raises:
      ValueError: ``impl`` is not ``None`` or one of :data:`~dualvp_torch.engine_names.NAMES`.
    """
    if impl is None:
        if (triton_default and device is not None and device.type in tuning.current().triton_default_devices
                and _triton.available()):
            return "triton"
        off = os.environ.get("DUALVP_COMPILE", "1").strip().lower() in ("0", "false", "no")
        impl = "eager" if off else "compiled"
    elif impl not in NAMES:
        raise ValueError(f"impl: expected None or one of {NAMES}, got {impl!r}")
    if impl == "compiled" and compile_failed():
        return "eager"
    return impl


def _triton_unavailable(device: torch.device) -> Optional[str]:
    if not _triton.available():
        return "needs the triton package (pip install 'dualvp[triton]'), not installed"
    if device.type == "cpu" and not _triton.interpreting():
        return "runs CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), got logits on the CPU"
    return None


def _triton_plan(call):
    # logits_triton.Plan, made once per call metadata with the call's checks; a validate=False one (the
    # checks, the agreement and the bad-target count are the op's own). Imported here: triton is optional.
    from . import logits_triton

    return logits_triton.make_plan(call.opt, call.rank, call.world, call.rows, call.v_local, call.dtype,
                                   call.device_type, False, None)


def _no_plan(call):
    return None


def _everywhere(device: torch.device) -> Optional[str]:
    return None


#: engine name -> its traits.
TRAITS: dict[str, Traits] = {
    "compiled": Traits(None, _everywhere, _no_plan, spec_stages=True),
    "eager": Traits(None, _everywhere, _no_plan, spec_stages=True),
    "triton": Traits(frozenset({"cuda", "cpu"}), _triton_unavailable, _triton_plan, spec_stages=False),
}
assert tuple(TRAITS) == NAMES
