"""Hand-written Triton kernels of the CUDA path, one kernel per module.

Each kernel module says in its docstring which :mod:`dualvp.spec` functions
it implements; the tests run every kernel against the float64 oracle on the
conformance table, on the GPU and, under ``TRITON_INTERPRET=1``, on the CPU.
Nothing here is imported until a Triton path runs: ``triton`` is an optional
dependency (the ``triton`` extra).
"""

from __future__ import annotations

import functools
import importlib.util
import os

__all__ = ["available", "interpreting"]


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """``True`` when the ``triton`` package can be imported (it is not imported here)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """``True`` under ``TRITON_INTERPRET=1``: kernels run on the CPU (NumPy), on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
