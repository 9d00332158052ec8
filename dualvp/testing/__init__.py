"""Conformance fixtures: the shared cases, one oracle, one error metric, typed backend adapters.

* :mod:`~dualvp.testing.cases`: the scenario table :data:`CASES` (and
  :data:`KEEP_IDS_CASES`, its keep-mask cases with the kept set as ids),
  :func:`make` (a case's NumPy arrays), the bad-input table :data:`BAD_INPUTS`;
* :mod:`~dualvp.testing.metrics`: :data:`TOLERANCES`, :func:`max_errors` /
  :func:`within_tolerance` (non-finite entries matched in one place) and
  :func:`compare` (report rows);
* :mod:`~dualvp.testing.oracle`: :func:`oracle` (the float64 answer of a
  problem) and :class:`Outputs`; for the fused LM head (a
  :class:`~dualvp.testing.cases.LinearProblem` from
  :func:`~dualvp.testing.cases.make_linear`) :class:`LinearOutputs`;
* :mod:`~dualvp.testing.backends`: :func:`run` ``(backend, problem, world) -> Outputs``
  for ``spec``, ``torch`` and ``jax``;
* :mod:`~dualvp.testing.extended`: the variants with K targets per row, a
  per-row temperature and ``sum p^2`` (:data:`~dualvp.testing.extended.EXT_CASES`,
  their oracle and bad inputs);
* :mod:`~dualvp.testing.modes`: the option modes shared by tests and bench;
* :mod:`~dualvp.testing.faults`: the deliberate-fault seam (``DUALVP_TEST_FAULT``).

``dualvp verify`` and the test suite both use these; nothing here imports
torch or JAX until a backend runs.
"""

from typing import Union

from . import backends, cases, extended, faults, metrics, modes
from .backends import BACKENDS, run, run_all
from .metrics import (LINEAR_QUANTITIES, QUANTITIES, TOLERANCES, Row, compare, max_errors, pair_tolerance, tolerance,
                      within_rounding, within_tolerance)
from .oracle import LinearOutputs, Outputs, oracle, oracle_linear

__all__ = [
    "cases", "extended", "metrics", "modes", "backends", "faults",
    "Outputs", "LinearOutputs", "oracle", "oracle_linear", "run", "run_all", "BACKENDS",
    "TOLERANCES", "Row", "compare", "failures", "max_errors", "within_tolerance", "within_rounding", "tolerance",
    "pair_tolerance",
    "QUANTITIES",
    "LINEAR_QUANTITIES",
]


def failures(problem: Union[cases.Problem, cases.LinearProblem], results: dict, *, rounding_rule: bool = False
             ) -> list:
    """The failing rows of :func:`compare` of ``results`` (backend -> Outputs) vs the oracle, as text.

    ``rounding_rule=True``: a 16-bit fused op's ``dh`` / ``dW`` against the
    oracle (and between backends) are judged by issue 45's rule
    (:func:`within_rounding`: max |error| <= 2 x that of the float64 result
    rounded once) instead of element-wise, as its default
    ``gradient_rounding="fixed"`` meets them (the option ``"split"`` meets
    the element-wise tolerance; :func:`compare`).
    """
    ref = oracle(problem)
    rows = compare(results, ref, problem.case.dtype, rounding_rule=rounding_rule)
    return [f"{r.check} {r.quantity}: abs {r.abs_err:.3e} rel {r.rel_err:.3e}" for r in rows if not r.ok]
