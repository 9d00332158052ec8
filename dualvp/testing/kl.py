"""Conformance fixtures of the KL divergence op: cases, the oracle's answer, the comparison.

* :data:`KL_CASES`: named :class:`KLCase` scenarios (banned ``-inf`` columns,
  masked rows holding NaN, an infinite divergence, near-equal distributions,
  large offsets at a low temperature, both directions, batch dims); every
  ``V`` divides by 8, so each case runs at W = 1, 2, 4, 8.
* :func:`make_kl`: a case's float64 arrays (already rounded to the case's
  dtype, so the oracle judges the computation, not the input rounding).
* :func:`kl_oracle`: the float64 answer (:mod:`dualvp.kl_reference`).
* :func:`run_spec`: the spec run with NumPy over ``W`` shards and combined in
  one round, as the backends run it;
* :func:`kl_failures`: a backend's ``(kl, d_logits, d_ref)`` against the
  oracle within :data:`~dualvp.testing.metrics.TOLERANCES` (``"kl"`` for the
  values, ``"grad"`` for both gradients), as text lines.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from dualvp import kl_reference, kl_spec

from .cases import round_to_dtype
from .metrics import max_errors, tolerance, within_tolerance

__all__ = ["KLCase", "KLProblem", "KL_CASES", "make_kl", "kl_oracle", "kl_failures", "kl_errors", "run_spec"]


class KLCase(NamedTuple):
    name: str
    rows: tuple = (6,)
    vocab: int = 64
    dtype: str = "float32"
    temperature: float = 1.0
    direction: str = "forward"
    kind: str = "noisy"          # how ref relates to logits: noisy | near | independent
    scale: float = 2.0           # std of the logits
    offset: tuple = (0.0, 0.0)   # constant added to (logits, ref): softmax-invariant, tests the shifted form
    banned: str = ""             # "" | "both" (same -inf columns) | "logits" (only logits) | "shard" (a whole shard)
    masked: bool = False         # some rows outside row_mask (holding NaN)
    seed: int = 0


class KLProblem(NamedTuple):
    case: KLCase
    logits: np.ndarray           # [..., V] float64, values rounded to case.dtype
    ref_logits: np.ndarray       # [..., V]
    row_mask: Optional[np.ndarray]  # [...] bool or None
    grad: np.ndarray             # [...] upstream gradient of the KL


KL_CASES = (
    KLCase("basic"),
    KLCase("banned_both", banned="both", temperature=0.7, seed=1),
    KLCase("banned_logits", banned="logits", seed=2),
    KLCase("banned_shard", banned="shard", vocab=128, seed=3),
    KLCase("reverse_infinite", banned="logits", direction="reverse", seed=4),
    KLCase("masked_batch", rows=(2, 5), masked=True, banned="both", seed=5),
    KLCase("near", kind="near", seed=6),
    KLCase("offset_low_tau", temperature=0.3, scale=6.0, offset=(1.0e4, -5.0e3), kind="independent", seed=7),
    KLCase("reverse_sharp", direction="reverse", scale=6.0, temperature=1.5, seed=8),
    KLCase("bf16_banned", dtype="bfloat16", banned="both", masked=True, seed=9),
    KLCase("bf16_reverse", dtype="bfloat16", direction="reverse", kind="independent", seed=10),
)


def make_kl(case: KLCase, dtype: Optional[str] = None) -> KLProblem:
    """The case's arrays (``dtype`` overrides the case's)."""
    dtype = dtype or case.dtype
    rng = np.random.default_rng(1000 + case.seed)
    shape = tuple(case.rows) + (case.vocab,)
    z = rng.normal(0.0, case.scale, size=shape)
    if case.kind == "noisy":
        r = z + rng.normal(0.0, 1.0, size=shape)
    elif case.kind == "near":
        r = z + rng.normal(0.0, 1e-3, size=shape)
    else:
        r = rng.normal(0.0, case.scale, size=shape)
    z, r = z + case.offset[0], r + case.offset[1]
    flat_z, flat_r = z.reshape(-1, case.vocab), r.reshape(-1, case.vocab)
    n = flat_z.shape[0]
    if case.banned in ("both", "logits"):
        cols = rng.random(flat_z.shape) < 0.3
        cols[:, 0] = False  # every row keeps a finite column
        flat_z[cols] = -np.inf
        if case.banned == "both":
            flat_r[cols] = -np.inf
        else:
            flat_r[:, 0] = -np.inf  # logits finite there: p > 0 = q in "reverse" rows -> +inf below
            flat_z[:, 0] = np.where(np.arange(n) % 2 == 0, flat_z[:, 0], -np.inf)
            flat_z[np.arange(n) % 2 == 1, 1] = 0.0  # keep a finite column in the odd rows
            flat_r[np.arange(n) % 2 == 1, 0] = 0.0
    if case.banned == "shard":
        # the second eighth of the vocabulary (a whole shard at W = 8, half of one at W = 4, ...) banned in both
        q = case.vocab // 8
        flat_z[:, q:2 * q] = -np.inf
        flat_r[:, q:2 * q] = -np.inf
        flat_z[0, : case.vocab // 2] = -np.inf  # row 0: the first half (whole shards at W = 2..8) banned too
        flat_r[0, : case.vocab // 2] = -np.inf
    mask = None
    if case.masked:
        mask = np.ones(n, dtype=bool)
        mask[1::3] = False
        flat_z[~mask, 3] = np.nan  # a masked row holding NaN still gives 0 and zero gradients
        mask = mask.reshape(case.rows)
    z = round_to_dtype(flat_z.reshape(shape), dtype)
    r = round_to_dtype(flat_r.reshape(shape), dtype)
    g = rng.normal(0.0, 1.0, size=tuple(case.rows))
    return KLProblem(case._replace(dtype=dtype), z, r, mask, g)


def kl_oracle(problem: KLProblem) -> tuple:
    """``(kl [...], d_logits [..., V], d_ref [..., V])`` in float64."""
    c = problem.case
    kw = dict(temperature=c.temperature, direction=c.direction, row_mask=problem.row_mask)
    kl = kl_reference.kl_divergence(problem.logits, problem.ref_logits, **kw)
    dz, dr = kl_reference.kl_divergence_grad(problem.logits, problem.ref_logits, problem.grad, **kw)
    return kl, dz, dr


def kl_errors(problem: KLProblem, result: tuple) -> dict:
    """``{quantity: (abs err, rel err, ok)}`` of ``result = (kl, d_logits, d_ref)`` (a gradient may be ``None``)."""
    ref = kl_oracle(problem)
    out = {}
    for name, quantity, x, r in zip(("kl", "d_logits", "d_ref"), ("kl", "grad", "grad"), result, ref):
        if x is None:
            continue
        x = np.asarray(x, dtype=np.float64)
        tol = tolerance(problem.case.dtype, quantity)
        a, rel = max_errors(x, r)
        out[name] = (a, rel, within_tolerance(x, r, tol))
    return out


def kl_failures(problem: KLProblem, result: tuple, label: str = "") -> list:
    """The failing quantities of :func:`kl_errors`, as text."""
    return [f"{label}{problem.case.name}/{problem.case.dtype} {q}: abs {a:.3e} rel {r:.3e}"
            for q, (a, r, ok) in kl_errors(problem, result).items() if not ok]


def run_spec(problem: KLProblem, world: int, dtype=np.float64) -> tuple:
    """``(kl, d_logits, d_ref)`` of :mod:`dualvp.kl_spec` over ``world`` shards, NumPy, compute dtype ``dtype``.

    Each shard's statistics, one stacked table, the combine, each shard's
    gradient block: the backends' data flow, with the collective replaced by
    ``np.stack``.
    """
    c = problem.case
    a_full, b_full = kl_spec.operands(c.direction, problem.logits.astype(dtype), problem.ref_logits.astype(dtype))
    tau = dtype(c.temperature)
    pairs = list(zip(np.split(a_full, world, axis=-1), np.split(b_full, world, axis=-1)))
    with np.errstate(all="ignore"):
        table = np.stack([kl_spec.block_stats(np, a, b, tau) for a, b in pairs])
        comb = kl_spec.combine_stats(np, table, tau)
        kl = kl_spec.outputs(np, comb, problem.row_mask)
        grads = [kl_spec.block_grad(np, a, b, comb, problem.grad.astype(dtype), tau, row_mask=problem.row_mask)
                 for a, b in pairs]
    ga = np.concatenate([g[0] for g in grads], axis=-1)
    gb = np.concatenate([g[1] for g in grads], axis=-1)
    dz, dr = (ga, gb) if c.direction == "forward" else (gb, ga)
    return kl, dz, dr
