"""The engines' names, and whether compiling has failed in this process: what choosing an engine reads.

A leaf: :mod:`dualvp_torch.compiled` records a compile failure here and :mod:`dualvp_torch.selection`
reads it, so that choosing an engine (and checking a call, which chooses one) imports no engine.
"""

from __future__ import annotations

import typing
from typing import Literal

__all__ = ["Engine", "NAMES", "FIXED", "compile_failed", "record_compile_failure"]

#: What ``impl`` may name (``None``: :func:`dualvp_torch.engines.select` chooses).
Engine = Literal["compiled", "eager", "triton"]
#: The engines' names, in the order of :data:`Engine`.
NAMES: tuple[str, ...] = typing.get_args(Engine)
#: The engines a call that names one gets as named; ``"compiled"`` falls back to ``"eager"`` once compiling
#: failed in this process, so :func:`dualvp_torch.engines.select` resolves it (and ``None``) at each call.
FIXED: frozenset = frozenset(NAMES) - {"compiled"}

# The fallback flag (tests reset it with a fresh dict).
_state: dict = {"compile_failed": False}


def compile_failed() -> bool:
    """``True`` once compiling a stage has failed in this process."""
    return _state["compile_failed"]


def record_compile_failure() -> bool:
    """Record that compiling a stage failed; ``True`` the first time (the caller warns once)."""
    first = not _state["compile_failed"]
    _state["compile_failed"] = True
    return first
