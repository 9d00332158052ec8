"""``oracle(problem)``: the float64 answer of :mod:`dualvp.reference` for a problem.

A :class:`~dualvp.testing.cases.Problem` (logits) gives :class:`Outputs`; a
:class:`~dualvp.testing.cases.LinearProblem` (fused LM head) gives
:class:`LinearOutputs`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import numpy as np

from .. import reference
from .cases import LinearProblem, Problem

__all__ = ["Outputs", "LinearOutputs", "oracle", "oracle_linear"]


class Outputs(NamedTuple):
    """What every backend adapter (and the oracle) returns, as float64 NumPy arrays.

    ``logprob [...]``, ``entropy [...]`` and ``grad [..., V]`` over the full
    vocabulary (shards joined), the gradient of
    ``sum(grad_logprob * logprob + grad_entropy * entropy)``.
    """

    logprob: np.ndarray
    entropy: Optional[np.ndarray]
    grad: Optional[np.ndarray]


class LinearOutputs(NamedTuple):
    """What the fused LM-head adapters (and the oracle) return, as float64 NumPy arrays.

    ``logprob [...]``, ``entropy [...]``, ``dh [..., H]`` (the hidden gradient,
    reduced over the vocab shards) and ``dW [V, H]`` (every shard's weight
    rows joined), the gradients of ``sum(grad_logprob * logprob + grad_entropy * entropy)``.
    """

    logprob: np.ndarray
    entropy: Optional[np.ndarray]
    dh: Optional[np.ndarray]
    dW: Optional[np.ndarray]


def oracle(problem: Union[Problem, LinearProblem], *, logprob_grad: bool = True,
           entropy_grad: bool = True) -> Union[Outputs, LinearOutputs]:
    """The float64 oracle of ``problem`` (its keep mask or keep ids, temperature, ``ignore_index``, upstream gradients).

    ``logprob_grad`` / ``entropy_grad``: whether the log-prob / entropy term
    (with the problem's upstream gradient) is part of the differentiated loss.
    """
    if isinstance(problem, LinearProblem):
        return oracle_linear(problem, logprob_grad=logprob_grad, entropy_grad=entropy_grad)
    c = problem.case
    kw = dict(keep_mask=problem.keep_mask, keep_ids=problem.keep_ids, temperature=c.temperature,
              ignore_index=c.ignore_index)
    lp, h = reference.logprob_entropy(problem.logits, problem.target, **kw)
    gl = problem.grad_logprob if logprob_grad else np.zeros_like(problem.grad_logprob)
    ge = problem.grad_entropy if entropy_grad else None
    g = reference.logprob_entropy_grad(problem.logits, problem.target, gl, ge, **kw)
    return Outputs(lp, h, g)


def oracle_linear(problem: LinearProblem, *, logprob_grad: bool = True, entropy_grad: bool = True) -> LinearOutputs:
    """The float64 oracle of a fused problem: ``z = hidden @ weight^T`` in float64 from the rounded inputs.

    :func:`dualvp.reference.linear_logprob_entropy` and
    :func:`~dualvp.reference.linear_logprob_entropy_grad` on the full weight;
    ``logprob_grad`` / ``entropy_grad`` as in :func:`oracle`.
    """
    c = problem.case
    kw = dict(keep_mask=problem.keep_mask, keep_ids=problem.keep_ids, temperature=c.temperature,
              ignore_index=c.ignore_index)
    lp, h = reference.linear_logprob_entropy(problem.hidden, problem.weight, problem.target, **kw)
    gl = problem.grad_logprob if logprob_grad else np.zeros_like(problem.grad_logprob)
    ge = problem.grad_entropy if entropy_grad else None
    dh, dw = reference.linear_logprob_entropy_grad(problem.hidden, problem.weight, problem.target, gl, ge, **kw)
    return LinearOutputs(lp, h, dh, dw)
