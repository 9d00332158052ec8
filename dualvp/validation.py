"""Argument validation and the cross-rank agreement record, shared by the backends.

Backends describe their arguments with plain Python values (shapes as tuples,
dtypes as names such as ``"float32"``), call :func:`check_args`, and only then
enter any collective. Every error names the argument, what was expected and
what was given. :func:`check_args` returns one frozen, hashable
:class:`Options`: the torch op carries it, the JAX backend uses it as its
static (``jit``) configuration, and the cross-rank agreement record is made
from it.

For process groups, :func:`agreement_record` packs what must agree across
ranks (the options, shapes, the local validation outcome) into a short list of
int64. A backend all-gathers it (O(1) bytes, one collective) and calls
:func:`check_agreement`, which raises the *same* error on every rank when the
ranks differ or one of them failed validation.

The fused LM-head op (``linear_logprob_entropy``: hidden states and the
vocab-parallel weight instead of logits) uses :func:`check_linear_args` and
the longer record :data:`LINEAR_RECORD_FIELDS` (``agreement_record(...,
fused=True)``, ``check_agreement(..., fields=LINEAR_RECORD_FIELDS)``): it adds
the hidden size, the local hidden rows, ``reduce_hidden_grad``,
``sequence_parallel`` and whether hidden and weight require grad, because each
of those decides whether a rank enters a collective in the backward (or
whether ``dh`` comes out ``W`` times too large).
"""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import Optional, Sequence

__all__ = [
    "Options",
    "FLOAT_DTYPES",
    "INT_DTYPES",
    "ARGUMENTS",
    "check_args",
    "check_linear_args",
    "check_temperature",
    "check_keep_ids",
    "count_bad_ids",
    "bad_ids_error",
    "check_temperature_values",
    "agreement_record",
    "check_agreement",
    "RECORD_FIELDS",
    "LINEAR_RECORD_FIELDS",
]

FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")
INT_DTYPES = ("int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64")

#: Argument names; a failing check is encoded as 1 + its index in the record.
ARGUMENTS = (
    "logits",
    "target",
    "keep_mask",
    "temperature",
    "ignore_index",
    "with_entropy",
    "entropy_grad",
    "group",
    "validate",
    "inplace_grad",
    "chunk_size",
    "label_smoothing",
    "hidden",
    "weight",
    "reduce_hidden_grad",
    "sequence_parallel",
    "memory_budget",
    "keep_ids",
)


def _shape(s) -> tuple:
    return tuple(int(d) for d in s)


def check_temperature(temperature) -> float:
    """Return ``temperature`` as a float; raise if not a finite number > 0.

    Python numbers, NumPy scalars and 0-d arrays/tensors are accepted; bools
    and strings are rejected even though ``float()`` would take them.
    """
    def _type_error():
        return TypeError(
            f"temperature: expected a finite float > 0, got {type(temperature).__name__} {temperature!r}"[:300]
        )

    if isinstance(temperature, (bool, str, bytes)) or type(temperature).__name__ in ("bool_", "bool"):
        raise _type_error()
    if getattr(temperature, "dtype", None) is not None and "bool" in str(temperature.dtype):
        raise _type_error()
    if getattr(temperature, "shape", ()) not in ((), None) and tuple(temperature.shape) != ():
        raise _type_error()
    try:
        value = float(temperature)
    except (TypeError, ValueError):
        raise _type_error() from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"temperature: expected a finite float > 0, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Options:
    """The validated options of one call (frozen and hashable).

    Attributes:
      temperature: ``tau`` as a finite Python float ``> 0``.
      ignore_index: rows whose target equals it are ignored.
      with_entropy: the entropy is returned.
      entropy_grad: the entropy is differentiable (when returned).
      has_mask: a keep mask was given.
      has_ids: the kept set was given as ids (``keep_ids``, the alternative
        to a keep mask; never both).
      inplace_grad: the gradient may overwrite the logits (torch only).
      label_smoothing: the smoothing of the Megatron drop-in
        (``dualvp_torch.compat.vocab_parallel_cross_entropy``), 0 for the op
        itself; in the agreement record because a rank with ``0`` skips the
        drop-in's extra all-reduce that the others enter.
      reduce_hidden_grad: fused op only: ``dh`` is reduced over the group.
      sequence_parallel: fused op only: hidden holds this rank's ``T/W`` rows.
      n_targets: 0: one target per row (``target [...]``, log-prob ``[...]``);
        ``K >= 1``: ``target [..., K]`` (``multi_target=True``), log-prob
        ``[..., K]``.
      row_temperature: the temperature is a tensor, one per row (broadcast
        to the rows); ``temperature`` is then 1.0 and unused.
      with_sum_p2: ``sum_v p_v^2`` is returned as well (no gradient).
    """

    temperature: float = 1.0
    ignore_index: int = -100
    with_entropy: bool = True
    entropy_grad: bool = True
    has_mask: bool = False
    inplace_grad: bool = False
    has_ids: bool = False
    label_smoothing: float = 0.0
    reduce_hidden_grad: bool = True
    sequence_parallel: bool = False
    n_targets: int = 0
    row_temperature: bool = False
    with_sum_p2: bool = False

    @property
    def need_entropy_grad(self) -> bool:
        """The backward needs the entropy term (``with_entropy and entropy_grad``)."""
        return self.with_entropy and self.entropy_grad


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")


def check_args(
    *,
    logits_shape: Sequence[int],
    logits_dtype: str,
    target_shape: Sequence[int],
    target_dtype: str,
    keep_shape: Optional[Sequence[int]] = None,
    keep_dtype: Optional[str] = None,
    temperature=1.0,
    ignore_index=-100,
    with_entropy=True,
    entropy_grad=True,
    inplace_grad=False,
    ids_shape: Optional[Sequence[int]] = None,
    ids_dtype: Optional[str] = None,
    multi_target=False,
    temperature_shape: Optional[Sequence[int]] = None,
    temperature_dtype: Optional[str] = None,
    with_sum_p2=False,
    ids_with_extended: bool = False,
) -> Options:
    """Check shapes, dtypes and options; return them as :class:`Options`.

    ``ids_with_extended``: the backend takes ``keep_ids`` together with
    ``multi_target``, ``with_sum_p2`` or a temperature tensor (the torch
    backend); otherwise that combination raises ``NotImplementedError``.

    ``multi_target=True``: ``target [..., K]`` (K >= 1 targets per row, the
    leading dims of logits). ``temperature_shape`` / ``temperature_dtype``
    (given together) describe a temperature *tensor*: floating, its shape
    broadcastable to the rows ``logits.shape[:-1]``; its values (finite,
    > 0) are the backend's to check (:func:`check_temperature_values`).

    Expected: ``logits [..., V_local]`` floating (one of :data:`FLOAT_DTYPES`)
    with ``V_local >= 1``; ``target [...]`` integer with the same leading
    shape; ``keep_mask`` ``None`` or bool with the shape of ``logits``;
    ``keep_ids`` (``ids_shape``, ``ids_dtype``) ``None`` or integer
    ``target.shape + (K,)`` with ``K >= 0``, and not together with
    ``keep_mask`` (:func:`check_keep_ids`);
    ``temperature`` finite and ``> 0``; ``ignore_index`` an int; the flags bools.

    Raises:
      TypeError: a dtype or option of the wrong type.
      ValueError: a shape or value out of range.
    """
    ls, ts = _shape(logits_shape), _shape(target_shape)
    if logits_dtype not in FLOAT_DTYPES:
        raise TypeError(f"logits: expected a floating dtype in {FLOAT_DTYPES}, got {logits_dtype}")
    if len(ls) < 1:
        raise ValueError(f"logits: expected shape [..., V_local] with at least 1 dim, got shape {ls}")
    if ls[-1] < 1:
        raise ValueError(f"logits: expected V_local = logits.shape[-1] >= 1, got shape {ls}")
    if target_dtype not in INT_DTYPES:
        raise TypeError(f"target: expected an integer dtype, got {target_dtype}")
    _check_flag("multi_target", multi_target)
    _check_flag("with_sum_p2", with_sum_p2)
    if multi_target:
        if len(ts) != len(ls) or ts[:-1] != ls[:-1] or ts[-1] < 1:
            raise ValueError(
                f"target: expected shape {ls[:-1] + ('K',)} with K >= 1 (multi_target=True: the leading dims of "
                f"logits {ls}, then K targets per row), got shape {ts}"
            )
    elif ts != ls[:-1]:
        raise ValueError(
            f"target: expected shape {ls[:-1]} (the leading dims of logits {ls}), got shape {ts}"
        )
    has_ids = check_keep_ids(ts if not multi_target else ts[:-1], ids_shape, ids_dtype,
                             keep_shape is not None or keep_dtype is not None)
    if keep_shape is not None or keep_dtype is not None:
        if keep_dtype != "bool":
            raise TypeError(f"keep_mask: expected dtype bool, got {keep_dtype}")
        if _shape(keep_shape) != ls:
            raise ValueError(f"keep_mask: expected shape {ls} (the shape of logits), got shape {_shape(keep_shape)}")
    row_tau = temperature_shape is not None or temperature_dtype is not None
    if row_tau:
        _check_temperature_tensor(temperature_shape, temperature_dtype, ls[:-1])
        tau = 1.0
    else:
        tau = check_temperature(temperature)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int, got {type(ignore_index).__name__} {ignore_index!r}")
    _check_flag("with_entropy", with_entropy)
    _check_flag("entropy_grad", entropy_grad)
    _check_flag("inplace_grad", inplace_grad)
    if has_ids and not ids_with_extended:
        # keep_ids rides the single-target core op; the extended op (K targets, a
        # temperature tensor, sum p^2) has no id path yet. Raised here, from
        # shapes and flags alone, so every rank raises alike.
        for name, on in (("multi_target=True", multi_target), ("a temperature tensor", row_tau),
                         ("with_sum_p2=True", with_sum_p2)):
            if on:
                raise NotImplementedError(f"keep_ids: not implemented together with {name}; pass the kept "
                                          f"set as keep_mask instead")
    return Options(
        temperature=tau,
        ignore_index=int(ignore_index),
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        has_mask=keep_shape is not None or keep_dtype is not None,
        inplace_grad=inplace_grad,
        has_ids=has_ids,
        n_targets=int(ts[-1]) if multi_target else 0,
        row_temperature=row_tau,
        with_sum_p2=with_sum_p2,
    )


def check_keep_ids(target_shape: Sequence[int], ids_shape, ids_dtype, has_mask: bool) -> bool:
    """Check ``keep_ids`` (``None`` when both ``ids_shape`` and ``ids_dtype`` are); return whether it is given.

    Expected: integer (one of :data:`INT_DTYPES`) ``target_shape + (K,)``
    with ``K >= 0`` (padding -1), and no keep mask beside it.

    Raises:
      ValueError: ``keep_ids`` together with ``keep_mask``, or a wrong shape.
      TypeError: a non-integer dtype.
    """
    if ids_shape is None and ids_dtype is None:
        return False
    if has_mask:
        raise ValueError("keep_ids: expected None when keep_mask is given (keep_mask and keep_ids are two forms "
                         "of one kept set; pass one of them)")
    if ids_dtype not in INT_DTYPES:
        raise TypeError(f"keep_ids: expected an integer dtype (global token ids, padding -1), got {ids_dtype}")
    ks, ts = _shape(ids_shape), _shape(target_shape)
    if len(ks) != len(ts) + 1 or ks[:-1] != ts:
        raise ValueError(f"keep_ids: expected shape {ts + ('K',)} (the shape of target + (K,)), got shape {ks}")
    return True


def count_bad_ids(ids, vocab_size: int) -> tuple:
    """``(count, up to 5 distinct bad ids)`` of a NumPy ``keep_ids`` outside ``[0, vocab_size)`` and not -1.

    The host-side range check of ``validate=True`` (like the target's).
    """
    import numpy as np

    a = np.asarray(ids)
    if a.size == 0:
        return 0, []
    a = a.astype(np.int64, copy=False) if a.dtype != np.uint64 else a
    bad = (a != -1) & ((a < 0) | (a >= vocab_size))
    n = int(np.count_nonzero(bad))
    return n, ([int(v) for v in np.unique(a[bad])[:5]] if n else [])


def bad_ids_error(count: int, shown, vocab_size: int) -> ValueError:
    """The ``ValueError`` of :func:`count_bad_ids`'s result (same text on every backend)."""
    return ValueError(f"keep_ids: expected ids in [0, {vocab_size}) or the padding -1, got {count} out-of-range "
                      f"id(s), e.g. {list(shown)}")


def _check_temperature_tensor(shape, dtype, rows: tuple) -> None:
    # A per-row temperature: floating, broadcastable to the rows (right-aligned, each dim 1 or equal).
    if dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"temperature: expected a float or a floating tensor broadcastable to {rows}, got dtype {dtype}"
        )
    ts = _shape(shape if shape is not None else ())
    ok = len(ts) <= len(rows) and all(a in (1, b) for a, b in zip(ts[::-1], rows[::-1]))
    if not ok:
        raise ValueError(
            f"temperature: expected a tensor broadcastable to the rows {rows} (logits.shape[:-1]), got shape {ts}"
        )


def check_temperature_values(n_bad: int, shown=None) -> None:
    """Raise the per-row temperature's ``ValueError`` if ``n_bad`` entries are not finite and > 0."""
    if n_bad:
        raise ValueError(
            f"temperature: expected finite values > 0, got {int(n_bad)} bad value(s)"
            + (f", e.g. {shown!r}" if shown is not None else "")
        )


def check_linear_args(
    *,
    hidden_shape: Sequence[int],
    hidden_dtype: str,
    weight_shape: Sequence[int],
    weight_dtype: str,
    target_shape: Sequence[int],
    target_dtype: str,
    keep_shape: Optional[Sequence[int]] = None,
    keep_dtype: Optional[str] = None,
    temperature=1.0,
    ignore_index=-100,
    with_entropy=True,
    entropy_grad=True,
    reduce_hidden_grad=True,
    ids_shape: Optional[Sequence[int]] = None,
    ids_dtype: Optional[str] = None,
    sequence_parallel=False,
    world_size: int = 1,
    memory_budget=None,
) -> Options:
    """Checks of the fused LM-head op; returns its :class:`Options`.

    Expected: ``hidden [..., H]`` floating with ``H >= 1``; ``weight [V_local,
    H]`` of the same dtype with ``V_local >= 1``; ``target [...]`` integer with
    the leading shape of ``hidden``, or, with ``sequence_parallel=True``,
    ``hidden [T/W, ..., H]`` (this rank's rows of the first dim) and ``target
    [T, ...]`` whose first dim ``W`` divides; ``keep_mask`` ``None`` or bool
    ``target.shape + (V_local,)``; ``reduce_hidden_grad`` and
    ``sequence_parallel`` bools (``sequence_parallel=True`` always
    reduce-scatters ``dh``, so it needs ``reduce_hidden_grad=True``);
    ``memory_budget`` ``None`` or an int ``>= 1`` (bytes); the rest as in
    :func:`check_args`.

    Raises:
      TypeError: a dtype or option of the wrong type.
      ValueError: a shape or value out of range.
    """
    hs, ws, ts = _shape(hidden_shape), _shape(weight_shape), _shape(target_shape)
    if hidden_dtype not in FLOAT_DTYPES:
        raise TypeError(f"hidden: expected a floating dtype in {FLOAT_DTYPES}, got {hidden_dtype}")
    if len(hs) < 1 or hs[-1] < 1:
        raise ValueError(f"hidden: expected shape [..., H] with H >= 1, got shape {hs}")
    if weight_dtype != hidden_dtype:
        raise TypeError(f"weight: expected the dtype of hidden ({hidden_dtype}), got {weight_dtype}")
    if len(ws) != 2 or ws[0] < 1 or ws[1] != hs[-1]:
        raise ValueError(
            f"weight: expected shape [V_local, H] with V_local >= 1 and H = hidden.shape[-1] = {hs[-1]}, "
            f"got shape {ws}"
        )
    _check_flag("reduce_hidden_grad", reduce_hidden_grad)
    _check_flag("sequence_parallel", sequence_parallel)
    if memory_budget is not None:
        what = f"{type(memory_budget).__name__} {memory_budget!r}"[:200]
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, int):
            raise TypeError(f"memory_budget: expected None or an int >= 1 (bytes), got {what}")
        if memory_budget < 1:
            raise ValueError(f"memory_budget: expected None or an int >= 1 (bytes), got {what}")
    w = int(world_size)
    if sequence_parallel:
        if reduce_hidden_grad is not True:
            raise ValueError(
                "reduce_hidden_grad: expected True with sequence_parallel=True (the op reduce-scatters dh over "
                "the group; a caller-side reduction of a [T/W, H] gradient does not exist), got False"
            )
        if len(hs) < 2:
            raise ValueError(f"hidden: expected shape [T/W, ..., H] with sequence_parallel=True, got shape {hs}")
        if len(ts) != len(hs) - 1 or ts[1:] != hs[1:-1]:
            raise ValueError(
                f"target: expected shape [T, {', '.join(map(str, hs[1:-1]))}{', ' if hs[1:-1] else ''}] "
                f"(sequence_parallel=True: hidden {hs} holds T/W rows of the first dim), got shape {ts}"
            )
        if ts[0] % w:
            raise ValueError(
                f"sequence_parallel: expected the W = {w} ranks to divide T = target.shape[0] = {ts[0]} rows, "
                f"got a remainder of {ts[0] % w}"
            )
        if hs[0] * w != ts[0]:
            raise ValueError(
                f"hidden: expected this rank's T/W = {ts[0] // w} rows (hidden.shape[0], sequence_parallel=True, "
                f"T = {ts[0]}, W = {w}), got shape {hs}"
            )
    elif ts != hs[:-1]:
        raise ValueError(f"target: expected shape {hs[:-1]} (the leading dims of hidden {hs}), got shape {ts}")
    v_local = ws[0]
    if keep_shape is not None and keep_dtype == "bool" and _shape(keep_shape) != ts + (v_local,):
        raise ValueError(
            f"keep_mask: expected shape {ts + (v_local,)} (target's shape + (V_local = weight.shape[0],)), "
            f"got shape {_shape(keep_shape)}"
        )
    opt = check_args(
        logits_shape=ts + (v_local,),
        logits_dtype=hidden_dtype,
        target_shape=ts,
        target_dtype=target_dtype,
        keep_shape=keep_shape,
        keep_dtype=keep_dtype,
        temperature=temperature,
        ignore_index=ignore_index,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        ids_shape=ids_shape,
        ids_dtype=ids_dtype,
    )
    return dataclasses.replace(opt, reduce_hidden_grad=reduce_hidden_grad, sequence_parallel=sequence_parallel)


# --- cross-rank agreement -------------------------------------------------

#: Fields of an agreement record, in order. ``error`` is 0 when local
#: validation passed, else 1 + the index of the failing argument in
#: :data:`ARGUMENTS`; ``bad_targets`` counts out-of-range targets.
RECORD_FIELDS = (
    "error",
    "T",
    "V_local",
    "logits dtype",
    "keep_mask present",
    "with_entropy",
    "entropy_grad",
    "temperature",
    "ignore_index",
    "label_smoothing",
    "targets per row",
    "temperature tensor",
    "with_sum_p2",
    "bad_targets",
)

#: Fields of the fused op's record (``agreement_record(..., fused=True)``): the
#: fields of :data:`RECORD_FIELDS` (``T`` counts the target's rows, the dtype
#: is hidden's, ``label_smoothing`` is 0), then what decides the backward's collectives and the scale
#: of ``dh``, then ``bad_targets`` last.
#: Built from :data:`RECORD_FIELDS` because :func:`agreement_record` writes the
#: same leading thirteen fields for both ops.
LINEAR_RECORD_FIELDS = (
    RECORD_FIELDS[:3]
    + ("hidden dtype",)
    + RECORD_FIELDS[4:-1]
    + (
        "H",
        "hidden rows",
        "reduce_hidden_grad",
        "sequence_parallel",
        "hidden requires grad",
        "weight requires grad",
    )
    + RECORD_FIELDS[-1:]
)


def _error_code(exc: Optional[BaseException]) -> int:
    if exc is None:
        return 0
    msg = str(exc)
    for i, name in enumerate(ARGUMENTS):
        if msg.startswith(name + ":"):
            return i + 1
    return len(ARGUMENTS) + 1


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def agreement_record(
    *,
    error: Optional[BaseException],
    n_rows: int = -1,
    v_local: int = -1,
    logits_dtype: str = "",
    options: Optional[Options] = None,
    fused: bool = False,
    hidden_size: int = -1,
    hidden_rows: int = -1,
    hidden_requires_grad: bool = False,
    weight_requires_grad: bool = False,
) -> list[int]:
    """The int64 record one rank contributes to the agreement all-gather.

    ``options`` is what :func:`check_args` returned (required unless
    ``error`` is given). The last field (``bad_targets``) is left 0 here; a
    backend fills it with a device-side count so that the range check needs
    no extra synchronisation.

    ``fused=True`` makes the record of the fused LM-head op
    (:data:`LINEAR_RECORD_FIELDS`, also on error, so that every rank's record
    has the same length): ``logits_dtype`` is then hidden's dtype, ``n_rows``
    the target's rows, and ``hidden_size`` (``H``), ``hidden_rows`` (this
    rank's rows of hidden) and the two ``*_requires_grad`` flags (whether
    autograd will run this rank's backward for that input) are recorded.
    """
    fields = LINEAR_RECORD_FIELDS if fused else RECORD_FIELDS
    if error is None and options is None:
        raise TypeError("options: expected the Options returned by check_args when error is None, got None")
    dtype_code = FLOAT_DTYPES.index(logits_dtype) if logits_dtype in FLOAT_DTYPES else -1
    if error is not None:
        return [_error_code(error)] + [-1] * (len(fields) - 1)
    try:
        tau_bits = _float_bits(options.temperature)
        smoothing_bits = _float_bits(options.label_smoothing)
    except (TypeError, ValueError, struct.error):
        tau_bits = smoothing_bits = -1
    record = [
        0,
        int(n_rows),
        int(v_local),
        dtype_code,
        int(options.has_mask) + 2 * int(options.has_ids),  # 0 none, 1 keep_mask, 2 keep_ids
        int(options.with_entropy),
        int(options.entropy_grad),
        tau_bits,
        int(options.ignore_index),
        smoothing_bits,
        # the width of the gathered statistics depends on these: ranks that differ raise, never hang
        int(options.n_targets),
        int(options.row_temperature),
        int(options.with_sum_p2),
    ]
    if fused:
        record += [
            int(hidden_size),
            int(hidden_rows),
            int(options.reduce_hidden_grad),
            int(options.sequence_parallel),
            int(bool(hidden_requires_grad)),
            int(bool(weight_requires_grad)),
        ]
    return record + [0]


def _render(field: str, value: int) -> str:
    if field == "keep_mask present" and value == 2:
        return "keep_ids"
    if field in ("temperature", "label_smoothing"):
        return repr(struct.unpack("<d", struct.pack("<q", value))[0])
    if field in ("logits dtype", "hidden dtype"):
        return FLOAT_DTYPES[value] if 0 <= value < len(FLOAT_DTYPES) else "?"
    if field in (
        "keep_mask present", "with_entropy", "entropy_grad", "reduce_hidden_grad", "sequence_parallel",
        "temperature tensor", "with_sum_p2",
        "hidden requires grad", "weight requires grad",
    ):
        return str(bool(value))
    return str(value)


def check_agreement(
    records: Sequence[Sequence[int]],
    *,
    rank: int,
    local_error: Optional[BaseException] = None,
    vocab_size: Optional[int] = None,
    fields: Sequence[str] = RECORD_FIELDS,
) -> None:
    """Raise the same error on every rank unless all records agree and pass.

    Args:
      records: one :func:`agreement_record` per rank, in rank order (the
        all-gathered table).
      rank: this rank, only to chain ``local_error``.
      local_error: this rank's own validation error, if any.
      vocab_size: ``W * V_local``, for the out-of-range message.
      fields: the record layout: :data:`RECORD_FIELDS`, or
        :data:`LINEAR_RECORD_FIELDS` for the fused op.

    Raises:
      The local ``ValueError``/``TypeError`` when every rank failed on the same
      argument (each rank then raises its own, equally named error);
      ``RuntimeError`` naming the ranks and the argument or option that differs
      otherwise; ``ValueError`` on every rank when any rank has out-of-range
      targets.
    """
    rows = [list(map(int, r)) for r in records]
    errors = [r[0] for r in rows]
    if any(errors):
        if local_error is not None and len(set(errors)) == 1:
            raise local_error
        failed = ", ".join(
            f"rank {i} ({_arg_name(code)})" for i, code in enumerate(errors) if code
        )
        raise RuntimeError(
            f"dualvp: argument validation failed on {failed} while other ranks passed or failed "
            "differently; every rank of the group raises this error instead of entering the collective"
        ) from local_error
    for j, field in enumerate(fields[1:-1], start=1):
        values = [r[j] for r in rows]
        if len(set(values)) > 1:
            shown = ", ".join(f"rank {i}: {_render(field, v)}" for i, v in enumerate(values))
            raise RuntimeError(f"dualvp: ranks of the group disagree on {field} ({shown}); every rank raises")
    bad = [r[-1] for r in rows]
    if any(bad):
        shown = ", ".join(f"rank {i}: {b}" for i, b in enumerate(bad) if b)
        raise ValueError(
            f"target: expected ids in [0, {vocab_size}) or ignore_index, got out-of-range ids ({shown})"
        )


def _arg_name(code: int) -> str:
    return ARGUMENTS[code - 1] if 1 <= code <= len(ARGUMENTS) else "unknown argument"
