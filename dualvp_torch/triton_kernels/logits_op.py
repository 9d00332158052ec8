"""Host side of the logits op's Triton path: launch plans, launchers, the autograd Function.

Data flow of one call (``T`` rows, shard ``V_local``, ``W`` ranks)::

    forward:  W = 1, S = 1: logits_stats_kernel [T, V_local] -> logprob, entropy, res [5, T] (1 launch)
              else: logits_stats_kernel -> stats [S, T, 6] (S column splits, from V_local alone)
                    W > 1: all-gather stats -> [W, S, T, 6]
                    logits_merge_kernel [W S, T, 6] -> logprob, entropy, res [5, T] (1 launch)
              validate=True: a zeroed bad-target counter (its fill is a launch), read on the host
              (W = 1) or sent in the agreement all-gather (W > 1); validate=False: no counter
    backward: logits_grad_kernel [T, V_local] -> gradient, fresh or in the logits' storage (1 launch)

A :class:`Plan` holds everything that depends only on the call's metadata
(shapes, dtypes, options, block sizes, grids); ``function.py`` caches it per
metadata key, so a call runs O(1) Python: no target mapping in torch ops, no
temperature tensor, no copy of contiguous inputs. With ``validate=False``
nothing here synchronises with the device and no allocation depends on data
(capturable by CUDA graphs).
"""

from __future__ import annotations

import functools
import struct
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from dualvp import validation

from .. import collectives
from ..function import _check_call, _checked_options, _dtype_name, _meta, _validated
from . import available, interpreting
from .logits_grad import logits_grad_kernel
from .logits_merge import logits_merge_kernel
from .logits_stats import logits_stats_kernel

__all__ = ["Plan", "make_plan", "plan_of", "stats", "merge", "grad", "forward", "TritonLogProbEntropy",
           "checked_plan", "logprob_entropy", "stats_outputs"]

_TL = {torch.float32: tl.float32, torch.float64: tl.float64}


class Plan(NamedTuple):
    """The launch configuration of one call's metadata (see :func:`make_plan`)."""

    opt: validation.Options
    rank: int
    world: int
    T: int
    V: int
    vocab: int
    v_lo: int
    compute: torch.dtype  # float32, float64 for float64 input
    has_keep: bool
    need_entropy_grad: bool
    validate: bool
    record: Optional[tuple]  # agreement record (validate=True with a group), bad-target field 0
    stats_cfg: tuple  # (grid (T, S), BLOCK_V, num_warps)
    merge_cfg: tuple  # (grid, BLOCK_T, num_warps)
    grad_cfg: tuple  # (grid (T, column blocks), BLOCK_V, num_warps)
    splits: int  # S: column splits of a row in the forward, from V_local alone
    cols_per_split: int
    finalize: bool  # W = 1 and S = 1: the statistics kernel writes the outputs (no merge launch)
    compiled: bool  # compiled for the GPU (not the interpreter), float32 compute: PTX helpers, fused reductions
    scalars: tuple  # float32: (1/tau hi, lo; log2(e)/tau; (1/tau) / that, hi, lo), pairs hi + lo exact to ~1e-15


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]  # round to nearest float32


def _pair(x: float) -> tuple:
    # a float64 as two float32 (hi + lo, ~48 bits): kernels take float32 scalars (the interpreter rounds any float)
    hi = _f32(x)
    return hi, _f32(x - hi)


_LOG2E = 1.4426950408889634

#: the forward splits a row into column ranges of at most this many blocks (GPU): a row of 4-byte logits longer
#: than 65,536 columns (16-bit: 131,072) is walked by several programs, merged associatively. From V_local alone.
MAX_BLOCKS_PER_SPLIT = 16


def make_plan(opt: validation.Options, rank: int, world: int, T: int, V: int, dtype: torch.dtype, device_type: str,
              validate: bool, record: Optional[tuple]) -> Plan:
    """Block sizes, splits and grids; a pure function of its arguments, none chosen from ``T``.

    Under the interpreter (CPU tensors) small blocks keep a launch within a
    second or two at test sizes (and rows over 256 columns split, so that the
    tests cover the split axis). On a GPU: the forward walks a row in blocks
    of 4096 (4-byte, or 2-byte with a keep mask) or 8192 (2-byte) elements,
    16-byte vector loads by 8 warps, one program per row and column split (:data:`MAX_BLOCKS_PER_SPLIT`);
    the backward one row x 4096 columns per program (8 warps); the merge (only
    with W > 1 or S > 1) 256 rows per program. Heuristics to be measured by
    the bench (docs/decisions.md, "Triton launch sizes", "Logits kernels toward
    the floor").
    """
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    if device_type == "cpu":  # TRITON_INTERPRET=1
        st = (min(128, _pow2(V)), 1)
        per_split = 2
        gr = (min(256, _pow2(V)), 1)
        mg = (64, 1)  # (a constant: blocks never from T)
    else:
        # 16 (4-byte) or 32 (2-byte) elements per thread and iteration; 16 with a keep mask in 2-byte (32 take
        # 126 registers; 8192 over 16 warps spills 8 bytes)
        bv = 8192 if dtype.itemsize <= 2 and not opt.has_mask else 4096
        st = (min(bv, _pow2(V)), 8 if V >= 2048 else 4)
        per_split = MAX_BLOCKS_PER_SPLIT
        gr = (min(4096, _pow2(V)), 8 if V >= 2048 else 4)
        mg = (256, 4)
    n_blocks = triton.cdiv(V, st[0])
    per_split = triton.cdiv(n_blocks, triton.cdiv(n_blocks, per_split))  # balanced splits
    splits = max(1, triton.cdiv(n_blocks, per_split))
    cols_per_split = per_split * st[0]
    stats_cfg = ((T, splits), *st)
    grad_cfg = ((T, triton.cdiv(V, gr[0])), *gr)
    merge_cfg = ((triton.cdiv(T, mg[0]),), *mg)
    tau = float(opt.temperature)
    inv = 1.0 / tau
    l2e = _f32(_LOG2E / tau)
    scalars = (*_pair(inv), l2e, *_pair(inv / l2e))
    compiled = device_type != "cpu" and compute == torch.float32
    return Plan(opt, rank, world, T, V, world * V, rank * V, compute, opt.has_mask, opt.need_entropy_grad,
                validate, record, stats_cfg, merge_cfg, grad_cfg, splits, cols_per_split,
                world == 1 and splits == 1, compiled, scalars)


def _launch_stats(z, y, keep, plan: Plan, bad, out, logprob, entropy, res) -> None:
    grid, bv, nw = plan.stats_cfg
    k = z if keep is None else keep  # any pointer when HAS_KEEP is off
    logits_stats_kernel[grid](
        z, z.stride(0), y, k, k.stride(0), out, z if bad is None else bad, logprob, entropy, res,
        plan.T, plan.V, plan.v_lo, plan.vocab, plan.opt.ignore_index, plan.cols_per_split, *plan.scalars,
        HAS_KEEP=keep is not None, WITH_ENTROPY=plan.opt.with_entropy, HAS_COUNTER=bad is not None,
        FINALIZE=out is None, COMPILED=plan.compiled, COMPUTE=_TL[plan.compute], ACC=tl.float64, BLOCK_V=bv,
        KEEP_VEC=16 // z.element_size(), num_warps=nw,
    )


def stats(z: torch.Tensor, y: torch.Tensor, keep: Optional[torch.Tensor], plan: Plan) -> tuple:
    """``(stats [S, T, 6], bad)``: :mod:`.logits_stats` on ``z [T, V]`` (unit column stride), ``S`` column splits.

    ``bad``: the int32 ``[1]`` bad-target counter with ``plan.validate``, else
    ``None`` (no counter, no fill launched).
    """
    dev = z.device
    out = torch.empty((plan.splits, plan.T, 6), dtype=plan.compute, device=dev)
    bad = torch.zeros((1,), dtype=torch.int32, device=dev) if plan.validate else None
    if plan.T:  # (a grid of 0 programs is not launched)
        _launch_stats(z, y, keep, plan, bad, out, out, out, out)
    return out, bad


def stats_outputs(z: torch.Tensor, y: torch.Tensor, keep: Optional[torch.Tensor], plan: Plan,
                  shape: Optional[tuple] = None) -> tuple:
    """``(logprob, entropy, res [5, T], bad)`` in one launch (``plan.finalize``: W = 1, one split).

    ``logprob``, ``entropy``: ``[T]``, or ``shape`` (the target's: contiguous, no view to make).
    """
    dev = z.device
    shape = (plan.T,) if shape is None else shape
    logprob = torch.empty(shape, dtype=plan.compute, device=dev)
    entropy = torch.empty(shape, dtype=plan.compute, device=dev)
    res = torch.empty((5, plan.T), dtype=plan.compute, device=dev)
    bad = torch.zeros((1,), dtype=torch.int32, device=dev) if plan.validate else None
    if plan.T:
        _launch_stats(z, y, keep, plan, bad, None, logprob, entropy, res)
    return logprob, entropy, res, bad


def merge(all_stats: torch.Tensor, y: torch.Tensor, plan: Plan, shape: Optional[tuple] = None) -> tuple:
    """``(logprob, entropy, res [5, T])``: :mod:`.logits_merge` on ``[N, T, 6]`` partial statistics.

    ``logprob``, ``entropy``: ``[T]``, or ``shape`` (contiguous).
    """
    dev = all_stats.device
    shape = (plan.T,) if shape is None else shape
    logprob = torch.empty(shape, dtype=plan.compute, device=dev)
    entropy = torch.empty(shape, dtype=plan.compute, device=dev)
    res = torch.empty((5, plan.T), dtype=plan.compute, device=dev)
    grid, bt, nw = plan.merge_cfg
    if plan.T:
        logits_merge_kernel[grid](all_stats, y, logprob, entropy, res, plan.T, all_stats.shape[0],
                                  plan.opt.ignore_index, *plan.scalars[:2], BLOCK_T=bt, num_warps=nw)
    return logprob, entropy, res


def grad(z: torch.Tensor, y: torch.Tensor, keep: Optional[torch.Tensor], res: torch.Tensor, gl: torch.Tensor,
         ge: Optional[torch.Tensor], plan: Plan, out: Optional[torch.Tensor] = None,
         shape: Optional[tuple] = None) -> torch.Tensor:
    """The gradient of ``z [T, V]`` (:mod:`.logits_grad`) into ``out`` (``z`` itself for in place) or a fresh buffer.

    ``gl``, ``ge``: ``[T]`` upstream gradients of any float dtype and stride
    (an expanded ``[T]`` has stride 0); ``ge`` only with the entropy term.
    """
    if out is None:  # fresh: [T, V], or ``shape`` (the logits'), contiguous, rows of V
        g = torch.empty((plan.T, plan.V) if shape is None else shape, dtype=z.dtype, device=z.device)
        stride_g = plan.V
    else:
        g, stride_g = out, out.stride(0)
    grid, bv, nw = plan.grad_cfg
    k = z if keep is None else keep
    e = gl if ge is None else ge
    if plan.T:
        logits_grad_kernel[grid](
            z, z.stride(0), g, stride_g, y, k, k.stride(0), res, gl, gl.stride(0), e, e.stride(0),
            plan.T, plan.V, plan.v_lo, plan.opt.ignore_index, *plan.scalars[:3],
            HAS_KEEP=keep is not None, ENTROPY=ge is not None, COMPILED=plan.compiled, COMPUTE=_TL[plan.compute],
            BLOCK_V=bv, KEEP_VEC=16 // z.element_size(), num_warps=nw,
        )
    return g


def _rows(x: torch.Tensor, v: int) -> torch.Tensor:
    # [T, v] with unit column stride: a view when the layout allows (no copy of contiguous input)
    x = x.reshape(-1, v)
    return x if x.stride(1) == 1 or x.shape[1] == 1 else x.contiguous()


def forward(logits, target, keep_mask, plan: Plan, group) -> tuple:
    """``(logprob, entropy, res [5, T])`` of validated arguments; logprob and entropy in the target's shape.

    W = 1 with one column split (``plan.finalize``): one launch, the
    statistics kernel writes the outputs. Otherwise: stats ``[S, T, 6]``,
    (agreement,) all-gather (W > 1), merge. With ``plan.validate`` the
    out-of-range count of the stats kernel is read (W = 1: one ``.item()``)
    or travels in the agreement all-gather (W > 1, before the statistics'
    all-gather); every rank raises the same error.
    """
    z = _rows(logits, plan.V)
    y = target.reshape(-1)
    keep = None if keep_mask is None else _rows(keep_mask, plan.V).view(torch.uint8)
    if plan.finalize:
        logprob, entropy, res, bad = stats_outputs(z, y, keep, plan, target.shape)
    else:
        st, bad = stats(z, y, keep, plan)
    if plan.validate:
        _check_bad(bad, plan, group, z)
    if plan.finalize:
        return logprob, entropy, res
    # [W, S, T, 6] -> [W S, T, 6]: the merge is associative over ranks and splits alike
    all_stats = st if group is None else collectives.gather_stats(st, group).reshape(-1, plan.T, 6)
    return merge(all_stats, y, plan, target.shape)


def _check_bad(bad, plan: Plan, group, z) -> None:
    if group is not None:  # every rank enters it, whatever T
        table = collectives.gather_records(plan.record, bad, group, collectives.comm_device(group, z))
        validation.check_agreement(table, rank=plan.rank, vocab_size=plan.vocab)
    elif plan.T:
        n_bad = int(bad.item())  # the one synchronisation of validate=True
        if n_bad:
            record = [0] * len(validation.RECORD_FIELDS)
            record[-1] = n_bad
            validation.check_agreement([record], rank=0, vocab_size=plan.vocab)


_UNMATERIALISED = (
    "dualvp_torch.logprob_entropy: the gradient of the {} arrived as None in backward. The op never calls "
    "ctx.set_materialize_grads(False), so autograd should pass zeros for an output that does not reach the "
    "loss; a None here means a caller or wrapper disabled gradient materialisation. Computing the gradient "
    "without it would silently drop that term, so the op refuses."
)


class TritonLogProbEntropy(torch.autograd.Function):
    """``(logits, target, keep_mask, plan, group) -> (logprob, entropy)`` in the target's shape."""

    @staticmethod
    def forward(ctx, logits, target, keep_mask, plan: Plan, group):
        logprob, entropy, res = forward(logits, target, keep_mask, plan, group)
        ctx.plan = plan
        ctx.save_for_backward(logits, target, keep_mask, res)
        if not plan.need_entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        # grad mode is on only under create_graph=True: then once_differentiable's wrapper (a result that raises
        # if differentiated again); off (every ordinary backward), a direct call: the wrapper's no_grad and
        # checks cost ~25 us of host time per call
        if torch.is_grad_enabled():
            return _backward_once(ctx, grad_logprob, grad_entropy)
        return _backward(ctx, grad_logprob, grad_entropy)


def _backward(ctx, grad_logprob, grad_entropy):
    plan = ctx.plan
    if grad_logprob is None:
        raise RuntimeError(_UNMATERIALISED.format("log-prob"))
    if plan.need_entropy_grad and grad_entropy is None:
        raise RuntimeError(_UNMATERIALISED.format("entropy"))
    if not ctx.needs_input_grad[0]:
        return None, None, None, None, None
    logits, target, keep_mask, res = ctx.saved_tensors
    z = _rows(logits, plan.V)
    keep = None if keep_mask is None else _rows(keep_mask, plan.V).view(torch.uint8)
    ge = grad_entropy.reshape(-1) if plan.need_entropy_grad else None
    if plan.opt.inplace_grad:
        g = grad(z, target.reshape(-1), keep, res, grad_logprob.reshape(-1), ge, plan, out=z).view(logits.shape)
    else:  # fresh, in the logits' shape (no view to make)
        g = grad(z, target.reshape(-1), keep, res, grad_logprob.reshape(-1), ge, plan, shape=logits.shape)
    return g, None, None, None, None


_backward_once = once_differentiable(_backward)





@functools.lru_cache(maxsize=256, typed=True)
def plan_of(group, validate, impl, lm: tuple, tm: tuple, km: Optional[tuple], temperature, ignore_index,
            with_entropy, entropy_grad, inplace_grad) -> Plan:
    """The checks of a Triton call and its :class:`Plan`, a pure function of its arguments.

    ``lm``, ``tm``, ``km``: ``function._meta`` of logits, target and keep
    mask (the last two: its first three fields). Cached per call metadata
    (``typed``: ``1`` and ``True`` are different keys): a repeated call runs
    none of the checks again; a call that fails raises here every time (a
    cache stores no failure) with the messages of
    ``dualvp_torch.function._check_call`` and ``_local_checks``.
    """
    rank, world = _check_call(group, validate, impl)
    opt = _checked_options(lm, tm, km, temperature, ignore_index, with_entropy, entropy_grad, inplace_grad)
    if not available():
        raise ValueError("impl: 'triton' needs the triton package (pip install 'dualvp[triton]'), not installed")
    if lm[2].type == "cpu" and not interpreting():
        raise ValueError(
            "impl: 'triton' runs CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), got logits on the CPU"
        )
    n_rows = 1
    for d in lm[0][:-1]:
        n_rows *= d
    record = None
    if validate and group is not None:
        record = tuple(validation.agreement_record(
            error=None, n_rows=n_rows, v_local=lm[0][-1], logits_dtype=_dtype_name(lm[1]), options=opt
        ))
    return make_plan(opt, rank, world, n_rows, lm[0][-1], lm[1], lm[2].type, validate, record)


def checked_plan(logits, target, keep_mask, group, temperature, with_entropy, entropy_grad, ignore_index, validate,
                 inplace_grad, impl) -> Plan:
    """The :class:`Plan` of a call after its checks: from the cache (:func:`plan_of`) when it can.

    A call that misses the fast path (an argument of another type, such as a
    0-d tensor temperature, or one that fails a check) goes through
    ``function._validated`` (the checks and, with a group, the agreement
    step; they raise), then takes the plan of the validated options. Either
    way each rank enters the same collectives: with ``validate=True`` and a
    group one agreement all-gather, then one statistics all-gather.
    """
    if (type(logits) is torch.Tensor and type(target) is torch.Tensor
            and (keep_mask is None or type(keep_mask) is torch.Tensor) and type(temperature) in (float, int)):
        try:
            return plan_of(
                group, validate, impl,
                (logits.shape, logits.dtype, logits.device, logits.requires_grad, logits.is_leaf,
                 logits.is_contiguous(), logits.stride()),
                (target.shape, target.dtype, target.device),
                None if keep_mask is None else (keep_mask.shape, keep_mask.dtype, keep_mask.device),
                temperature, ignore_index, with_entropy, entropy_grad, inplace_grad,
            )
        except (TypeError, ValueError):
            pass
    opt = _validated(
        logits, target, group=group, keep_mask=keep_mask, temperature=temperature, with_entropy=with_entropy,
        entropy_grad=entropy_grad, ignore_index=ignore_index, validate=validate, inplace_grad=inplace_grad, impl=impl,
    )
    # valid, and agreed across the group: no second range check or agreement in the kernels' path
    return plan_of(group, False, impl, _meta(logits), _meta(target)[:3],
                   None if keep_mask is None else _meta(keep_mask)[:3], opt.temperature, opt.ignore_index,
                   opt.with_entropy, opt.entropy_grad, opt.inplace_grad)


def logprob_entropy(logits, target, group, keep_mask, temperature, with_entropy, entropy_grad, ignore_index,
                    validate, inplace_grad, impl):
    """:func:`dualvp_torch.logprob_entropy` on the Triton kernels: :func:`checked_plan`, one ``Function.apply``."""
    plan = checked_plan(logits, target, keep_mask, group, temperature, with_entropy, entropy_grad, ignore_index,
                        validate, inplace_grad, impl)
    logprob, entropy = TritonLogProbEntropy.apply(logits, target, keep_mask, plan, group)
    return logprob, (entropy if with_entropy else None)
