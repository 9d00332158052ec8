"""The vocab-parallel log-prob + entropy op: a ``torch.autograd.Function``.

Data flow of one call (``group`` with ``W`` ranks; ``T`` rows; shard ``V_local``)::

    validate=True:  local checks -> agreement all-gather ([W, 10] int64) -> 1 host sync
    forward:        kernels.shard_stats      [T, V_local] -> [T, 6]   (spec.block_stats, compiled)
                    collectives.gather_stats [T, 6] -> [W, T, 6]      (1 all-gather)
                    spec.reduce_stats, spec.finalize, spec.outputs    (O(T), identical on all ranks)
    backward:       kernels.shard_grad       [T, V_local] -> gradient (spec.block_grad, compiled; no collective)

The options of a call are the frozen :class:`dualvp.validation.Options` that
``validation.check_args`` returns; the same object makes the agreement record.

Memory (``B`` = bytes of the logits shard): the forward allocates only O(T)
tensors (plus bounded row-chunk scratch on the eager path); the op saves the
logits by reference, the target-derived ``[T]`` tensors, the keep mask (by
reference) and O(T) statistics; the backward allocates the gradient (input
dtype) and O(T) (or chunk) scratch. With ``inplace_grad=True`` the gradient
is written into the saved logits' storage instead, chunk by chunk.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import array_api_compat.torch as xp
import torch
from torch.autograd.function import once_differentiable

from dualvp import spec, validation

from . import collectives, kernels, tuning
from . import agreement as _agreement
from . import dtensor as _dtensor
from . import triton_kernels as _triton

__all__ = ["logprob_entropy"]

#: What ``impl`` may name: the shard-local stages of :mod:`dualvp_torch.kernels`, or ``"triton"``, the
#: hand-written kernels of :mod:`dualvp_torch.triton_kernels` (``impl=None`` takes them on the device
#: types of ``tuning.Tuning.triton_default_devices`` when the ``triton`` package is installed).
IMPLEMENTATIONS = kernels.IMPLEMENTATIONS + ("triton",)


def _triton_by_default(logits) -> bool:
    """Whether ``impl=None`` takes the Triton kernels for these logits (``Tuning.triton_default_devices``)."""
    return (isinstance(logits, torch.Tensor) and logits.device.type in tuning.current().triton_default_devices
            and _triton.available())


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _kind(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of dtype {_dtype_name(x.dtype)} and shape {tuple(x.shape)}"
    return f"{type(x).__name__} {x!r}"[:200]


def _check_tensors(*expected) -> None:
    """``TypeError`` naming the first ``(name, x, what)`` whose ``x`` is not a tensor.

    ``None`` passes for keep_mask.
    """
    for name, x, what in expected:
        if not isinstance(x, torch.Tensor) and not (name == "keep_mask" and x is None):
            raise TypeError(f"{name}: expected {what}, got {_kind(x)}")


def _check_target_keep(
    *leading: tuple[str, object, str], target: torch.Tensor, keep_mask: Optional[torch.Tensor]
) -> dict:
    """Type checks of an op's tensors, then the target/keep-mask keywords of ``validation.check_*args``.

    ``leading`` are the op's own ``(name, x, what)`` entries (logits, or hidden
    and weight), checked before ``target [...]`` and ``keep_mask [...,
    V_local]`` so that the first wrong argument in signature order is named.
    Returns ``target_shape``, ``target_dtype``, ``keep_shape`` and
    ``keep_dtype`` (both ``None`` without a mask).
    """
    _check_tensors(
        *leading,
        ("target", target, "an integer torch.Tensor [...]"),
        ("keep_mask", keep_mask, "None or a bool torch.Tensor [..., V_local]"),
    )
    return dict(
        target_shape=tuple(target.shape),
        target_dtype=_dtype_name(target.dtype),
        keep_shape=None if keep_mask is None else tuple(keep_mask.shape),
        keep_dtype=None if keep_mask is None else _dtype_name(keep_mask.dtype),
    )


def _check_call(group, validate, impl: Optional[str]) -> tuple[int, int]:
    """The checks every rank passes or fails alike, before any local check; returns ``(rank, world)`` of ``group``."""
    if group is not None and not collectives.is_process_group(group):
        raise TypeError(f"group: expected a torch.distributed.ProcessGroup or None, got {_kind(group)}")
    if not isinstance(validate, bool):
        raise TypeError(f"validate: expected a bool, got {type(validate).__name__} {validate!r}")
    if impl != "triton":
        try:
            kernels.select(impl)  # raises ValueError naming impl (the same on every rank)
        except ValueError:
            raise ValueError(f"impl: expected None or one of {IMPLEMENTATIONS}, got {impl!r}") from None
    return collectives.group_rank_world(group)


def _check_materialised(
    message: str, opt: validation.Options, grad_logprob: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor]
) -> None:
    """``RuntimeError`` (``message`` formatted with the output's name) when a needed upstream gradient is ``None``.

    ``grad_logprob`` and ``grad_entropy`` are the ``[T]``-shaped (any leading
    shape) gradients autograd passes to the backward.
    """
    if grad_logprob is None:
        raise RuntimeError(message.format("log-prob"))
    if opt.need_entropy_grad and grad_entropy is None:
        raise RuntimeError(message.format("entropy"))


def _local_checks(logits, target, keep_mask, temperature, ignore_index, with_entropy, entropy_grad, inplace_grad):
    """Every local (rank-private, host-only) check; returns the :class:`~dualvp.validation.Options`."""
    _check_target_keep(
        ("logits", logits, "a torch.Tensor [..., V_local] of a floating dtype"), target=target, keep_mask=keep_mask
    )
    return _checked_options(
        _meta(logits), _meta(target), _meta(keep_mask), temperature, ignore_index, with_entropy, entropy_grad,
        inplace_grad,
    )


def _meta(x: Optional[torch.Tensor]) -> Optional[tuple]:
    """What the local checks read of a tensor: ``(shape, dtype, device, requires_grad, is_leaf, contiguous,
    stride)``."""
    if x is None:
        return None
    return (x.shape, x.dtype, x.device, x.requires_grad, x.is_leaf, x.is_contiguous(), x.stride())


def _checked_options(lm: tuple, tm: tuple, km: Optional[tuple], temperature, ignore_index, with_entropy,
                     entropy_grad, inplace_grad) -> validation.Options:
    """The local checks after the type checks, a pure function of the tensors' :func:`_meta` and the options."""
    opt = validation.check_args(
        logits_shape=tuple(lm[0]),
        logits_dtype=_dtype_name(lm[1]),
        target_shape=tuple(tm[0]),
        target_dtype=_dtype_name(tm[1]),
        keep_shape=None if km is None else tuple(km[0]),
        keep_dtype=None if km is None else _dtype_name(km[1]),
        temperature=temperature,
        ignore_index=ignore_index,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        inplace_grad=inplace_grad,
    )
    if tm[2] != lm[2]:
        raise ValueError(f"target: expected a tensor on the logits' device {lm[2]}, got device {tm[2]}")
    if km is not None and km[2] != lm[2]:
        raise ValueError(f"keep_mask: expected a tensor on the logits' device {lm[2]}, got device {km[2]}")
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


def _target_to_local(y, rank, v_local, ignore_index):
    y = y.to(torch.int64)
    return spec.target_to_local(xp, y, rank, v_local, ignore_index)


def _merge(
    stats: torch.Tensor, group, valid: torch.Tensor, tau: torch.Tensor, shape: tuple, impl: Optional[str] = None
) -> tuple[spec.Combined, torch.Tensor, torch.Tensor]:
    """This rank's ``[T, 6]`` statistics merged with the group's: ``(comb, logprob, entropy)``.

    One all-gather (``[W, T, 6]``; none without a group), then the spec's
    merge and outputs, identical on every rank; ``valid`` is ``[T]``, ``tau``
    0-d, and the outputs come back in ``shape`` (the target's).
    """
    all_stats = collectives.gather_stats(stats, group) if group is not None else stats[None]
    comb, logprob, entropy = kernels.merge(all_stats, valid, tau, impl=impl)
    return comb, logprob.reshape(shape), entropy.reshape(shape)


def _save_residuals(
    ctx,
    opt: validation.Options,
    inputs: tuple,
    local: torch.Tensor,
    owns: torch.Tensor,
    valid: torch.Tensor,
    comb: spec.Combined,
    entropy: torch.Tensor,
) -> None:
    """Save ``inputs`` (by reference) and the O(T) residuals; the entropy is non-differentiable unless needed.

    ``local``, ``owns``, ``valid`` and the fields of ``comb`` are ``[T]``;
    ``comb.c`` is saved only for the entropy gradient (``None`` otherwise).
    The backward unpacks ``ctx.saved_tensors`` as ``*inputs, local, owns,
    valid, M, log_s, c, mk, log_sk``.
    """
    c = comb.c if opt.need_entropy_grad else None
    ctx.save_for_backward(*inputs, local, owns, valid, comb.M, comb.log_s, c, comb.mk, comb.log_sk)
    if not opt.need_entropy_grad:
        ctx.mark_non_differentiable(entropy)


_UNMATERIALISED = (
    "dualvp_torch.logprob_entropy: the gradient of the {} arrived as None in backward. The op never calls "
    "ctx.set_materialize_grads(False), so autograd should pass zeros for an output that does not reach the "
    "loss; a None here means a caller or wrapper disabled gradient materialisation. Computing the gradient "
    "without it would silently drop that term, so the op refuses."
)


class LogProbEntropyFunction(torch.autograd.Function):
    """``(logits, target, keep_mask, options, group, impl) -> (logprob, entropy)``; see :func:`logprob_entropy`."""

    @staticmethod
    def forward(ctx, logits, target, keep_mask, opt: validation.Options, group=None, impl=None):
        logprob, entropy, local, owns, valid, comb = _forward(logits, target, keep_mask, opt, group, impl)
        ctx.opt = opt
        ctx.impl = impl
        _save_residuals(ctx, opt, (logits, keep_mask), local, owns, valid, comb, entropy)
        return logprob, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprob, grad_entropy):
        opt = ctx.opt
        _check_materialised(_UNMATERIALISED, opt, grad_logprob, grad_entropy)
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        logits, keep_mask, *residuals = ctx.saved_tensors
        g = _grad(logits, keep_mask, *residuals, grad_logprob, grad_entropy, opt, ctx.impl)
        return g, None, None, None, None, None


def _forward(logits, target, keep_mask, opt: validation.Options, group, impl):
    """The op's forward on validated arguments, outside autograd.

    Returns ``(logprob, entropy, local, owns, valid, comb)``: the outputs in
    the target's shape, and what :func:`_grad` needs besides the inputs
    (``[T]`` tensors and the :class:`~dualvp.spec.Combined` statistics).
    """
    v = logits.shape[-1]
    z = logits.reshape(-1, v)
    keep = None if keep_mask is None else keep_mask.reshape(-1, v)
    cdt = kernels.compute_dtype(logits.dtype)
    rank, _ = collectives.group_rank_world(group)
    valid, owns, local = _target_to_local(target.reshape(-1), rank, v, opt.ignore_index)
    tau_t = torch.full((), opt.temperature, dtype=cdt, device=z.device)
    stats = kernels.shard_stats(
        z, local, owns, keep, tau_t, with_entropy=opt.with_entropy, impl=impl, temperature=opt.temperature
    )
    comb, logprob, entropy = _merge(stats, group, valid, tau_t, tuple(target.shape), impl)
    return logprob, entropy, local, owns, valid, comb


def _grad(logits, keep_mask, local, owns, valid, M, log_s, c, mk, log_sk, grad_logprob, grad_entropy,
          opt: validation.Options, impl):
    """The op's gradient w.r.t. the logits (their shape), from :func:`_forward`'s residuals; no collective.

    ``c`` and ``grad_entropy`` are used only when ``opt.need_entropy_grad``.
    """
    v = logits.shape[-1]
    z = logits.reshape(-1, v)
    keep = None if keep_mask is None else keep_mask.reshape(-1, v)
    cdt = kernels.compute_dtype(logits.dtype)
    # Contiguous O(T) vectors: upstream gradients often arrive expanded
    # (stride 0), and a stride change would recompile the kernel.
    gl = grad_logprob.reshape(-1).to(cdt).contiguous()
    ge = grad_entropy.reshape(-1).to(cdt).contiguous() if opt.need_entropy_grad else None
    tau_t = torch.full((), opt.temperature, dtype=cdt, device=z.device)
    g = kernels.shard_grad(
        z, local, owns, keep, M, log_s, c, mk, log_sk, valid, gl, ge, tau_t, inplace=opt.inplace_grad, impl=impl,
        temperature=opt.temperature,
    )
    return g.view(logits.shape)


#: Ops that a caller's ``torch.compile`` can hold in its graph instead of
#: breaking it (``fullgraph=True``): the undecorated function -> ``(eligible,
#: traced)``, two functions of the op's arguments; registered by
#: :mod:`dualvp_torch.library`.
_IN_GRAPH: dict = {}


def _one_graph_break(fn):
    """``fn``, run as one graph break when a caller's ``torch.compile`` traces it.

    Under dynamo the call goes through ``torch.compiler.disable(fn)``: the op
    runs as it runs eagerly (its own compiled kernels included, bit for bit).
    Traced into, the logits op split the caller into 8 graphs around its
    validation and thread pool. The disabled wrapper is made at trace time,
    not here: ``torch.compiler.disable`` imports ``torch._dynamo`` (a second),
    which an eager-only process never pays. An op in :data:`_IN_GRAPH` whose
    call is eligible runs as custom ops in the caller's graph instead.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():
            in_graph = _IN_GRAPH.get(fn)
            if in_graph is not None and in_graph[0](*args, **kwargs):
                return in_graph[1](*args, **kwargs)
            return torch.compiler.disable(fn)(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper


@_one_graph_break
def logprob_entropy(
    logits,
    target,
    *,
    group=None,
    keep_mask=None,
    temperature=1.0,
    with_entropy=True,
    entropy_grad=True,
    ignore_index=-100,
    validate=True,
    inplace_grad=False,
    impl=None,
):
    """Log-prob of the target and entropy from vocab-sharded logits.

    Args:
      logits: ``[..., V_local]`` this rank's contiguous vocab shard (float32,
        bfloat16, float16 or float64). Rank ``r`` of a ``W``-rank ``group``
        owns the global columns ``[r*V_local, (r+1)*V_local)``.
      target: ``[...]`` integer *global* token ids (same leading shape).
      group: a ``torch.distributed.ProcessGroup`` that shards the vocabulary,
        or ``None`` (unsharded: no collectives at all).
      keep_mask: ``[..., V_local]`` bool, the tokens the sampler kept (top-p /
        top-k replay). The log-prob is under the distribution renormalised over
        ``keep_mask`` plus the target (always kept); the entropy is unmasked.
      temperature: ``tau > 0``; the op uses ``softmax(logits / tau)`` without
        an extra buffer.
      with_entropy: ``False`` returns ``None`` for the entropy (it costs
        nothing extra either way: the statistics are shared).
      entropy_grad: ``False`` returns the entropy with ``requires_grad=False``
        and keeps nothing alive for its gradient.
      ignore_index: rows whose target equals it get log-prob 0 and no
        log-prob gradient.
      validate: ``True`` checks the arguments, the target range and (with a
        group) that all ranks agree on options and shapes, through one small
        all-gather and one host sync; every rank then raises the same error.
        ``False`` skips the range check and the agreement collective (no sync);
        all ranks must then agree on ``validate`` itself and on every option
        and shape, and out-of-range targets give unspecified results.
        Local argument checks (types, shapes, dtypes) always run; they are
        host-only.
      inplace_grad: ``True`` writes the gradient into the logits' own storage
        in backward (O(T) extra memory instead of ``B``). The logits must be a
        contiguous non-leaf tensor; after backward they hold the gradient.
        If another autograd node saved the same logits, its backward fails
        with torch's "modified by an inplace operation" error instead of
        using overwritten values; modifying the logits between forward and
        backward fails the same way.
      impl: ``None`` (the default: ``"triton"`` on the device types of
        ``tuning.Tuning.triton_default_devices`` (none by default) when the
        ``triton`` package is installed, else ``DUALVP_COMPILE`` selects),
        or one of :data:`IMPLEMENTATIONS`: ``"compiled"``, ``"eager"`` (how
        the shard-local stages of :mod:`dualvp_torch.kernels` run) or
        ``"triton"`` (the hand-written kernels of
        :mod:`dualvp_torch.triton_kernels`: CUDA tensors, or CPU tensors
        under ``TRITON_INTERPRET=1``).

    Returns:
      ``(logprob [...], entropy [...] or None)``, float32 (float64 for
      float64 input).

    Raises:
      TypeError / ValueError naming the argument for invalid input (with a
      group and ``validate=True``, on every rank, or ``RuntimeError`` on every
      rank when the ranks disagree).
    """
    if not (type(logits) is torch.Tensor and type(target) is torch.Tensor
            and (keep_mask is None or type(keep_mask) is torch.Tensor)) and _dtensor.involves_dtensor(
                logits, target, keep_mask):  # torch tensor parallelism: see dtensor.py
        return _dtensor.logprob_entropy(
            logits, target, group=group, keep_mask=keep_mask, temperature=temperature, with_entropy=with_entropy,
            entropy_grad=entropy_grad, ignore_index=ignore_index, validate=validate, inplace_grad=inplace_grad,
            impl=impl,
        )
    return _logprob_entropy(
        logits, target, group=group, keep_mask=keep_mask, temperature=temperature, with_entropy=with_entropy,
        entropy_grad=entropy_grad, ignore_index=ignore_index, validate=validate, inplace_grad=inplace_grad, impl=impl,
    )


def _logprob_entropy(
    logits, target, *, group, keep_mask, temperature, with_entropy, entropy_grad, ignore_index, validate,
    inplace_grad, impl, label_smoothing: float = 0.0, caller_error: Optional[BaseException] = None,
):
    """:func:`logprob_entropy` on plain tensors, for the drop-ins of :mod:`dualvp_torch.compat` too.

    ``label_smoothing`` (already checked) enters the options and so the
    cross-rank agreement record; ``caller_error`` is a drop-in's own argument
    error (``TypeError``/``ValueError`` naming the argument), which then goes
    through the agreement step like a local check's error: every rank raises,
    none waits in a collective.
    """
    if caller_error is None and not label_smoothing and (
        impl == "triton" or impl is None and _triton_by_default(logits)
    ):
        from .triton_kernels.logits_op import logprob_entropy as _triton_logprob_entropy

        return _triton_logprob_entropy(
            logits, target, group, keep_mask, temperature, with_entropy, entropy_grad, ignore_index, validate,
            inplace_grad, "triton",
        )
    opt = _validated(
        logits, target, group=group, keep_mask=keep_mask, temperature=temperature, with_entropy=with_entropy,
        entropy_grad=entropy_grad, ignore_index=ignore_index, validate=validate, inplace_grad=inplace_grad,
        impl=impl, label_smoothing=label_smoothing, caller_error=caller_error,
    )
    logprob, entropy = LogProbEntropyFunction.apply(logits, target, keep_mask, opt, group, impl)
    return logprob, (entropy if with_entropy else None)


def _validated(
    logits, target, *, group, keep_mask, temperature, with_entropy, entropy_grad, ignore_index, validate,
    inplace_grad, impl, label_smoothing: float = 0.0, caller_error: Optional[BaseException] = None,
) -> validation.Options:
    """The checks of :func:`_logprob_entropy` (local, then the agreement across ``group``); the options.

    Every rank returns or every rank raises (see :func:`_logprob_entropy`).
    """
    rank, world = _check_call(group, validate, impl)

    error = caller_error
    opt = None
    if error is None:
        try:
            opt = _local_checks(
                logits, target, keep_mask, temperature, ignore_index, with_entropy, entropy_grad, inplace_grad
            )
            if label_smoothing:
                opt = dataclasses.replace(opt, label_smoothing=float(label_smoothing))
        except (TypeError, ValueError) as exc:
            error = exc

    if validate and group is not None:
        if error is None:
            record = validation.agreement_record(
                error=None,
                n_rows=target.numel(),
                v_local=logits.shape[-1],
                logits_dtype=_dtype_name(logits.dtype),
                options=opt,
            )
            bad = _count_bad_targets(target, ignore_index, world * logits.shape[-1])
            device = collectives.comm_device(group, logits)
        else:
            record = validation.agreement_record(error=error)
            bad = None
            device = collectives.comm_device(group, logits if isinstance(logits, torch.Tensor) else None)
        _agreement.gather_checked(record, bad, group, device, target=target, rank=rank, local_error=error,
                                  vocab_size=None if error else world * logits.shape[-1])  # + target fingerprint
    else:
        if error is not None:
            raise error
        if validate and target.numel():
            record = [0] * len(validation.RECORD_FIELDS)
            record[-1] = int(_count_bad_targets(target, ignore_index, world * logits.shape[-1]))  # the one sync
            validation.check_agreement([record], rank=0, vocab_size=world * logits.shape[-1])
    return opt


def _count_bad_targets(target, ignore_index, vocab_size) -> torch.Tensor:
    """0-d int64 device tensor: targets outside ``[0, vocab_size)`` that are not ``ignore_index``."""
    y = target.to(torch.int64)
    bad = (y != ignore_index) & ((y < 0) | (y >= vocab_size))
    return bad.sum(dtype=torch.int64)
