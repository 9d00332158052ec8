"""The option modes of the op, one table for the tests and the bench.

A :class:`Mode` says which outputs a caller asks for: the entropy or not, its
gradient or not, and whether the log-prob is taken under a keep mask. The
bench times every mode of :data:`MODES`; the memory, gradcheck and naive-oracle
tests pick theirs from it by name.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Mode", "MODES"]


class Mode(NamedTuple):
    """What one mode computes."""

    with_entropy: bool  # the entropy is returned
    entropy_grad: bool  # ... and its gradient reaches the logits
    masked: bool  # the log-prob is under a keep mask

    def options(self) -> dict:
        """The op's keyword arguments for this mode (the keep mask is the caller's)."""
        return dict(with_entropy=self.with_entropy, entropy_grad=self.entropy_grad)


#: name -> mode; ``.keep``: under a keep mask.
MODES: dict[str, Mode] = {
    "lp": Mode(False, False, False),
    "lp+ent": Mode(True, False, False),
    "lp+ent+grad": Mode(True, True, False),
    "lp.keep": Mode(False, False, True),
    "lp+ent.keep": Mode(True, False, True),
    "lp+ent+grad.keep": Mode(True, True, True),
}
