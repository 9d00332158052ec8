"""The trace-time choices of the JAX op, as one frozen static argument.

:class:`Tuning` is hashable and part of the ``jit`` / ``custom_vjp`` static
configuration, next to :class:`~dualvp.validation.Options`: a call with
another tuning is another trace, so nothing has to clear JAX's caches. The
public functions use :data:`DEFAULT`; tests pass other instances to the
private entry points to reach the paths that a given platform does not take.

The spec's codegen choices that the JAX op makes are fixed here, not tuned:
they change how XLA compiles the sums, never the results.
"""

from __future__ import annotations

import dataclasses

from . import chunks

__all__ = ["Tuning", "DEFAULT", "ENTROPY_TERMS", "INDICATOR", "PATHS"]

#: ``spec.block_stats(entropy_terms=...)`` in every forward: a select of 0
#: where ``e^d = 0`` lets XLA fuse ``d`` into both loops
#: (docs/decisions.md, "dualvp_jax: entropy terms by select").
ENTROPY_TERMS = "select"

#: ``spec.block_grad(indicator=...)`` in every backward: the target's
#: indicator in integer arithmetic, no compare in the gradient's loop, which
#: XLA:CPU then vectorises (docs/decisions.md, "dualvp_jax: arithmetic indicator").
INDICATOR = "arith"

#: The forwards of the shard statistics: ``"auto"`` (the chunked program on
#: the CPU, the whole shard elsewhere, chosen per platform at lowering),
#: ``"chunked"`` and ``"whole"`` (that program on every platform).
PATHS = ("auto", "chunked", "whole")


@dataclasses.dataclass(frozen=True)
class Tuning:
    """How the op's forward is laid out; every instance gives the same results up to rounding.

    Attributes:
      path: one of :data:`PATHS`.
      chunk_bytes: budget of one float32 ``[rows, V_local]`` intermediate of
        the chunked forward (:func:`dualvp_jax.chunks.chunk_rows`).
      column_block: widest column block of one row reduction of the chunked
        forward (:func:`dualvp_jax.chunks.column_blocks`).
    """

    path: str = "auto"
    chunk_bytes: int = chunks.CHUNK_BYTES
    column_block: int = chunks.COLUMN_BLOCK

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"path: expected one of {PATHS}, got {self.path!r}")
        for name in ("chunk_bytes", "column_block"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")


#: What the public functions use.
DEFAULT = Tuning()
