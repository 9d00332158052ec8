"""``oracle(problem)``: the float64 answer of :mod:`dualvp.reference` for a :class:`~dualvp.testing.cases.Problem`."""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from .. import reference
from .cases import Problem

__all__ = ["Outputs", "oracle"]


class Outputs(NamedTuple):
    """What every backend adapter (and the oracle) returns, as float64 NumPy arrays.

    ``logprob [...]``, ``entropy [...]`` and ``grad [..., V]`` over the full
    vocabulary (shards joined), the gradient of
    ``sum(grad_logprob * logprob + grad_entropy * entropy)``.
    """

    logprob: np.ndarray
    entropy: Optional[np.ndarray]
    grad: Optional[np.ndarray]


def oracle(problem: Problem, *, logprob_grad: bool = True, entropy_grad: bool = True) -> Outputs:
    """The float64 oracle of ``problem`` (its keep mask, temperature, ``ignore_index``, upstream gradients).

    ``logprob_grad`` / ``entropy_grad``: whether the log-prob / entropy term
    (with the problem's upstream gradient) is part of the differentiated loss.
    """
    c = problem.case
    kw = dict(keep_mask=problem.keep_mask, temperature=c.temperature, ignore_index=c.ignore_index)
    lp, h = reference.logprob_entropy(problem.logits, problem.target, **kw)
    gl = problem.grad_logprob if logprob_grad else np.zeros_like(problem.grad_logprob)
    ge = problem.grad_entropy if entropy_grad else None
    g = reference.logprob_entropy_grad(problem.logits, problem.target, gl, ge, **kw)
    return Outputs(lp, h, g)
