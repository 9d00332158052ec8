"""Shared test scenarios and the bad-input table.

One table of named scenarios, used by the tests of every backend and by
``dualvp verify``; the tolerances and the error metric they are judged with
live in :mod:`dualvp.testing.metrics` (re-exported here). A :class:`Case` is a recipe; :func:`make` turns it into
NumPy arrays (full, unsharded logits in float64 *already rounded to the case's
dtype*, so that the float64 oracle judges exactly the input the backend sees).

Backends shard the arrays themselves: rank ``r`` of ``W`` gets the columns
``[r*V/W, (r+1)*V/W)`` of ``logits`` and ``keep_mask``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .metrics import TOLERANCES, Tolerance, max_errors, round_to_dtype, tolerance, within_tolerance

__all__ = [
    "Case",
    "Problem",
    "LinearProblem",
    "make_linear",
    "CASES",
    "case",
    "make",
    "round_to_dtype",
    "Tolerance",
    "TOLERANCES",
    "tolerance",
    "max_errors",
    "within_tolerance",
    "confident_lm_logits",
    "BadInput",
    "BAD_INPUTS",
    "bad_input_base",
    "make_mask",
    "ids_from_mask",
    "KEEP_IDS_CASES",
]

_MASKS = ("none", "nucleus", "drop_target", "all_but_target", "random")
_LOGITS = ("normal", "extreme", "neg_inf", "ties", "dominant", "confident_lm")


@dataclass(frozen=True)
class Case:
    """A named scenario.

    Attributes:
      name: unique id (used as the pytest id).
      lead: leading dims of ``target`` (``logits`` is ``lead + (V,)``);
        ``(0,)`` is the empty problem.
      vocab: full vocabulary ``V``; divisible by every ``W`` in ``worlds``.
      worlds: shard counts the case is meant to run with.
      dtype: input dtype name: ``float32``, ``bfloat16``, ``float16``,
        ``float64``.
      temperature: ``tau``.
      mask: ``none``, ``nucleus`` (top-p-like sets), ``drop_target`` (nuclei
        that leave out the target, which the op must keep anyway),
        ``all_but_target`` (only the target kept), ``random``.
      logits: ``normal``, ``extreme`` (+-1e4 rows), ``neg_inf`` (banned
        columns, a whole shard of -inf, a target at -inf), ``ties``,
        ``dominant`` (one token far above the rest), ``confident_lm``
        (N(10, 3) with +25 spikes).
      ignore_frac: fraction of rows whose target is ``ignore_index``.
      seed: RNG seed.
      keep_ids: the kept set of ``mask`` is handed over as token ids
        (``keep_ids [..., K]``, :func:`ids_from_mask`) instead of a mask;
        the problem's ``keep_mask`` is then ``None`` and the oracle turns the
        ids back into a mask itself (:func:`dualvp.reference.mask_from_ids`).
    """

    name: str
    lead: tuple = (6,)
    vocab: int = 64
    worlds: tuple = (1, 2, 4, 8)
    dtype: str = "float32"
    temperature: float = 1.0
    mask: str = "none"
    logits: str = "normal"
    ignore_frac: float = 0.0
    seed: int = 0
    ignore_index: int = -100
    keep_ids: bool = False

    def __post_init__(self):
        assert self.mask in _MASKS, self.mask
        assert not (self.keep_ids and self.mask == "none"), self.name
        assert self.logits in _LOGITS, self.logits
        assert all(self.vocab % w == 0 for w in self.worlds), (self.name, self.vocab, self.worlds)


def _vocab_shard(
    vocab: int, rank: int, world: int, keep_mask: Optional[np.ndarray]
) -> tuple[slice, Optional[np.ndarray]]:
    """``(slice, keep_mask [..., V/W] or None)``: rank ``rank`` of ``world``'s vocabulary ``[r*V/W, (r+1)*V/W)``.

    The one layout of every backend; ``keep_mask`` is ``[..., V]`` (or ``None``).
    """
    v = vocab // world
    sl = slice(rank * v, (rank + 1) * v)
    return sl, (None if keep_mask is None else keep_mask[..., sl])


@dataclass
class Problem:
    """Concrete arrays of a case (NumPy; logits as float64 values of the dtype)."""

    case: Case
    logits: np.ndarray  # [..., V] float64, exactly representable in case.dtype
    target: np.ndarray  # [...] int64
    keep_mask: Optional[np.ndarray]  # [..., V] bool or None
    grad_logprob: np.ndarray  # [...] float64 upstream gradient
    grad_entropy: np.ndarray  # [...] float64 upstream gradient
    extra: dict = field(default_factory=dict)
    keep_ids: Optional[np.ndarray] = None  # [..., K] int64 global ids (padding -1), or None; never with keep_mask

    def shard(self, rank: int, world: int):
        """Columns of rank ``rank`` of ``world``: ``(logits, keep_mask)``."""
        sl, km = _vocab_shard(self.logits.shape[-1], rank, world, self.keep_mask)
        return self.logits[..., sl], km


@dataclass
class LinearProblem:
    """Concrete arrays of the fused LM-head op (``z = hidden @ weight^T``), NumPy, values of the dtype.

    The :class:`Case` gives ``lead``, ``vocab`` (weight rows ``V``), ``worlds``,
    ``dtype``, ``temperature``, ``mask``, ``ignore_frac``, ``seed`` and
    ``ignore_index``; its ``logits`` kind is not used (the logits are what
    ``hidden`` and ``weight`` make). Rank ``r`` of ``W`` holds the weight rows
    ``[r*V/W, (r+1)*V/W)`` and the same columns of ``keep_mask``; ``hidden``
    is identical on every rank.
    """

    case: Case
    hidden: np.ndarray  # [..., H] float64, exactly representable in case.dtype
    weight: np.ndarray  # [V, H] float64, exactly representable in case.dtype
    target: np.ndarray  # [...] int64
    keep_mask: Optional[np.ndarray]  # [..., V] bool or None
    grad_logprob: np.ndarray  # [...] float64 upstream gradient
    grad_entropy: np.ndarray  # [...] float64 upstream gradient
    extra: dict = field(default_factory=dict)
    keep_ids: Optional[np.ndarray] = None  # [..., K] int64 global ids (padding -1), or None; never with keep_mask

    def shard(self, rank: int, world: int):
        """Weight rows and keep-mask columns of rank ``rank`` of ``world``: ``(weight [V/W, H], keep_mask)``."""
        sl, km = _vocab_shard(self.weight.shape[0], rank, world, self.keep_mask)
        return self.weight[sl], km


def confident_lm_logits(rng: np.random.Generator, shape: tuple, spikes: int = 3) -> np.ndarray:
    """Logits like a confident LM: N(10, 3) with a few +25 spikes per row."""
    z = rng.normal(10.0, 3.0, size=shape)
    if shape[-1] and int(np.prod(shape[:-1])):
        flat = z.reshape(-1, shape[-1])
        for row in flat:
            row[rng.integers(0, shape[-1], size=min(spikes, shape[-1]))] += 25.0
        z = flat.reshape(shape)
    return z


def _logits(rng, kind: str, shape: tuple, vocab: int, worlds: tuple) -> np.ndarray:
    if kind == "normal":
        return rng.normal(0.0, 2.0, size=shape)
    if kind == "confident_lm":
        return confident_lm_logits(rng, shape)
    z = rng.normal(0.0, 2.0, size=shape)
    flat = z.reshape(-1, vocab)
    n = flat.shape[0]
    if kind == "extreme":
        for i in range(n):
            flat[i] = [1e4, -1e4, 1e4 - 3.0][i % 3] + rng.normal(0.0, 2.0, size=vocab)
        if n:
            flat[0, rng.integers(0, vocab)] = -1e4  # +-1e4 inside one row
    elif kind == "neg_inf":
        wmax = max(worlds)
        vr = vocab // wmax
        for i in range(n):
            banned = rng.random(vocab) < 0.3
            flat[i, banned] = -np.inf
            if i % 3 == 0:
                flat[i, :vr] = -np.inf  # a whole (smallest) shard banned
            flat[i, rng.integers(vr, vocab)] = 1.0  # keep a finite entry
    elif kind == "ties":
        for i in range(n):
            flat[i] = float(i % 3)
            flat[i, rng.integers(0, vocab, size=2)] = 5.0  # a tied maximum
    elif kind == "dominant":
        for i in range(n):
            flat[i, rng.integers(0, vocab)] += 60.0
    return flat.reshape(shape)


def make_mask(rng: np.random.Generator, kind: str, z: np.ndarray, target: np.ndarray,
              ignore_index: int = -100) -> Optional[np.ndarray]:
    """A keep mask of ``kind`` (see :class:`Case` ``mask``) for logits ``z [..., V]``; ``None`` for ``none``."""
    if kind == "none":
        return None
    vocab = z.shape[-1]
    flat = z.reshape(-1, vocab)
    y = target.reshape(-1)
    if kind == "random":
        keep = rng.random(flat.shape) < 0.5
    elif kind == "all_but_target":
        keep = np.zeros(flat.shape, dtype=bool)
    else:
        # nucleus: the smallest set of top tokens holding probability >= top_p.
        keep = np.zeros(flat.shape, dtype=bool)
        for i, row in enumerate(flat):
            r = np.where(np.isfinite(row), row, -np.inf)
            order = np.argsort(-r, kind="stable")
            p = np.exp(r[order] - r[order[0]]) if np.isfinite(r[order[0]]) else np.ones(vocab)
            p = p / p.sum()
            top_p = rng.uniform(0.5, 0.95)
            n_keep = int(np.searchsorted(np.cumsum(p), top_p) + 1)
            keep[i, order[: max(1, n_keep)]] = True
            if kind == "drop_target" and y[i] != ignore_index:
                keep[i, y[i]] = False
    return keep.reshape(z.shape)


def ids_from_mask(rng: np.random.Generator, keep_mask: np.ndarray, *, pad: int = 2,
                  repeats: int = 2) -> np.ndarray:
    """The kept set of ``keep_mask [..., V]`` as ids ``[..., K]`` (int64, padding -1), the way a sampler hands it over.

    Each row holds its kept columns in a random order, ``repeats`` of them a
    second time (an id repeated counts once), then -1; ``K`` is the longest
    row plus ``pad``. ``dualvp.reference.mask_from_ids`` gives ``keep_mask``
    back.
    """
    vocab = keep_mask.shape[-1]
    flat = np.asarray(keep_mask, dtype=bool).reshape(-1, vocab)
    rows = []
    for row in flat:
        cols = np.flatnonzero(row)
        cols = np.concatenate([cols, rng.permutation(cols)[:repeats]])
        rows.append(rng.permutation(cols))
    k = max((len(r) for r in rows), default=0) + pad
    ids = np.full((flat.shape[0], k), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    return ids.reshape(keep_mask.shape[:-1] + (k,))


def _as_ids(case: Case, keep: Optional[np.ndarray]) -> tuple:
    """``(keep_mask, keep_ids)`` of the problem: the mask, or with ``case.keep_ids`` its ids and no mask."""
    if not case.keep_ids or keep is None:
        return keep, None
    # A generator of its own: the other arrays of the case stay those of the mask form.
    return None, ids_from_mask(np.random.default_rng((case.seed, 1)), keep)


def make(case: Case) -> Problem:
    """Build the arrays of ``case`` (deterministic in ``case.seed``)."""
    rng = np.random.default_rng(case.seed)
    shape = tuple(case.lead) + (case.vocab,)
    z = _logits(rng, case.logits, shape, case.vocab, case.worlds)
    target = rng.integers(0, case.vocab, size=case.lead).astype(np.int64)
    if case.logits == "neg_inf" and target.size:
        flat_t, flat_z = target.reshape(-1), z.reshape(-1, case.vocab)
        for i in range(flat_t.size):
            finite = np.flatnonzero(np.isfinite(flat_z[i]))
            flat_t[i] = rng.choice(finite)
        # one target sits on a banned (-inf) column: log-prob -inf, finite grad
        banned = np.flatnonzero(~np.isfinite(flat_z[0]))
        if banned.size and case.mask in ("none", "random"):
            flat_t[0] = banned[-1]
    if case.ignore_frac > 0 and target.size:
        ign = rng.random(case.lead) < case.ignore_frac
        ign.reshape(-1)[0] = True
        target = np.where(ign, case.ignore_index, target)
    z = round_to_dtype(z, case.dtype)
    keep = make_mask(rng, case.mask, z, target, case.ignore_index)
    gl = rng.normal(size=case.lead)
    ge = rng.normal(size=case.lead)
    keep, ids = _as_ids(case, keep)
    return Problem(case, z, target, keep, gl, ge, keep_ids=ids)


def make_linear(case: Case, hidden: int, *, logit_scale: float = 3.0) -> LinearProblem:
    """The fused problem of ``case`` with hidden size ``hidden`` (deterministic in ``case.seed``).

    ``hidden [..., H] ~ N(0, 1)`` and ``weight [V, H] ~ N(0, (logit_scale / sqrt(H))^2)``,
    both rounded to ``case.dtype``, so the logits have standard deviation
    about ``logit_scale`` whatever ``H``; a few weight rows are scaled by 3
    (frequent tokens: rows with a confident maximum). Targets, ignored rows
    (``case.ignore_frac``, the first row always) and the keep mask
    (``case.mask``, built on the float64 logits ``hidden @ weight^T``) as in
    :func:`make`.
    """
    if not (isinstance(hidden, int) and hidden > 0):
        raise ValueError(f"hidden: expected a positive int, got {hidden!r}")
    rng = np.random.default_rng(case.seed)
    lead = tuple(case.lead)
    h = round_to_dtype(rng.normal(size=lead + (hidden,)), case.dtype)
    w = rng.normal(scale=logit_scale / np.sqrt(hidden), size=(case.vocab, hidden))
    w[rng.integers(0, case.vocab, size=max(1, case.vocab // 64))] *= 3.0
    w = round_to_dtype(w, case.dtype)
    target = rng.integers(0, case.vocab, size=lead).astype(np.int64)
    if case.ignore_frac > 0 and target.size:
        ign = rng.random(lead) < case.ignore_frac
        ign.reshape(-1)[0] = True
        target = np.where(ign, case.ignore_index, target)
    keep = make_mask(rng, case.mask, h @ w.T, target, case.ignore_index) if case.mask != "none" else None
    # float32 values: the backends take the cotangents in float32, the oracle the same numbers
    gl = round_to_dtype(rng.normal(size=lead), "float32")
    ge = round_to_dtype(rng.normal(size=lead), "float32")
    keep, ids = _as_ids(case, keep)
    return LinearProblem(case, h, w, target, keep, gl, ge, keep_ids=ids)


def _c(name, **kw) -> Case:
    return Case(name=name, **kw)


#: The fixed scenario table. Each case runs for every W in its ``worlds``.
CASES: tuple[Case, ...] = (
    _c("basic"),
    _c("empty", lead=(0,)),
    _c("single_row", lead=(1,)),
    _c("batch_dims", lead=(2, 3), vocab=48, worlds=(1, 2, 4)),
    _c("float64", dtype="float64"),
    _c("bfloat16", dtype="bfloat16"),
    _c("float16", dtype="float16", worlds=(1, 2, 4)),
    _c("temp_0.3", temperature=0.3),
    _c("temp_2.0", temperature=2.0),
    _c("nucleus", mask="nucleus", seed=1),
    _c("drop_target", mask="drop_target", seed=2),
    _c("all_but_target", mask="all_but_target", seed=3),
    _c("random_mask_temp", mask="random", temperature=0.7, seed=4),
    _c("ignored_rows", ignore_frac=0.4, seed=5),
    _c("ignored_masked", ignore_frac=0.4, mask="nucleus", seed=6),
    _c("extreme", logits="extreme", seed=7),
    _c("extreme_temp", logits="extreme", temperature=0.3, seed=8),
    _c("neg_inf", logits="neg_inf", seed=9),
    _c("neg_inf_masked", logits="neg_inf", mask="nucleus", seed=10),
    _c("ties", logits="ties", seed=11),
    _c("dominant", logits="dominant", seed=12),
    _c("confident_lm", logits="confident_lm", lead=(4, 8), vocab=256, seed=13),
    _c("confident_lm_bf16", logits="confident_lm", dtype="bfloat16", vocab=256, mask="nucleus", seed=14),
    _c("everything", lead=(3, 4), vocab=96, worlds=(1, 2, 4), mask="drop_target",
       temperature=1.7, ignore_frac=0.25, logits="neg_inf", seed=15),
)

#: The keep-mask cases of :data:`CASES` with the kept set handed over as ids
#: (``keep_ids``; named ``<case>_ids``): each backend's result must match the
#: oracle of the mask built from the same ids.
KEEP_IDS_CASES: tuple[Case, ...] = tuple(
    dataclasses.replace(c, name=c.name + "_ids", keep_ids=True) for c in CASES if c.mask != "none"
)

_BY_NAME = {c.name: c for c in CASES + KEEP_IDS_CASES}
assert len(_BY_NAME) == len(CASES) + len(KEEP_IDS_CASES), "duplicate case names"


def case(name: str, **changes) -> Case:
    """The case called ``name``, with optional field changes."""
    return dataclasses.replace(_BY_NAME[name], **changes)


# --- bad inputs ---------------------------------------------------------------


@dataclass(frozen=True)
class BadInput:
    """A call that must raise ``error`` with ``arg`` named in the message.

    ``changes`` override the arguments of :func:`bad_input_base`. NumPy arrays
    are converted to the backend's array type (keeping their dtype); other
    values (Python lists, strings, numbers) are passed as they are.
    ``backends`` lists the backends the case applies to.
    """

    name: str
    changes: dict
    error: type
    arg: str
    backends: tuple = ("torch", "jax")


def bad_input_base() -> dict:
    """Valid arguments (NumPy) that every :data:`BAD_INPUTS` case starts from."""
    rng = np.random.default_rng(0)
    return dict(
        logits=rng.normal(size=(4, 8)).astype(np.float32),
        target=np.array([0, 3, 7, -100], dtype=np.int64),
        keep_mask=None,
        temperature=1.0,
        with_entropy=True,
        entropy_grad=True,
        ignore_index=-100,
    )


def _z(shape, dtype=np.float32):
    return np.zeros(shape, dtype=dtype)


#: At least 25 invalid calls; both backends must reject each one the same way.
BAD_INPUTS: tuple[BadInput, ...] = (
    BadInput("logits_list", {"logits": [[0.0] * 8] * 4}, TypeError, "logits"),
    BadInput("logits_int", {"logits": np.zeros((4, 8), dtype=np.int32)}, TypeError, "logits"),
    BadInput("logits_bool", {"logits": np.zeros((4, 8), dtype=bool)}, TypeError, "logits"),
    BadInput("logits_complex", {"logits": np.zeros((4, 8), dtype=np.complex64)}, TypeError, "logits", ("torch",)),
    BadInput("logits_scalar", {"logits": np.float32(1.0), "target": np.int64(0)}, ValueError, "logits"),
    BadInput("logits_empty_vocab", {"logits": _z((4, 0))}, ValueError, "logits"),
    BadInput("target_float", {"target": np.zeros(4, dtype=np.float32)}, TypeError, "target"),
    BadInput("target_bool", {"target": np.zeros(4, dtype=bool)}, TypeError, "target"),
    BadInput("target_list", {"target": [0, 1, 2, 3]}, TypeError, "target"),
    BadInput("target_too_long", {"target": np.zeros(5, dtype=np.int64)}, ValueError, "target"),
    BadInput("target_extra_dim", {"target": np.zeros((4, 1), dtype=np.int64)}, ValueError, "target"),
    BadInput("target_missing_dim", {"logits": _z((2, 4, 8)), "target": np.zeros(8, dtype=np.int64)}, ValueError,
             "target"),
    BadInput("lead_dims_swapped", {"logits": _z((2, 3, 8)), "target": np.zeros((3, 2), dtype=np.int64)}, ValueError,
             "target"),
    BadInput("target_too_large", {"target": np.array([0, 1, 8, 2], dtype=np.int64)}, ValueError, "target"),
    BadInput("target_negative", {"target": np.array([0, -1, 2, 3], dtype=np.int64)}, ValueError, "target"),
    BadInput("keep_mask_float", {"keep_mask": np.ones((4, 8), dtype=np.float32)}, TypeError, "keep_mask"),
    BadInput("keep_mask_int", {"keep_mask": np.ones((4, 8), dtype=np.int64)}, TypeError, "keep_mask"),
    BadInput("keep_mask_shape", {"keep_mask": np.ones((4, 7), dtype=bool)}, ValueError, "keep_mask"),
    BadInput("keep_mask_rows", {"keep_mask": np.ones((8,), dtype=bool)}, ValueError, "keep_mask"),
    BadInput("keep_ids_and_mask", {"keep_mask": np.ones((4, 8), dtype=bool),
                                   "keep_ids": np.zeros((4, 2), dtype=np.int64)}, ValueError, "keep_ids"),
    BadInput("keep_ids_float", {"keep_ids": np.zeros((4, 2), dtype=np.float32)}, TypeError, "keep_ids"),
    BadInput("keep_ids_bool", {"keep_ids": np.zeros((4, 2), dtype=bool)}, TypeError, "keep_ids"),
    BadInput("keep_ids_list", {"keep_ids": [[0, 1]] * 4}, TypeError, "keep_ids"),
    BadInput("keep_ids_rows", {"keep_ids": np.zeros((3, 2), dtype=np.int64)}, ValueError, "keep_ids"),
    BadInput("keep_ids_no_k", {"keep_ids": np.zeros((4,), dtype=np.int64)}, ValueError, "keep_ids"),
    BadInput("keep_ids_too_large", {"keep_ids": np.array([[0, 8]] * 4, dtype=np.int64)}, ValueError, "keep_ids"),
    BadInput("keep_ids_negative", {"keep_ids": np.array([[0, -2]] * 4, dtype=np.int64)}, ValueError, "keep_ids"),
    BadInput("temperature_zero", {"temperature": 0.0}, ValueError, "temperature"),
    BadInput("temperature_negative", {"temperature": -1.0}, ValueError, "temperature"),
    BadInput("temperature_nan", {"temperature": float("nan")}, ValueError, "temperature"),
    BadInput("temperature_inf", {"temperature": float("inf")}, ValueError, "temperature"),
    BadInput("temperature_str", {"temperature": "1.0"}, TypeError, "temperature"),
    BadInput("temperature_bool", {"temperature": True}, TypeError, "temperature"),
    # a temperature tensor must broadcast to the rows (4,) (dualvp.testing.extended has more)
    BadInput("temperature_array", {"temperature": np.array([1.0, 2.0])}, ValueError, "temperature"),
    BadInput("ignore_index_float", {"ignore_index": -100.0}, TypeError, "ignore_index"),
    BadInput("ignore_index_str", {"ignore_index": "-100"}, TypeError, "ignore_index"),
    BadInput("with_entropy_str", {"with_entropy": "yes"}, TypeError, "with_entropy"),
    BadInput("with_entropy_int", {"with_entropy": 1}, TypeError, "with_entropy"),
    BadInput("entropy_grad_none", {"entropy_grad": None}, TypeError, "entropy_grad"),
    BadInput("group_str", {"group": "world"}, TypeError, "group", ("torch",)),
    BadInput("group_int", {"group": 0}, TypeError, "group", ("torch",)),
    BadInput("validate_str", {"validate": "no"}, TypeError, "validate", ("torch",)),
)
assert len({b.name for b in BAD_INPUTS}) == len(BAD_INPUTS)
