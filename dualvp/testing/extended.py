"""Conformance variants of the extended op: K targets per row, a per-row temperature, ``sum_v p_v^2``.

Each :class:`ExtCase` takes a base :class:`~dualvp.testing.cases.Case` of
:data:`~dualvp.testing.cases.CASES` (its logits, mask, dtype, ignored rows,
extreme rows) and adds the options; :func:`make_ext` builds the arrays and
:func:`oracle_ext` the float64 answer (:mod:`dualvp.reference`). The
tolerances are :data:`~dualvp.testing.TOLERANCES` (``sum_p2``, a number in
``(0, 1]`` formed from the same sums as the entropy, is judged with the
entropy's).

Arrays:

* ``target``: ``[..., K]`` with ``K = case.targets`` (``[...]`` when 0):
  column 0 is the base case's target (its ignored rows, its banned or
  dropped targets), the others are drawn from the row's finite columns, with
  a repeated id in the first row and a few ``ignore_index`` entries when the
  base case has ignored rows.
* ``temperature``: with ``row_temperature``, one per row, ``case.temperature``
  times ``e^U(-0.7, 0.7)``, rounded to float32 (float64 for float64 cases), a
  ``[...]`` array; otherwise the base case's number.
* ``grad_logprob``: ``[..., K]`` (``[...]`` when ``targets`` is 0); with
  ``sum_p2`` a ``grad_sum_p2 [...]`` as well: the oracle's gradient is that
  of ``sum(gL L) + sum(gH H) + sum(gS sum_p2)``.

:data:`EXT_BAD_INPUTS` lists the invalid calls of the new options (same
:class:`~dualvp.testing.cases.BadInput` format; the base arguments of
:func:`~dualvp.testing.cases.bad_input_base`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import numpy as np

from .. import reference
from .cases import BadInput, Case, case as base_case, make
from .metrics import tolerance, within_tolerance, max_errors

__all__ = ["ExtCase", "ExtProblem", "ExtOutputs", "EXT_CASES", "ext_case", "make_ext", "oracle_ext",
           "ext_failures", "EXT_BAD_INPUTS"]


@dataclass(frozen=True)
class ExtCase:
    """A base case plus the extended options.

    Attributes:
      name: unique id.
      base: the base :class:`~dualvp.testing.cases.Case`.
      targets: ``K`` targets per row (``multi_target=True``); 0: one target ``[...]``.
      row_temperature: a temperature array ``[...]`` (one per row).
      sum_p2: ``with_sum_p2=True``.
    """

    name: str
    base: Case
    targets: int = 0
    row_temperature: bool = False
    sum_p2: bool = False

    @property
    def dtype(self) -> str:
        return self.base.dtype

    @property
    def worlds(self) -> tuple:
        return self.base.worlds

    @property
    def ignore_index(self) -> int:
        return self.base.ignore_index


@dataclass
class ExtProblem:
    """Arrays of an :class:`ExtCase` (NumPy; logits float64 values exact in the case dtype)."""

    case: ExtCase
    logits: np.ndarray  # [..., V]
    target: np.ndarray  # [..., K] or [...]
    keep_mask: Optional[np.ndarray]
    temperature: Union[float, np.ndarray]  # a number or [...] (float64 values, exact in float32 unless float64)
    grad_logprob: np.ndarray  # like target
    grad_entropy: np.ndarray  # [...]
    grad_sum_p2: Optional[np.ndarray] = None  # [...] with case.sum_p2

    def shard(self, rank: int, world: int):
        """Columns of rank ``rank`` of ``world``: ``(logits, keep_mask)``."""
        v = self.logits.shape[-1] // world
        sl = slice(rank * v, (rank + 1) * v)
        return self.logits[..., sl], (None if self.keep_mask is None else self.keep_mask[..., sl])


class ExtOutputs(NamedTuple):
    """``logprob`` (target's shape), ``entropy [...]``, ``grad [..., V]``, ``sum_p2 [...]`` or ``None``; float64."""

    logprob: np.ndarray
    entropy: np.ndarray
    grad: np.ndarray
    sum_p2: Optional[np.ndarray]


def make_ext(case: ExtCase) -> ExtProblem:
    """The arrays of ``case`` (deterministic in its base case's seed)."""
    p = make(case.base)
    rng = np.random.default_rng(case.base.seed + 1000)
    lead = p.target.shape
    target, gl = p.target, p.grad_logprob
    if case.targets:
        k = case.targets
        flat_z = p.logits.reshape(-1, p.logits.shape[-1])
        extra = np.zeros((flat_z.shape[0], k - 1), dtype=np.int64)
        for i, row in enumerate(flat_z):
            finite = np.flatnonzero(np.isfinite(row))
            extra[i] = rng.choice(finite if finite.size else np.arange(row.size), size=k - 1)
        target = np.concatenate([p.target.reshape(-1, 1), extra], axis=1)
        if target.shape[0]:
            target[0, -1] = target[0, 0] if target[0, 0] != case.ignore_index else target[0, -1]  # a repeat
            if case.base.ignore_frac > 0 and k > 1:
                target[rng.random(target.shape[0]) < case.base.ignore_frac, 1] = case.ignore_index
        target = target.reshape(lead + (k,))
        gl = rng.normal(size=lead + (k,))
    tau = case.base.temperature
    if case.row_temperature:
        t = case.base.temperature * np.exp(rng.uniform(-0.7, 0.7, size=lead))
        tau = t if case.dtype == "float64" else t.astype(np.float32).astype(np.float64)
    gs = rng.normal(size=lead) if case.sum_p2 else None
    return ExtProblem(case, p.logits, target, p.keep_mask, tau, gl, p.grad_entropy, gs)


def oracle_ext(problem: ExtProblem, *, entropy_grad: bool = True) -> ExtOutputs:
    """The float64 answer (:func:`dualvp.reference.logprob_entropy` and friends) of ``problem``."""
    c = problem.case
    kw = dict(keep_mask=problem.keep_mask, temperature=problem.temperature, ignore_index=c.ignore_index)
    lp, h = reference.logprob_entropy(problem.logits, problem.target, **kw)
    g = reference.logprob_entropy_grad(problem.logits, problem.target, problem.grad_logprob,
                                       problem.grad_entropy if entropy_grad else None, **kw)
    p2 = None
    if c.sum_p2:
        p2 = reference.sum_squared_probs(problem.logits, temperature=problem.temperature)
        g = g + reference.sum_squared_probs_grad(problem.logits, problem.grad_sum_p2, temperature=problem.temperature)
    return ExtOutputs(lp, h, g, p2)


def ext_failures(problem: ExtProblem, out: ExtOutputs, ref: Optional[ExtOutputs] = None) -> list:
    """The quantities of ``out`` outside :data:`~dualvp.testing.TOLERANCES` against the oracle, as text."""
    ref = oracle_ext(problem) if ref is None else ref
    bad = []
    for name, quantity in (("logprob", "logprob"), ("entropy", "entropy"), ("grad", "grad"), ("sum_p2", "entropy")):
        x, r = getattr(out, name), getattr(ref, name)
        if r is None:
            continue
        if x is None:
            bad.append(f"{name}: missing")
            continue
        x = np.asarray(x, dtype=np.float64)
        if x.shape != r.shape:
            bad.append(f"{name}: shape {x.shape}, expected {r.shape}")
        elif not within_tolerance(x, r, tolerance(problem.case.dtype, quantity)):
            bad.append(f"{name}: max errors (abs, rel) {max_errors(x, r)}")
    return bad


def _e(name, base, **kw) -> ExtCase:
    return ExtCase(name=name, base=base_case(base) if isinstance(base, str) else base, **kw)


_ALL = dict(targets=4, row_temperature=True, sum_p2=True)

#: The extended scenarios: every option at once over the base cases that
#: stress them (masks that drop the targets, ignored rows, banned and extreme
#: logits, 16-bit and float64 inputs, batch dims, the empty problem), and
#: each option alone on a plain and a masked case.
EXT_CASES: tuple[ExtCase, ...] = (
    _e("k_only", "basic", targets=3),
    _e("k1", "basic", targets=1),
    _e("k_masked", "drop_target", targets=3),
    _e("row_tau_only", "basic", row_temperature=True),
    _e("row_tau_masked", "random_mask_temp", row_temperature=True),
    _e("p2_only", "basic", sum_p2=True),
    _e("p2_masked", "nucleus", sum_p2=True),
    _e("all_basic", "basic", **_ALL),
    _e("all_empty", "empty", **_ALL),
    _e("all_batch_dims", "batch_dims", **_ALL),
    _e("all_float64", "float64", **_ALL),
    _e("all_bfloat16", "bfloat16", **_ALL),
    _e("all_nucleus", "nucleus", **_ALL),
    _e("all_drop_target", "drop_target", **_ALL),
    _e("all_all_but_target", "all_but_target", **_ALL),
    _e("all_ignored_masked", "ignored_masked", **_ALL),
    _e("all_extreme_temp", "extreme_temp", **_ALL),
    _e("all_neg_inf", "neg_inf", **_ALL),
    _e("all_neg_inf_masked", "neg_inf_masked", **_ALL),
    _e("all_confident_lm_bf16", "confident_lm_bf16", **_ALL),
    _e("all_everything", "everything", **_ALL),
)

_BY_NAME = {c.name: c for c in EXT_CASES}
assert len(_BY_NAME) == len(EXT_CASES), "duplicate extended case names"


def ext_case(name: str, **changes) -> ExtCase:
    """The extended case called ``name``, with optional field changes."""
    return dataclasses.replace(_BY_NAME[name], **changes)


#: Invalid calls of the new options. ``multi_target`` / ``with_sum_p2`` are
#: passed as keywords; a temperature array replaces ``temperature``.
EXT_BAD_INPUTS: tuple[BadInput, ...] = (
    BadInput("multi_target_str", {"multi_target": "yes"}, TypeError, "multi_target"),
    BadInput("multi_target_1d_target", {"multi_target": True}, ValueError, "target"),
    BadInput("multi_target_zero_k", {"multi_target": True, "target": np.zeros((4, 0), dtype=np.int64)}, ValueError,
             "target"),
    BadInput("multi_target_rows", {"multi_target": True, "target": np.zeros((3, 2), dtype=np.int64)}, ValueError,
             "target"),
    BadInput("multi_target_range", {"multi_target": True, "target": np.array([[0, 8]] * 4, dtype=np.int64)},
             ValueError, "target"),
    BadInput("with_sum_p2_int", {"with_sum_p2": 1}, TypeError, "with_sum_p2"),
    BadInput("temperature_tensor_shape", {"temperature": np.ones(3, dtype=np.float32)}, ValueError, "temperature"),
    BadInput("temperature_tensor_int", {"temperature": np.ones(4, dtype=np.int32)}, TypeError, "temperature"),
    BadInput("temperature_tensor_zero", {"temperature": np.array([1.0, 0.0, 1.0, 1.0], dtype=np.float32)},
             ValueError, "temperature"),
    BadInput("temperature_tensor_nan", {"temperature": np.array([1.0, np.nan, 1.0, 1.0], dtype=np.float32)},
             ValueError, "temperature"),
    BadInput("temperature_tensor_inf", {"temperature": np.full(4, np.inf, dtype=np.float32)}, ValueError,
             "temperature"),
)
assert len({b.name for b in EXT_BAD_INPUTS}) == len(EXT_BAD_INPUTS)
