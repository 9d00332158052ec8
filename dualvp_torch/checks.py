"""The argument checks of both torch ops, every engine, the drop-ins and DTensor: one routine.

A call is checked once, before its engine runs::

    check_call       group, validate, impl        the same on every rank: raise at once
    local checks     types, shapes, dtypes,       rank-private: a failure goes through the
                     devices, options, engine     agreement (validate=True with a group), so
                                                  every rank raises, none waits in a collective
    -> Call          options, engine, rank, shapes, the agreement record, the engine's plan

The local checks of the logits op are a pure function of the tensors'
metadata (:func:`meta`) and the options, so :func:`logits_call` caches the
:class:`Call` per call metadata: a repeated call runs none of them again (a
failing call is never cached and raises every time). With ``validate=True``
the agreement itself (:func:`agree`: the record all-gathered with the
out-of-range target count, or with no group that count read on the host) runs
inside the op, after the engine's statistics, because the Triton engine
counts the bad targets in its statistics kernel: one host sync either way.

The fused LM-head op (:func:`linear_call`) goes through the same steps with
its longer record; its record holds whether hidden and weight require grad
under the current grad mode, so it is not cached.

This module's job is to share the check helpers: :func:`kind`,
:func:`dtype_name`, :func:`meta`, :func:`check_target_keep`, :func:`argument_names`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional

import torch

from dualvp import validation

from . import agreement, collectives, linear_triton, selection
from .engine_names import FIXED, NAMES

__all__ = [
    "Call",
    "kind",
    "argument_names",
    "dtype_name",
    "meta",
    "check_call",
    "check_target_keep",
    "logits_options",
    "logits_call",
    "linear_call",
    "agree",
    "count_bad_targets",
]


class Call(NamedTuple):
    """A checked call: what the engines and the agreement read, a pure function of the call's metadata."""

    opt: validation.Options
    engine: str  # a name of dualvp_torch.engine_names.NAMES
    rank: int
    world: int
    rows: int  # T, the target's elements
    v_local: int
    dtype: torch.dtype  # logits' (hidden's for the fused op)
    device_type: str
    validate: bool
    record: Optional[tuple]  # the agreement record (validate=True with a group), bad-target field 0
    fields: tuple  # its layout: validation.RECORD_FIELDS or LINEAR_RECORD_FIELDS
    plan: Any = None  # the engine's launch state (selection.Traits.plan)

    @property
    def vocab(self) -> int:
        """``W * V_local``, the global vocabulary."""
        return self.world * self.v_local


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the names of :mod:`dualvp.validation`)."""
    return str(dtype).replace("torch.", "")


def kind(x: object) -> str:
    """What an argument is, for an error message: a tensor's dtype and shape, else its type and repr."""
    if isinstance(x, torch.Tensor):
        return f"tensor of dtype {dtype_name(x.dtype)} and shape {tuple(x.shape)}"
    return f"{type(x).__name__} {x!r}"[:200]


@contextlib.contextmanager
def argument_names(**names: str):
    """Re-word errors of :func:`dualvp_torch.logprob_entropy` with the caller's argument names (``inner=outer``).

    The errors are raised alike on every rank (agreement step), so the
    re-worded ones are too.
    """
    try:
        yield
    except (TypeError, ValueError) as exc:
        msg = str(exc)
        for inner, outer in names.items():
            if msg.startswith(inner + ":"):
                raise type(exc)(outer + msg[len(inner) :]) from exc
        raise


def meta(x: Optional[torch.Tensor]) -> Optional[tuple]:
    """What the local checks read of a tensor: ``(shape, dtype, device, requires_grad, is_leaf, contiguous,
    stride)``."""
    if x is None:
        return None
    return (x.shape, x.dtype, x.device, x.requires_grad, x.is_leaf, x.is_contiguous(), x.stride())


def _meta3(x: Optional[torch.Tensor]) -> Optional[tuple]:
    # (shape, dtype, device): all the checks read of target and keep_mask
    return None if x is None else (x.shape, x.dtype, x.device)


def check_call(group: object, validate: object, impl: object) -> tuple[int, int]:
    """The checks every rank passes or fails alike, before any local check; returns ``(rank, world)`` of ``group``."""
    if group is not None and not collectives.is_process_group(group):
        raise TypeError(f"group: expected a torch.distributed.ProcessGroup or None, got {kind(group)}")
    if not isinstance(validate, bool):
        raise TypeError(f"validate: expected a bool, got {type(validate).__name__} {validate!r}")
    if impl is not None and impl not in NAMES:
        raise ValueError(f"impl: expected None or one of {NAMES}, got {impl!r}")
    return collectives.group_rank_world(group)


def _check_tensors(*expected: tuple[str, object, str]) -> None:
    # TypeError naming the first (name, x, what) whose x is not a tensor (None passes for keep_mask / keep_ids)
    for name, x, what in expected:
        if not isinstance(x, torch.Tensor) and not (name in ("keep_mask", "keep_ids") and x is None):
            raise TypeError(f"{name}: expected {what}, got {kind(x)}")


def check_target_keep(
    *leading: tuple[str, object, str], target: object, keep_mask: object, keep_ids: object = None
) -> dict:
    """Type checks of an op's tensors, then the target/keep-mask keywords of ``validation.check_*args``.

    ``leading`` are the op's own ``(name, x, what)`` entries (logits, or hidden
    and weight), checked before ``target [...]`` and ``keep_mask [...,
    V_local]`` so that the first wrong argument in signature order is named.
    Returns ``target_shape``, ``target_dtype``, ``keep_shape`` and
    ``keep_dtype`` (both ``None`` without a mask), ``ids_shape`` and
    ``ids_dtype`` (both ``None`` without ``keep_ids``).
    """
    _check_tensors(
        *leading,
        ("target", target, "an integer torch.Tensor [...]"),
        ("keep_mask", keep_mask, "None or a bool torch.Tensor [..., V_local]"),
        ("keep_ids", keep_ids, _IDS_WHAT),
    )
    return dict(
        target_shape=tuple(target.shape),
        target_dtype=dtype_name(target.dtype),
        keep_shape=None if keep_mask is None else tuple(keep_mask.shape),
        keep_dtype=None if keep_mask is None else dtype_name(keep_mask.dtype),
        ids_shape=None if keep_ids is None else tuple(keep_ids.shape),
        ids_dtype=None if keep_ids is None else dtype_name(keep_ids.dtype),
    )


_IDS_WHAT = "None or an integer torch.Tensor [..., K] of global token ids (padding -1)"


def logits_options(lm: tuple, tm: tuple, km: Optional[tuple], temperature: object, ignore_index: object,
                   with_entropy: object, entropy_grad: object, inplace_grad: object, multi_target: object = False,
                   with_sum_p2: object = False, taum: Optional[tuple] = None,
                   im: Optional[tuple] = None) -> validation.Options:
    """The logits op's local checks after the type checks, a pure function of the tensors' :func:`meta`
    (``tm``, ``km``, ``taum``, ``im``: its first three fields; ``taum``: a temperature tensor's, ``im``:
    keep_ids') and the options."""
    tau_kw = {}
    if taum is not None:
        tau_kw = dict(temperature_shape=tuple(taum[0]), temperature_dtype=dtype_name(taum[1]))
        temperature = 1.0
    opt = validation.check_args(
        logits_shape=tuple(lm[0]),
        logits_dtype=dtype_name(lm[1]),
        target_shape=tuple(tm[0]),
        target_dtype=dtype_name(tm[1]),
        keep_shape=None if km is None else tuple(km[0]),
        keep_dtype=None if km is None else dtype_name(km[1]),
        temperature=temperature,
        ignore_index=ignore_index,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        inplace_grad=inplace_grad,
        ids_shape=None if im is None else tuple(im[0]),
        ids_dtype=None if im is None else dtype_name(im[1]),
        multi_target=multi_target,
        with_sum_p2=with_sum_p2,
        ids_with_extended=True,
        **tau_kw,
    )
    if taum is not None and taum[2] != lm[2]:
        raise ValueError(f"temperature: expected a tensor on the logits' device {lm[2]}, got device {taum[2]}")
    if tm[2] != lm[2]:
        raise ValueError(f"target: expected a tensor on the logits' device {lm[2]}, got device {tm[2]}")
    if km is not None and km[2] != lm[2]:
        raise ValueError(f"keep_mask: expected a tensor on the logits' device {lm[2]}, got device {km[2]}")
    if im is not None and im[2] != lm[2]:
        raise ValueError(f"keep_ids: expected a tensor on the logits' device {lm[2]}, got device {im[2]}")
    if inplace_grad:
        if lm[3] and lm[4]:
            raise ValueError(
                "inplace_grad: expected logits produced by an autograd graph (a non-leaf tensor); got a leaf "
                "tensor that requires grad, whose storage is the caller's own data and is never overwritten"
            )
        if not lm[5]:
            raise ValueError(
                f"inplace_grad: expected contiguous logits (the gradient is written into their storage), "
                f"got strides {tuple(lm[6])} for shape {tuple(lm[0])}"
            )
    return opt


def _engine_available(engine: str, device: torch.device) -> None:
    reason = selection.TRAITS[engine].unavailable(device)
    if reason is not None:
        raise ValueError(f"impl: {engine!r} {reason}")


@functools.lru_cache(maxsize=256, typed=True)
def _cached_logits_call(group, validate: bool, engine: str, lm: tuple, tm: tuple, km: Optional[tuple],
                        temperature, ignore_index, with_entropy, entropy_grad, inplace_grad,
                        label_smoothing, multi_target=False, with_sum_p2=False, taum=None,
                        im: Optional[tuple] = None) -> Call:
    """The logits op's :class:`Call` (every check but the agreement), a pure function of its arguments.

    Cached (``typed``: ``1`` and ``True`` are different keys); a call that
    fails raises here every time (a cache stores no failure).
    """
    rank, world = check_call(group, validate, engine)
    opt = logits_options(lm, tm, km, temperature, ignore_index, with_entropy, entropy_grad, inplace_grad,
                         multi_target, with_sum_p2, taum, im)
    if label_smoothing:
        opt = dataclasses.replace(opt, label_smoothing=float(label_smoothing))
    _engine_available(engine, lm[2])
    rows = 1
    for d in lm[0][:-1]:
        rows *= d
    record = None
    if validate and group is not None:
        record = tuple(validation.agreement_record(
            error=None, n_rows=rows, v_local=lm[0][-1], logits_dtype=dtype_name(lm[1]), options=opt
        ))
    call = Call(opt, engine, rank, world, rows, lm[0][-1], lm[1], lm[2].type, validate, record,
                validation.RECORD_FIELDS)
    return call._replace(plan=selection.TRAITS[engine].plan(call))


def logits_call(
    logits: object, target: object, keep_mask: object = None, *, group: object = None, temperature: object = 1.0,
    with_entropy: object = True, entropy_grad: object = True, ignore_index: object = -100, validate: object = True,
    inplace_grad: object = False, impl: object = None, label_smoothing: float = 0.0,
    caller_error: Optional[BaseException] = None, multi_target: object = False, with_sum_p2: object = False,
    keep_ids: object = None,
) -> Call:
    """The checked :class:`Call` of a logits-op call: every rank returns or every rank raises.

    ``multi_target``, ``with_sum_p2`` and a temperature tensor (``[...]``
    broadcastable to the rows; its values are checked here with
    ``validate=True``, one host sync, so a bad value raises on every rank
    through the agreement) select the extended op
    (:mod:`dualvp_torch.extended`); ``impl=None`` does not choose the Triton
    engine for it (``impl="triton"`` runs it).

    From the cache when the call's types allow; otherwise (an argument of
    another type, such as a 0-d tensor temperature, or a call that fails a
    check) the checks run in full and, with a group and ``validate=True``, a
    failure goes through the agreement all-gather. ``label_smoothing``
    (already checked) enters the options and so the agreement record;
    ``caller_error`` is a drop-in's own argument error, which then goes
    through the agreement step like a local check's error.
    """
    if (caller_error is None and type(logits) is torch.Tensor and type(target) is torch.Tensor
            and (keep_mask is None or type(keep_mask) is torch.Tensor)
            and (keep_ids is None or type(keep_ids) is torch.Tensor) and type(temperature) in (float, int)):
        # (meta and _meta3 written out: this runs on every call, up to three times)
        try:
            # an explicit engine is checked by the cached call (check_call); None and "compiled" (which falls
            # back to "eager" once compiling failed) are resolved at each call
            engine = (impl if impl in FIXED
                      else selection.select(impl, logits.device, triton_default=not (multi_target or with_sum_p2)))
            return _cached_logits_call(
                group, validate, engine,
                (logits.shape, logits.dtype, logits.device, logits.requires_grad, logits.is_leaf,
                 logits.is_contiguous(), logits.stride()),
                (target.shape, target.dtype, target.device),
                None if keep_mask is None else (keep_mask.shape, keep_mask.dtype, keep_mask.device),
                temperature, ignore_index, with_entropy, entropy_grad, inplace_grad, label_smoothing,
                multi_target, with_sum_p2, None,
                None if keep_ids is None else (keep_ids.shape, keep_ids.dtype, keep_ids.device),
            )
        except (TypeError, ValueError):  # (an unhashable argument too) the full checks below name it
            pass

    def local() -> Call:
        _check_tensors(
            ("logits", logits, "a torch.Tensor [..., V_local] of a floating dtype"),
            ("target", target, "an integer torch.Tensor [...]"),
            ("keep_mask", keep_mask, "None or a bool torch.Tensor [..., V_local]"),
            ("keep_ids", keep_ids, _IDS_WHAT),
        )
        taum = temperature_meta(temperature)
        opt = logits_options(meta(logits), _meta3(target), _meta3(keep_mask), temperature, ignore_index,
                             with_entropy, entropy_grad, inplace_grad, multi_target, with_sum_p2, taum,
                             _meta3(keep_ids))
        if taum is not None and validate is True:
            check_temperature_values(temperature)
        engine = selection.select(impl, logits.device, triton_default=not extended_options(opt))
        return _cached_logits_call(group, validate, engine, meta(logits), _meta3(target), _meta3(keep_mask),
                                   opt.temperature, opt.ignore_index, with_entropy, entropy_grad, inplace_grad,
                                   label_smoothing, multi_target, with_sum_p2, taum, _meta3(keep_ids))

    return _checked(local, group, validate, impl, caller_error, logits, fused=False)


def temperature_meta(temperature: object) -> Optional[tuple]:
    """``(shape, dtype, device)`` of a temperature *tensor* (one per row, ``ndim >= 1``), else ``None``.

    A 0-d tensor stays a number (as before: ``validation.check_temperature``).
    """
    if isinstance(temperature, torch.Tensor) and temperature.ndim > 0:
        return _meta3(temperature)
    return None


def check_temperature_values(temperature: torch.Tensor) -> None:
    """``ValueError`` naming ``temperature`` if an entry is not finite and > 0 (one host sync)."""
    t = temperature.detach()
    if not t.is_floating_point():
        return  # the dtype check names it
    bad = ~(torch.isfinite(t) & (t > 0))
    n_bad = int(bad.sum())
    validation.check_temperature_values(n_bad, float(t[bad].reshape(-1)[0]) if n_bad else None)


def extended_options(opt: validation.Options) -> str:
    """The options of ``opt`` that need the extended op, as text (``""``: none)."""
    names = [n for n, on in (("multi_target", opt.n_targets > 0), ("a temperature tensor", opt.row_temperature),
                             ("with_sum_p2", opt.with_sum_p2)) if on]
    return ", ".join(names)


def _checked(local: Callable[[], Call], group, validate, impl, caller_error, hint, *, fused: bool) -> Call:
    """``local()``, or its error raised on every rank of ``group`` (with ``validate=True``) alike."""
    rank, _ = check_call(group, validate, impl)
    error = caller_error
    call = None
    if error is None:
        try:
            call = local()
        except (TypeError, ValueError) as exc:
            error = exc
    if error is None:
        return call
    if validate:
        agreement.raise_on_every_rank(error, group, hint, fused=fused, rank=rank)
    raise error


def count_bad_targets(target: torch.Tensor, ignore_index: int, vocab_size: int) -> torch.Tensor:
    """0-d int64 device tensor: targets outside ``[0, vocab_size)`` that are not ``ignore_index``."""
    y = target.to(torch.int64)
    bad = (y != ignore_index) & ((y < 0) | (y >= vocab_size))
    return bad.sum(dtype=torch.int64)


def agree(call: Call, bad: Optional[torch.Tensor], group: object, hint: torch.Tensor, target: torch.Tensor,
          hidden: Optional[torch.Tensor] = None) -> None:
    """The ``validate=True`` step after the local checks: every rank raises the same error, or none does.

    ``bad`` is the 0-d device count of out-of-range targets (the engine's
    own, or :func:`count_bad_targets`). With a group it travels in the
    agreement all-gather (every rank enters it, whatever ``T``) with the
    fingerprints of ``target`` and, in the fused op without
    ``sequence_parallel``, of the replicated ``hidden``
    (:mod:`dualvp_torch.agreement`: a target that differs across the group, or
    the wrong group, raises on every rank); without a group it is read on the
    host: either way the one synchronisation of ``validate=True``. ``hint``: a
    tensor on the op's device.
    """
    if group is not None:
        fused = call.fields == validation.LINEAR_RECORD_FIELDS
        agreement.gather_checked(
            call.record, bad, group, collectives.comm_device(group, hint), target=target, fused=fused,
            hidden=hidden if fused and not call.opt.sequence_parallel else None, rank=call.rank,
            vocab_size=call.vocab, fields=call.fields,
        )
    elif call.rows:
        n_bad = int(bad)  # the one synchronisation of validate=True
        if n_bad:
            record = [0] * len(call.fields)
            record[-1] = n_bad
            validation.check_agreement([record], rank=0, vocab_size=call.vocab, fields=call.fields)


# --- the fused LM-head op ---------------------------------------------------------------


def _check_fused_options(hidden: torch.Tensor, engine: str, allow_tf32: object) -> None:
    if not isinstance(allow_tf32, bool):
        raise TypeError(f"allow_tf32: expected a bool, got {type(allow_tf32).__name__} {allow_tf32!r}")
    if not selection.TRAITS[engine].spec_stages:  # the fused Triton kernels
        if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"impl: {engine!r} takes float32, bfloat16 or float16 hidden states, got {hidden.dtype}")
        reason = linear_triton.unavailable(hidden.device)
        if reason is not None:
            raise ValueError(f"impl: {engine!r} {reason}")


def linear_call(
    hidden: object, weight: object, target: object, keep_mask: object, *, group: object, validate: object,
    impl: object, allow_tf32: object, kw: dict, keep_ids: object = None,
    requires_grad: Optional[tuple] = None,
) -> Call:
    """The checked :class:`Call` of a fused-op call (see :func:`logits_call`; not cached).

    ``kw``: the op's keyword arguments that :func:`validation.check_linear_args` takes;
    ``requires_grad``: ``(hidden's, weight's)`` for the agreement record (default: grad mode and theirs).
    """
    rank, world = check_call(group, validate, impl)

    def local() -> Call:
        target_keep = check_target_keep(
            ("hidden", hidden, "a torch.Tensor [..., H] of a floating dtype"),
            ("weight", weight, "a torch.Tensor [V_local, H] of hidden's dtype"),
            target=target,
            keep_mask=keep_mask,
            keep_ids=keep_ids,
        )
        opt = validation.check_linear_args(
            hidden_shape=tuple(hidden.shape),
            hidden_dtype=dtype_name(hidden.dtype),
            weight_shape=tuple(weight.shape),
            weight_dtype=dtype_name(weight.dtype),
            **target_keep,
            world_size=world,
            **kw,
        )
        for name, x in (("weight", weight), ("target", target), ("keep_mask", keep_mask), ("keep_ids", keep_ids)):
            if x is not None and x.device != hidden.device:
                raise ValueError(f"{name}: expected a tensor on hidden's device {hidden.device}, got device {x.device}")
        engine = selection.select(impl, hidden.device, triton_default=False)
        _check_fused_options(hidden, engine, allow_tf32)
        record = None
        if validate and group is not None:
            grad_on = torch.is_grad_enabled()
            hrg, wrg = requires_grad or (grad_on and hidden.requires_grad, grad_on and weight.requires_grad)
            record = tuple(validation.agreement_record(
                error=None,
                n_rows=target.numel(),
                v_local=weight.shape[0],
                logits_dtype=dtype_name(hidden.dtype),
                options=opt,
                fused=True,
                hidden_size=hidden.shape[-1],
                hidden_rows=hidden.numel() // max(1, hidden.shape[-1]),
                hidden_requires_grad=hrg,
                weight_requires_grad=wrg,
            ))
        return Call(opt, engine, rank, world, target.numel(), weight.shape[0], hidden.dtype, hidden.device.type,
                    validate, record, validation.LINEAR_RECORD_FIELDS)

    return _checked(local, group, validate, impl, None, hidden, fused=True)
