"""The tuning choices of the torch stages, as one frozen object.

:class:`Tuning` holds every choice that rests on a measurement rather than on
the math (which row sums run in float64, which devices compile for a fixed
vocabulary width, ...); the numbers are the same under every setting within
the shared tolerances. :data:`DEFAULT` is what every call uses unless a block
runs under :func:`using`::

    from dualvp_torch import tuning

    with tuning.using(tuning.Tuning(max_eager_workers=1)):
        lp, h = logprob_entropy(z, y, impl="eager")

The setting is process-wide (the eager path's worker threads read it too):
blocks that use different settings must not run at the same time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Iterator, Optional

import torch

__all__ = ["Tuning", "DEFAULT", "GRADIENT_ROUNDINGS", "current", "using"]


def _frozenset_field(name: str, value, kind: type) -> frozenset:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{name}: expected a set of {kind.__name__}, got {value!r}")
    items = frozenset(value)
    bad = [v for v in items if not isinstance(v, kind)]
    if bad:
        raise TypeError(f"{name}: expected a set of {kind.__name__}, got {bad[0]!r} in it")
    return items


#: The values of :attr:`Tuning.gradient_rounding`.
GRADIENT_ROUNDINGS = ("split", "once", "fixed")


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Choices of the torch stages that rest on a measurement (``docs/decisions.md``).

    Attributes:
      float64_sums_devices: device types ("cpu", "cuda") whose compiled
        kernels sum rows in float64 (:func:`dualvp_torch.engines.accumulation_dtype`);
        without a device its compiled sums are float32
        (docs/decisions.md, "float64 row sums in compiled kernels").
      static_vocab_devices: device types on which the shard stages are
        compiled for the vocabulary width they first see, only the row count
        dynamic (a new width recompiles)
        (docs/decisions.md, "Static vocabulary width on CUDA").
      full_stats_cpu_dtypes: input dtypes whose compiled CPU statistics keep
        the entropy's statistic even with ``with_entropy=False`` (the leaner
        kernel is the slower one there)
        (docs/decisions.md, "Full statistics for 16-bit CPU input").
      max_eager_workers: most worker threads of the eager path on CPU (also
        at most ``torch.get_num_threads()``); 1 runs the chunks in the
        calling thread, on its intra-op threads: then a row wider than
        ATen's parallel grain (32768 elements) may be summed in another order
        in a call of a few rows, and the eager path is batch-invariant only
        for narrower rows (docs/decisions.md, "Batch invariance: one
        reduction order per row").
      cpu_chunk_scratch_bytes: most bytes of temporaries of one eager CPU
        chunk (docs/decisions.md, "Eager CPU chunks within a cache-sized bound").
      glibc_heap: opt in to :mod:`dualvp_torch.host_memory` (glibc heap
        thresholds and ``malloc_trim`` around the eager CPU chunks); off, the
        op makes no allocator call of its own
        (docs/decisions.md, "glibc heap calls of the eager path: opt-in").
      gradient_rounding: how the fused LM-head op's 16-bit backward products
        take the float32 gradient block ``G``: ``"fixed"`` (the default)
        rounded once, and the rounding residual ``G - rnd(G)`` at up to
        three columns per row (the target's and the other columns with
        ``p_v > 1/3``, at most two) added back as rank-1 terms (8 T H V +
        O(T H) FLOP, 1.0x the credited 8 T H V; the Triton ``"gemm"``
        backward and the tile path's 16-bit GEMMs on CUDA; the ``"atomic"``
        backward runs it as ``"split"``; dh/dW within 2x of the float64
        result rounded once, issue 45's rule, not within the element-wise
        tolerance); ``"split"`` a high and a low 16-bit part, two products
        each (12 T H V, 1.5x; dh/dW also within the element-wise 16-bit
        tolerance); ``"once"`` rounded once, as the peers do (8 T H V;
        dh/dW error up to 3x that of float64 rounded once)
        (docs/decisions.md, "Fused G rounding: "fixed" at every column with
        p > 1/3, the default").
      triton_default_devices: device types ("cuda") on which ``impl=None``
        selects the logits op's Triton kernels (``impl="triton"``) when
        ``triton`` is installed. Empty until a GPU run has checked them
        against the oracle and the bench (docs/decisions.md, "Triton kernels
        opt-in until a GPU run"); the compiled stages stay the default.
      triton_linear_backward: the fused op's Triton backward: ``"gemm"``
        (the kernel writes ``G`` per vocabulary chunk in the weight's dtype,
        cuBLAS forms ``dh`` and ``dW``; no atomics) or ``"atomic"`` (products
        in the kernel, float32 atomic adds)
        (docs/decisions.md, "Fused backward: G chunk + cuBLAS products").
      triton_linear_blocks: ``(BLOCK_T, BLOCK_V, BLOCK_K, num_warps)`` of the
        fused op's Triton kernels on CUDA (``num_warps`` may be ``None``), or
        ``None`` for the built-in tiles.
    """

    float64_sums_devices: frozenset = frozenset({"cpu", "cuda"})
    static_vocab_devices: frozenset = frozenset({"cuda"})
    full_stats_cpu_dtypes: frozenset = frozenset({torch.bfloat16, torch.float16})
    max_eager_workers: int = 8
    cpu_chunk_scratch_bytes: int = 16 << 20
    glibc_heap: bool = False
    gradient_rounding: str = "fixed"
    triton_default_devices: frozenset = frozenset()
    triton_linear_blocks: Optional[tuple] = None
    triton_linear_backward: str = "gemm"

    def __post_init__(self):
        for name in ("float64_sums_devices", "static_vocab_devices", "triton_default_devices"):
            object.__setattr__(self, name, _frozenset_field(name, getattr(self, name), str))
        object.__setattr__(
            self, "full_stats_cpu_dtypes", _frozenset_field("full_stats_cpu_dtypes", self.full_stats_cpu_dtypes,
                                                            torch.dtype)
        )
        for name in ("max_eager_workers", "cpu_chunk_scratch_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        for name in ("glibc_heap",):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if self.gradient_rounding not in GRADIENT_ROUNDINGS:
            raise ValueError(f"gradient_rounding: expected one of {GRADIENT_ROUNDINGS}, "
                             f"got {self.gradient_rounding!r}")
        if self.triton_linear_backward not in ("gemm", "atomic"):
            raise ValueError(f"triton_linear_backward: expected 'gemm' or 'atomic', "
                             f"got {self.triton_linear_backward!r}")
        b = self.triton_linear_blocks
        if b is not None:
            ok = (isinstance(b, tuple) and len(b) == 4 and all(isinstance(x, int) and not isinstance(x, bool)
                                                                 and x > 0 for x in b[:3])
                  and (b[3] is None or (isinstance(b[3], int) and b[3] > 0)))
            if not ok:
                raise TypeError(f"triton_linear_blocks: expected None or (BLOCK_T, BLOCK_V, BLOCK_K, num_warps) "
                                f"positive ints (num_warps may be None), got {b!r}")


#: The setting every call uses outside :func:`using`.
DEFAULT = Tuning()

_current = [DEFAULT]
_lock = threading.Lock()


def current() -> Tuning:
    """The setting in force: the innermost :func:`using` block's, else :data:`DEFAULT`."""
    return _current[-1]


@contextlib.contextmanager
def using(setting: Tuning) -> Iterator[Tuning]:
    """Run the block with ``setting`` in force (process-wide; blocks nest).

    Raises:
      TypeError: ``setting`` is not a :class:`Tuning`.
    """
    if not isinstance(setting, Tuning):
        raise TypeError(f"setting: expected a dualvp_torch.tuning.Tuning, got {type(setting).__name__}")
    with _lock:
        _current.append(setting)
    try:
        yield setting
    finally:
        with _lock:
            # remove this block's entry (the last one, unless blocks of other threads interleaved)
            for i in range(len(_current) - 1, 0, -1):
                if _current[i] is setting:
                    del _current[i]
                    break
