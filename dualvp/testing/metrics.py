"""Tolerances and the one error metric every check uses.

:func:`max_errors` and :func:`within_tolerance` judge a result against a
reference element-wise; both go through :func:`_finite_part`, the single place
where non-finite entries are matched (``-inf`` with ``-inf``, NaN with NaN; any
other disagreement fails). :func:`compare` turns a set of backend results into
the report rows of ``dualvp verify`` and the failure lists of the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple, Optional

import numpy as np

__all__ = [
    "Tolerance",
    "TOLERANCES",
    "tolerance",
    "pair_tolerance",
    "max_errors",
    "within_tolerance",
    "ROUNDING_FACTOR",
    "rounding_unit",
    "rounding_ratio",
    "within_rounding",
    "Row",
    "compare",
    "QUANTITIES",
    "LINEAR_QUANTITIES",
]

#: The three quantities every backend returns (see :class:`dualvp.testing.Outputs`).
QUANTITIES = ("logprob", "entropy", "grad")
#: The four of the fused LM-head op (see :class:`dualvp.testing.LinearOutputs`).
LINEAR_QUANTITIES = ("logprob", "entropy", "dh", "dW")
_LINEAR_GRADS = ("dh", "dW")


@dataclass(frozen=True)
class Tolerance:
    """``|x - ref| <= atol + rtol * |ref|``, element-wise; inf must match inf."""

    atol: float
    rtol: float


#: Tolerance of a backend's result against the float64 oracle, per input
#: dtype and quantity. The oracle sees the *same* (already rounded) input, so
#: these bound the error of the computation only, not of the input rounding.
#:
#: Reasoning. All backends compute in float32 for 16/32-bit input (float64 for
#: float64), with maxima taken on the raw logits and the temperature applied
#: after the shift, so errors do not grow with ``|z|``:
#:
#: * float32 log-prob / entropy: the sums of ``exp`` over up to ~1e5 columns
#:   carry a relative error of a few ``eps32 * log2(V)`` (pairwise / blocked
#:   reductions) ~ 1e-6; ``log`` turns it into an absolute error of the same
#:   size, and ``(z_y - M) / tau`` adds ``eps32 * |z_y - M| / tau``, relative.
#:   Hence atol 2e-5 plus rtol 2e-5 for large negative log-probs.
#: * float32 gradient: entries are probabilities (at most ``1/tau`` times the
#:   upstream gradient, here ~N(0, 1)); each has relative error ~ eps32 *
#:   (|d| + log S). atol 1e-5 covers rows with temperature 0.3 and extreme logits.
#: * bfloat16 / float16: the *input* rounding is exact for the oracle, and the
#:   computation is float32, so log-prob / entropy are as float32. The gradient
#:   is returned in the input dtype: rounding a value of size <= 1/tau to
#:   8 bits (bf16) costs 2^-9 relative (float16: 2^-12), hence rtol 8e-3 /
#:   1e-3 and an atol for the smallest entries.
#: * float64: round-off of the float64 oracle itself is ~ eps64 * |z| / tau,
#:   up to ~1e-11 for the +-1e4 rows at tau = 0.3.
TOLERANCES: dict[str, dict[str, Tolerance]] = {
    "float64": {
        "logprob": Tolerance(1e-9, 1e-10),
        "entropy": Tolerance(1e-9, 1e-10),
        "grad": Tolerance(1e-10, 1e-9),
    },
    "float32": {
        "logprob": Tolerance(2e-5, 2e-5),
        "entropy": Tolerance(2e-5, 2e-5),
        "grad": Tolerance(1e-5, 1e-4),
    },
    "bfloat16": {
        "logprob": Tolerance(2e-5, 2e-5),
        "entropy": Tolerance(2e-5, 2e-5),
        "grad": Tolerance(1e-4, 8e-3),
    },
    "float16": {
        "logprob": Tolerance(2e-5, 2e-5),
        "entropy": Tolerance(2e-5, 2e-5),
        "grad": Tolerance(1e-4, 1e-3),
    },
}

# The KL divergence op (dualvp.kl_spec): "kl" is the value; its two gradients
# use the "grad" row. KL = T/Sa - log Sa + log Sb is a sum of three terms of
# size O(log V + |dA - dB|) in shifted logits, like the entropy's log S - c,
# with one more float32 reduction (Sb): the entropy's bound holds, and the
# gradients p (log p - log q - KL) / tau and (q - p) / tau have the entropy
# gradient's form, so the "grad" row (float32 relative error, one rounding to
# the input dtype) applies to both.
for _dt, _kl in (("float64", Tolerance(1e-9, 1e-10)), ("float32", Tolerance(2e-5, 2e-5)),
                 ("bfloat16", Tolerance(2e-5, 2e-5)), ("float16", Tolerance(2e-5, 2e-5))):
    TOLERANCES[_dt]["kl"] = _kl
del _dt, _kl


def tolerance(dtype: str, quantity: str, ref=None) -> Tolerance:
    """Tolerance for ``quantity`` in ``("logprob", "entropy", "grad")``, or ``"dh"`` / ``"dW"`` given ``ref``.

    The fused LM-head gradients ``dh = G W`` and ``dW = G^T h`` are derived
    from the logits gradient's row of :data:`TOLERANCES`, as the fused-op tests
    (``tests/torch/test_linear.py``) judge them: each entry is a sum of
    products of logits-gradient entries ``G`` with weight / hidden entries, so
    the relative part stays that of ``G`` (float32 accumulation everywhere,
    one final rounding to the dtype) and the absolute part, which covers the
    entries that cancel to near zero, scales with the size of the products:
    ``atol = atol_grad * max(1, max |ref|)`` over the finite oracle entries
    ``ref`` (which must then be given).
    """
    if quantity in _LINEAR_GRADS:
        if ref is None:
            raise ValueError(f"quantity: {quantity!r} needs the oracle's values (ref) to scale its tolerance")
        t = TOLERANCES[dtype]["grad"]
        r = np.abs(np.asarray(ref, dtype=np.float64))
        r = r[np.isfinite(r)]
        return Tolerance(t.atol * max(1.0, float(r.max()) if r.size else 1.0), t.rtol)
    return TOLERANCES[dtype][quantity]


def pair_tolerance(dtype: str, quantity: str, ref=None) -> Tolerance:
    """Tolerance between two backends: each is within :func:`tolerance` of the oracle, so twice that."""
    t = tolerance(dtype, quantity, ref)
    return Tolerance(2 * t.atol, 2 * t.rtol)


def _finite_part(x, ref):
    """``(x[fin], ref[fin])`` over the finite reference entries, or ``None`` when the two disagree.

    Disagreement: different shapes, or a non-finite reference entry that ``x``
    does not reproduce exactly (``-inf``/``+inf`` equal, NaN where NaN).
    """
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if x.shape != ref.shape:
        return None
    fin = np.isfinite(ref)
    same_nonfinite = (x == ref) | (np.isnan(x) & np.isnan(ref))
    if not np.all(same_nonfinite[~fin]):
        return None
    return x[fin], ref[fin]


def max_errors(x, ref) -> tuple[float, float]:
    """``(max abs error, max rel error)`` of ``x`` against ``ref`` over the finite reference entries.

    Non-finite entries must agree exactly; a mismatch counts as an infinite
    error. Different shapes raise ``ValueError``.
    """
    if np.shape(x) != np.shape(ref):
        raise ValueError(f"shape mismatch: {np.shape(x)} vs {np.shape(ref)}")
    part = _finite_part(x, ref)
    if part is None:
        return float("inf"), float("inf")
    xf, rf = part
    if xf.size == 0:
        return 0.0, 0.0
    err = np.abs(xf - rf)
    if not np.all(np.isfinite(err)):
        return float("inf"), float("inf")
    rel = err / np.maximum(np.abs(rf), np.finfo(np.float64).tiny)
    return float(err.max()), float(rel.max())


def within_tolerance(x, ref, tol: Tolerance) -> bool:
    """True when every entry satisfies ``tol`` (non-finite entries must match exactly)."""
    part = _finite_part(x, ref)
    if part is None:
        return False
    xf, rf = part
    return bool(np.all(np.abs(xf - rf) <= tol.atol + tol.rtol * np.abs(rf)))


#: The fused op's 16-bit ``dh`` / ``dW`` at its default ``gradient_rounding="fixed"``
#: (``dualvp_torch.tuning``): max |error| within this many times the max |error| of the
#: float64 result rounded once to the dtype (issue 45's rule; :func:`within_rounding`).
ROUNDING_FACTOR = 2.0


def round_to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float64 values to ``dtype`` and return them as float64."""
    if dtype == "float64":
        return np.asarray(x, dtype=np.float64)
    if dtype == "float32":
        return np.asarray(x, dtype=np.float32).astype(np.float64)
    if dtype == "float16":
        return np.asarray(x, dtype=np.float16).astype(np.float64)
    if dtype == "bfloat16":
        # Round to nearest even on the top 16 bits of the float32 pattern;
        # +-inf and NaN survive (NaN stays NaN).
        f = np.asarray(x, dtype=np.float32)
        bits = f.view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        out = rounded.astype(np.uint32).view(np.float32)
        out = np.where(np.isfinite(f), out, f)
        return out.astype(np.float64)
    raise ValueError(f"dtype: expected one of float64, float32, float16, bfloat16, got {dtype}")


# significant bits (with the implicit one) and the smallest subnormal of each dtype
_PRECISION = {"bfloat16": (8, 2.0**-133), "float16": (11, 2.0**-24), "float32": (24, 2.0**-149),
              "float64": (53, 2.0**-1074)}


def rounding_unit(ref, dtype: str) -> float:
    """max |rnd(ref) - ref| over the finite entries of the float64 ``ref``, ``rnd`` rounding to ``dtype``.

    Floored at ``2^-(p+2) max |ref|`` (``p`` significant bits: between a
    quarter and a half of the largest entry's worst rounding error, half an
    ulp) and at the dtype's smallest subnormal: a result whose entries all
    happen to be representable (a unit of 0) or are subnormal-tiny still gets
    a unit of its own size instead of demanding exact (or exactly-subnormal) values.
    """
    r = np.asarray(ref, dtype=np.float64)
    r = r[np.isfinite(r)]
    if not r.size:
        return 0.0
    bits, sub = _PRECISION[dtype]
    err = float(np.abs(round_to_dtype(r, dtype) - r).max())
    return max(err, 2.0 ** -(bits + 2) * float(np.abs(r).max()), sub)


def rounding_ratio(x, ref, dtype: str) -> float:
    """max |x - ref| / :func:`rounding_unit` ``(ref, dtype)``; ``inf`` where non-finite entries disagree."""
    a, _ = max_errors(x, ref)
    unit = rounding_unit(ref, dtype)
    return a / unit if unit else (0.0 if a == 0 else float("inf"))


def within_rounding(x, ref, dtype: str, factor: float = ROUNDING_FACTOR) -> bool:
    """Issue 45's rule for a fused 16-bit gradient: max |x - ref| <= ``factor`` x :func:`rounding_unit`.

    ``ref`` is the float64 oracle's ``dh`` or ``dW`` (an independent
    formulation); non-finite entries must match exactly, as in
    :func:`within_tolerance`. Weaker than :data:`TOLERANCES` element-wise on
    the small entries (one bound for the whole array), stricter on the
    largest ones (2x one rounding instead of ``rtol``).
    """
    return rounding_ratio(x, ref, dtype) <= factor


class Row(NamedTuple):
    """One comparison: ``check`` (e.g. ``"torch vs oracle"``), ``quantity``, max errors, pass, the tolerance used."""

    check: str
    quantity: str
    abs_err: float
    rel_err: float
    ok: bool
    tol: Optional[Tolerance] = None


def compare(results: Mapping[str, object], oracle, dtype: str, pairs: Optional[tuple] = (("torch", "jax"),), *,
            rounding_rule: bool = False) -> list:
    """Rows for every backend vs the oracle, then for each pair in ``pairs`` present in ``results``.

    Args:
      results: backend name -> :class:`dualvp.testing.Outputs` or
        :class:`dualvp.testing.LinearOutputs` (float64 NumPy arrays), the
        oracle's type.
      oracle: the answer of :func:`dualvp.testing.oracle`; its fields are the
        quantities compared (:data:`QUANTITIES` or :data:`LINEAR_QUANTITIES`).
      dtype: the input dtype (selects the tolerances).
      pairs: backend pairs compared with each other at :func:`pair_tolerance`
        (``dh`` / ``dW`` scaled by the oracle's values).
      rounding_rule: 16-bit ``dh`` / ``dW`` (the fused op's) judged by issue
        45's rule instead of element-wise, as its default
        ``gradient_rounding="fixed"`` meets them: vs the oracle
        :func:`within_rounding`, a row's tolerance the absolute bound
        ``ROUNDING_FACTOR x`` :func:`rounding_unit`; a pair within twice
        that of each other (each within it of the oracle).
    """
    quantities = getattr(oracle, "_fields", QUANTITIES)
    by_rule = rounding_rule and dtype in ("bfloat16", "float16")

    def rule(q, scale):  # the rule's absolute bound on q, or None where the element-wise tolerance applies
        if not (by_rule and q in _LINEAR_GRADS):
            return None
        return Tolerance(scale * ROUNDING_FACTOR * rounding_unit(getattr(oracle, q), dtype), 0.0)

    rows = []
    for name, res in results.items():
        for q in quantities:
            x, r = getattr(res, q), getattr(oracle, q)
            a, e = max_errors(x, r)
            t = rule(q, 1.0)
            if t is not None:
                ok = within_rounding(x, r, dtype)
            else:
                t = tolerance(dtype, q, r)
                ok = within_tolerance(x, r, t)
            rows.append(Row(f"{name} vs oracle", q, a, e, ok, t))
    for p, o in pairs or ():
        if p in results and o in results:
            for q in quantities:
                x, y = getattr(results[p], q), getattr(results[o], q)
                a, e = max_errors(x, y)
                t = rule(q, 2.0) or pair_tolerance(dtype, q, getattr(oracle, q))
                rows.append(Row(f"{p} vs {o}", q, a, e, within_tolerance(x, y, t), t))
    return rows
