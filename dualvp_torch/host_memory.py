"""Opt-in glibc heap calls around the eager path's CPU chunks (``Tuning(glibc_heap=True)``).

Off by default: without it the op makes no allocator call of its own. With
it, on Linux with glibc (elsewhere both calls do nothing):

* :func:`keep_chunk_scratch_mapped`, once per process and chunk bound, before
  the first chunk loop: glibc returns a heap's free top to the kernel past a
  trim threshold that follows the largest mmap'd block freed so far, and the
  chunk temporaries alone leave it below one chunk's scratch, so each chunk
  page-faults its scratch in again. Freeing one block of the chunk bound
  (mapped, never touched) moves the thresholds where glibc's own rule puts
  them after such a block: a worker's chunks then reuse the same pages.
* :func:`release_chunk_scratch`, after the forward's chunk loop: each worker
  thread allocates from a glibc arena of its own, which keeps the freed chunk
  scratch resident into the backward; ``malloc_trim(0)`` returns it.

The figures: (docs/decisions.md, "glibc heap calls of the eager path: opt-in").
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

__all__ = ["keep_chunk_scratch_mapped", "release_chunk_scratch"]


@functools.lru_cache(maxsize=None)
def _libc_function(name: str, *argtypes: str, restype: Optional[str] = "c_int") -> Optional[Callable]:
    """The C library's ``name`` on Linux, else ``None``.

    ``restype name(argtypes...)`` in ctypes type names; ``restype=None``: void.
    """
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):  # no C library, or not glibc (malloc_trim)
        return None
    fn.argtypes = [getattr(ctypes, t) for t in argtypes]
    fn.restype = None if restype is None else getattr(ctypes, restype)
    return fn


def malloc_trim() -> Optional[Callable]:
    """glibc's ``malloc_trim``, or ``None`` (not Linux, not glibc)."""
    return _libc_function("malloc_trim", "c_size_t")


@functools.lru_cache(maxsize=None)
def keep_chunk_scratch_mapped(chunk_bytes: int) -> None:
    """Free one mapped, untouched block of ``chunk_bytes`` (once per process and size): see the module."""
    malloc = _libc_function("malloc", "c_size_t", restype="c_void_p")
    free = _libc_function("free", "c_void_p", restype=None)
    if malloc is not None and free is not None:
        free(malloc(chunk_bytes))


def release_chunk_scratch() -> None:
    """``malloc_trim(0)``: return the freed chunk scratch of every arena to the kernel (see the module)."""
    trim = malloc_trim()
    if trim is not None:
        trim(0)
