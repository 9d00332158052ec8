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
    "check_temperature",
    "agreement_record",
    "check_agreement",
    "RECORD_FIELDS",
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
      inplace_grad: the gradient may overwrite the logits (torch only).
      label_smoothing: the smoothing of the Megatron drop-in
        (``dualvp_torch.compat.vocab_parallel_cross_entropy``), 0 for the op
        itself; in the agreement record because a rank with ``0`` skips the
        drop-in's extra all-reduce that the others enter.
    """

    temperature: float = 1.0
    ignore_index: int = -100
    with_entropy: bool = True
    entropy_grad: bool = True
    has_mask: bool = False
    inplace_grad: bool = False
    label_smoothing: float = 0.0

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
) -> Options:
    """Check shapes, dtypes and options; return them as :class:`Options`.

    Expected: ``logits [..., V_local]`` floating (one of :data:`FLOAT_DTYPES`)
    with ``V_local >= 1``; ``target [...]`` integer with the same leading
    shape; ``keep_mask`` ``None`` or bool with the shape of ``logits``;
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
    if ts != ls[:-1]:
        raise ValueError(
            f"target: expected shape {ls[:-1]} (the leading dims of logits {ls}), got shape {ts}"
        )
    if keep_shape is not None or keep_dtype is not None:
        if keep_dtype != "bool":
            raise TypeError(f"keep_mask: expected dtype bool, got {keep_dtype}")
        if _shape(keep_shape) != ls:
            raise ValueError(f"keep_mask: expected shape {ls} (the shape of logits), got shape {_shape(keep_shape)}")
    tau = check_temperature(temperature)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int, got {type(ignore_index).__name__} {ignore_index!r}")
    _check_flag("with_entropy", with_entropy)
    _check_flag("entropy_grad", entropy_grad)
    _check_flag("inplace_grad", inplace_grad)
    return Options(
        temperature=tau,
        ignore_index=int(ignore_index),
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        has_mask=keep_shape is not None or keep_dtype is not None,
        inplace_grad=inplace_grad,
    )


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
    "bad_targets",
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
) -> list[int]:
    """The int64 record one rank contributes to the agreement all-gather.

    ``options`` is what :func:`check_args` returned (required unless
    ``error`` is given). The last field (``bad_targets``) is left 0 here; a
    backend fills it with a device-side count so that the range check needs
    no extra synchronisation.
    """
    if error is None and options is None:
        raise TypeError("options: expected the Options returned by check_args when error is None, got None")
    dtype_code = FLOAT_DTYPES.index(logits_dtype) if logits_dtype in FLOAT_DTYPES else -1
    if error is not None:
        return [_error_code(error)] + [-1] * (len(RECORD_FIELDS) - 1)
    try:
        tau_bits = _float_bits(options.temperature)
        smoothing_bits = _float_bits(options.label_smoothing)
    except (TypeError, ValueError, struct.error):
        tau_bits = smoothing_bits = -1
    return [
        0,
        int(n_rows),
        int(v_local),
        dtype_code,
        int(options.has_mask),
        int(options.with_entropy),
        int(options.entropy_grad),
        tau_bits,
        int(options.ignore_index),
        smoothing_bits,
        0,
    ]


def _render(field: str, value: int) -> str:
    if field in ("temperature", "label_smoothing"):
        return repr(struct.unpack("<d", struct.pack("<q", value))[0])
    if field == "logits dtype":
        return FLOAT_DTYPES[value] if 0 <= value < len(FLOAT_DTYPES) else "?"
    if field in ("keep_mask present", "with_entropy", "entropy_grad"):
        return str(bool(value))
    return str(value)


def check_agreement(
    records: Sequence[Sequence[int]],
    *,
    rank: int,
    local_error: Optional[BaseException] = None,
    vocab_size: Optional[int] = None,
) -> None:
    """Raise the same error on every rank unless all records agree and pass.

    Args:
      records: one :func:`agreement_record` per rank, in rank order (the
        all-gathered table).
      rank: this rank, only to chain ``local_error``.
      local_error: this rank's own validation error, if any.
      vocab_size: ``W * V_local``, for the out-of-range message.

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
    for j, field in enumerate(RECORD_FIELDS[1:-1], start=1):
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
