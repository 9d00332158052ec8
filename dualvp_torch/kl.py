"""Exact full-vocabulary KL divergence of two vocab-sharded logits (:func:`kl_divergence`).

Per row (token position), ``KL(softmax(logits / tau) || softmax(ref_logits / tau))``
over the *whole* vocabulary (``direction="reverse"``: ``KL(q || p)``), from this
rank's shards ``[..., V_local]`` of the policy's and the reference's logits
(same sharding), with gradients to ``logits`` and, when it requires one, to
``ref_logits``. The math is :mod:`dualvp.kl_spec`; this module runs it:

Three engines run the stages (``impl``): ``"compiled"`` (the default), the
spec functions under ``torch.compile`` over the whole shard (one fused pass
per stage, row sums in float64 on CPU and CUDA); ``"eager"``, the same
functions op by op over bounded row chunks; ``"triton"``, the kernels of
:mod:`dualvp_torch.triton_kernels.kl` (opt-in).

Forward: :func:`dualvp.kl_spec.block_stats` of the shard (eager: of bounded
row chunks; ``[n, 5]`` statistics, O(T)), one all-gather of them over ``group``
(``[W, n, 5]``), :func:`~dualvp.kl_spec.combine_stats` on every rank (so every
rank holds bit-identical results). That all-gather is the forward's only
collective; ``validate=True`` with a group adds the agreement all-gather
before it (the options, shapes, dtypes and a fingerprint of ``row_mask``, one
host sync), as :func:`dualvp_torch.logprob_entropy` does. The backward has no
collective.

Backward: :func:`~dualvp.kl_spec.block_grad` over the shard (eager: the same row chunks), written
into one gradient buffer per input that needs a gradient (in that input's
dtype). Between forward and backward the op holds references to its inputs
and ``[5, n]`` statistics. Eager chunks are ``max(1, CHUNK_ELEMENTS // V_local)``
rows, chosen from ``V_local`` alone; compiled kernels reduce each row in one
order whatever ``T`` (a one-row shard runs as two rows); the Triton kernels run
one program per row, blocks from ``V_local`` alone: a row's results never
depend on the other rows or ``T``. Extra memory: the gradient buffers (1 B per input that needs a
gradient, B = that input's shard bytes) plus a few float32 chunk temporaries
(``CHUNK_ELEMENTS * 4`` bytes each) and O(T).

The op is a pair of ``torch.library`` custom ops (``dualvp::kl_divergence_fwd``
and ``dualvp::kl_divergence_bwd``) with ``register_autograd``: the same code
eagerly and as one opaque node under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import numbers
import struct
import threading
import types
import warnings
from typing import Callable, Optional

import array_api_compat.torch as xp
import torch
from torch import Tensor

from dualvp import kl_spec
from dualvp.validation import check_temperature

from . import agreement, collectives, engines
from . import compiled as _compiled_path

__all__ = ["kl_divergence", "CHUNK_ELEMENTS", "RECORD_FIELDS", "IMPLS"]

#: The engines of the KL op (``impl``; ``None``: :func:`dualvp_torch.engines.select`, never Triton).
IMPLS = ("compiled", "eager", "triton")

#: Elements of one row chunk (rows = ``max(1, CHUNK_ELEMENTS // V_local)``): a float32 temporary of
#: the chunk is 1 MiB, small next to any shard worth sharding, large enough that the Python loop is
#: a few hundred iterations at T = 4096, V_local = 32000.
CHUNK_ELEMENTS = 1 << 18

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: Argument names; a local failure is recorded as 1 + its index in the agreement record.
ARGUMENTS = ("logits", "ref_logits", "row_mask", "temperature", "direction", "group", "validate", "impl")
#: Fields of the ``validate=True`` agreement record (then the two fingerprint fields of ``row_mask``).
RECORD_FIELDS = ("error", "rows", "V_local", "logits dtype", "ref_logits dtype", "row_mask present", "direction",
                 "temperature")


# --- checks ------------------------------------------------------------------------------


def _engine(impl, device) -> str:
    """The engine a call runs (one of :data:`IMPLS`); ``ValueError`` naming ``impl`` (unknown, Triton unavailable)."""
    name = engines.select(impl, device, triton_default=False)
    if name not in IMPLS:  # pragma: no cover - every engine of the registry runs the KL op
        raise NotImplementedError(f"impl: {name!r} has no kl_divergence kernel; expected None or one of {IMPLS}")
    if name == "triton":
        why = engines.ENGINES["triton"].unavailable(device)
        if why:
            raise ValueError(f"impl: 'triton' {why}")
    return name


def _check_local(logits, ref_logits, row_mask, temperature, direction, group, validate, impl=None) -> None:
    """Every check that needs no other rank; raises ``TypeError`` / ``ValueError`` naming the argument."""
    if not isinstance(logits, Tensor):
        raise TypeError(f"logits: expected a torch.Tensor [..., V_local], got {type(logits).__name__}")
    if logits.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"logits: expected float32, bfloat16, float16 or float64, got {logits.dtype}")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits: expected shape [..., V_local] with V_local >= 1, got {tuple(logits.shape)}")
    if not isinstance(ref_logits, Tensor):
        raise TypeError(f"ref_logits: expected a torch.Tensor shaped like logits, got {type(ref_logits).__name__}")
    if ref_logits.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"ref_logits: expected float32, bfloat16, float16 or float64, got {ref_logits.dtype}")
    if ref_logits.shape != logits.shape:
        raise ValueError(f"ref_logits: expected the shape of logits {tuple(logits.shape)}, "
                         f"got {tuple(ref_logits.shape)} (both are this rank's shard, same sharding)")
    if ref_logits.device != logits.device:
        raise ValueError(f"ref_logits: expected the device of logits ({logits.device}), got {ref_logits.device}")
    if row_mask is not None:
        if not isinstance(row_mask, Tensor) or row_mask.dtype != torch.bool:
            kind = type(row_mask).__name__ if not isinstance(row_mask, Tensor) else f"a {row_mask.dtype} tensor"
            raise TypeError(f"row_mask: expected None or a bool torch.Tensor [...], got {kind}")
        if row_mask.shape != logits.shape[:-1]:
            raise ValueError(f"row_mask: expected the leading shape of logits {tuple(logits.shape[:-1])}, "
                             f"got {tuple(row_mask.shape)}")
        if row_mask.device != logits.device:
            raise ValueError(f"row_mask: expected the device of logits ({logits.device}), got {row_mask.device}")
    if isinstance(temperature, (bool, Tensor)) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature: expected a finite float > 0 (a Python number), "
                        f"got {type(temperature).__name__} {temperature!r}"[:300])
    check_temperature(temperature)
    if not isinstance(direction, str) or direction not in kl_spec.DIRECTIONS:
        raise ValueError(f"direction: expected one of {kl_spec.DIRECTIONS}, got {direction!r}")
    if group is not None and not collectives.is_process_group(group):
        raise TypeError(f"group: expected None or a torch.distributed.ProcessGroup, got {type(group).__name__}")
    if not isinstance(validate, bool):
        raise TypeError(f"validate: expected a bool, got {type(validate).__name__}")
    _engine(impl, logits.device)


def _error_code(exc: Optional[BaseException]) -> int:
    if exc is None:
        return 0
    for i, name in enumerate(ARGUMENTS):
        if str(exc).startswith(name + ":"):
            return i + 1
    return len(ARGUMENTS) + 1


def _record(logits, ref_logits, row_mask, temperature, direction, error) -> list:
    if error is not None:
        return [_error_code(error)] + [-1] * (len(RECORD_FIELDS) - 1)
    return [0, logits.numel() // logits.shape[-1], logits.shape[-1], _FLOAT_DTYPES.index(logits.dtype),
            _FLOAT_DTYPES.index(ref_logits.dtype), int(row_mask is not None), kl_spec.DIRECTIONS.index(direction),
            struct.unpack("<q", struct.pack("<d", float(temperature)))[0]]


def _agree(logits, ref_logits, row_mask, temperature, direction, group, error) -> None:
    """The agreement step: one all-gather of record + ``row_mask`` fingerprint, one host sync; same raise everywhere."""
    hint = logits if isinstance(logits, Tensor) else None
    device = collectives.comm_device(group, hint)
    rec = torch.tensor(_record(logits, ref_logits, row_mask, temperature, direction, error), dtype=torch.int64)
    mask = row_mask if error is None and row_mask is not None else None
    prints = agreement.fingerprint(mask, device=device)
    table = collectives.all_gather_rows(torch.cat([rec.to(device), prints]), group).tolist()  # the one host sync
    n = len(RECORD_FIELDS)
    codes = [r[0] for r in table]
    if any(codes):
        if error is not None and len(set(codes)) == 1:
            raise error
        failed = ", ".join(f"rank {i} ({ARGUMENTS[c - 1] if c <= len(ARGUMENTS) else '?'})"
                           for i, c in enumerate(codes) if c)
        raise RuntimeError(f"dualvp.kl_divergence: argument validation failed on {failed} while other ranks passed "
                           "or failed differently; every rank of the group raises this error") from error
    for j, field in enumerate(RECORD_FIELDS[1:], start=1):
        values = [r[j] for r in table]
        if len(set(values)) > 1:
            raise RuntimeError(f"dualvp.kl_divergence: ranks of the group disagree on {field} "
                               f"({', '.join(f'rank {i}: {v}' for i, v in enumerate(values))}); every rank raises")
    if len({tuple(r[n:]) for r in table}) > 1:
        raise ValueError("row_mask: differs across the process group's ranks; it selects the same rows on every "
                         "vocab shard (is `group` the tensor-parallel group?). Every rank of the group raises this "
                         "error.")


def _validated(logits, ref_logits, row_mask, temperature, direction, group, validate, impl=None) -> None:
    """Local checks, then (``validate=True`` with a group of W > 1) the agreement step; raises alike on every rank."""
    error = None
    try:
        _check_local(logits, ref_logits, row_mask, temperature, direction, group, validate, impl)
    except (TypeError, ValueError, NotImplementedError) as exc:
        error = exc
    if group is not None and collectives.is_process_group(group) and validate is not False \
            and collectives.group_rank_world(group)[1] > 1:
        _agree(logits, ref_logits, row_mask, temperature, direction, group, error)
    if error is not None:
        raise error


# --- the compiled engine: torch.compile of the spec stages, whole shard --------------------------
#
# Each stage is kl_spec itself over xp; torch.compile(dynamic=True, fullgraph=True) fuses it into one
# pass per output (no [T, V_local] intermediate: the memory test holds it), one graph per variant for
# every T and V_local, the temperature a 0-d tensor input (a new one does not recompile). Inductor's
# CPU kernels run rows in parallel and each row's reduction sequentially, so a row's bits do not depend
# on T; a one-row shard runs as two rows (dynamo specialises a size of 1 into a graph of its own, as in
# dualvp_torch.compiled._run_one_row). The row sums accumulate in float64 where the log-prob op's do
# (engines.accumulation_dtype). Compiling that fails falls back to the eager engine, with the log-prob
# op's warning and flag (dualvp_torch.compiled.failed()).


def _stats_stage(a, b, tau, cdt, acc):
    """``kl_spec.block_stats`` of the whole shard ``[n, 5]``."""
    return kl_spec.block_stats(xp, a, b, tau, dtype=cdt, acc_dtype=acc)


def _grad_stage(a, b, ma, log_sa, mb, log_sb, kl, g, tau, mask, cdt, want_a: bool, want_b: bool):
    """``kl_spec.block_grad`` of the whole shard, each gradient in its operand's dtype (``None`` if not wanted)."""
    comb = kl_spec.KLCombined(ma, log_sa, mb, log_sb, kl)
    da, db = kl_spec.block_grad(xp, a, b, comb, g, tau, row_mask=mask, dtype=cdt, want_a=want_a, want_b=want_b)
    return (None if da is None else da.to(a.dtype)), (None if db is None else db.to(b.dtype))


_compiled: dict = {}
_lock = threading.Lock()


def _variant(fn: Callable, key: tuple) -> Callable:
    # one code object per variant: dynamo's recompile limit counts per code object
    with _lock:
        out = _compiled.get((fn.__name__,) + key)
        if out is None:
            name = "_".join([fn.__name__] + [str(k).replace("torch.", "") for k in key])
            code = fn.__code__.replace(co_name=name)
            variant = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
            out = _compiled[(fn.__name__,) + key] = torch.compile(
                variant, dynamic=True, fullgraph=True, options=_compiled_path._INDUCTOR_OPTIONS)
        return out


def _run_compiled(fn: Callable, key: tuple, args: tuple):
    """``(out, True)`` from the compiled ``fn(*args)``; ``(None, False)`` if compiling failed (warned once)."""
    args = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)
    one = args[0].shape[0] == 1
    if one:  # batch invariance: the row twice, through the dynamic-T graph
        args = tuple(torch.cat([a, a]) if isinstance(a, Tensor) and a.ndim >= 1 else a for a in args)
    try:
        with _compiled_path._no_duck_shapes():
            out = _variant(fn, key)(*args)
    except _compiled_path._compile_errors() as exc:
        if _compiled_path._caused_by_oom(exc):
            raise
        if not _compiled_path._state["failed"]:
            _compiled_path._state["failed"] = True
            warnings.warn(f"dualvp_torch: torch.compile of the KL stages failed ({type(exc).__name__}: {exc}); "
                          "falling back to the eager row-chunked path for the rest of the process",
                          RuntimeWarning, stacklevel=4)
        return None, False
    if one:
        out = out[:1] if isinstance(out, Tensor) else tuple(None if o is None else o[:1] for o in out)
    return out, True


def _tau_tensor(tau: float, cdt, device) -> Tensor:
    return torch.tensor(tau, dtype=cdt, device=device)


# --- the stages ------------------------------------------------------------------------------


def _compute_dtype(*dtypes) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _rows_per_chunk(v_local: int) -> int:
    return max(1, CHUNK_ELEMENTS // v_local)


def _group(name: str):
    return torch.distributed.distributed_c10d._resolve_process_group(name) if name else None


# --- the Triton engine: dualvp_torch/triton_kernels/kl.py ---------------------------------------


def _block_v(v_local: int) -> int:
    # from V_local alone (batch invariance): the whole row in one block up to 4096 columns
    return min(4096, max(16, 1 << (max(1, v_local) - 1).bit_length()))


def _triton_stats(a, b, tau, cdt) -> Tensor:
    import triton.language as tl

    from .triton_kernels.kl import kl_stats_kernel

    n, v = a.shape
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    out = torch.empty((n, kl_spec.N_KL_STATS), dtype=cdt, device=a.device)
    kl_stats_kernel[(n,)](a, b, out, v, a.stride(0), b.stride(0), _tau_tensor(tau, cdt, a.device).reshape(1),
                          BLOCK_V=_block_v(v), COMPUTE=tl.float64 if cdt == torch.float64 else tl.float32)
    return out


def _triton_grad(a, b, res, g, mask, tau, cdt, want_a, want_b):
    import triton
    import triton.language as tl

    from .triton_kernels.kl import kl_grad_kernel

    n, v = a.shape
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    ga = torch.empty((n, v), dtype=a.dtype, device=a.device) if want_a else None
    gb = torch.empty((n, v), dtype=b.dtype, device=b.device) if want_b else None
    if n == 0:  # no launch with an empty grid
        return ga, gb
    block = _block_v(v)
    m = mask.view(torch.uint8) if mask is not None else None
    kl_grad_kernel[(n, triton.cdiv(v, block))](
        a, b, res.contiguous(), g.contiguous(), m if m is not None else g, ga if want_a else a, gb if want_b else b,
        n, v, a.stride(0), b.stride(0), _tau_tensor(tau, cdt, a.device).reshape(1), BLOCK_V=block,
        COMPUTE=tl.float64 if cdt == torch.float64 else tl.float32, HAS_MASK=mask is not None, WANT_A=want_a,
        WANT_B=want_b)
    return ga, gb


def _local_stats(a, b, tau, cdt, engine: str) -> Tensor:
    """``[n, 5]`` statistics of the shard: compiled over the whole shard, else eager over row chunks."""
    n = a.shape[0]
    if engine == "triton":
        return _triton_stats(a, b, tau, cdt) if n > 0 else torch.empty((0, kl_spec.N_KL_STATS), dtype=cdt,
                                                                         device=a.device)
    if engine == "compiled" and n > 0:
        key = (a.dtype, b.dtype, a.device.type)
        out, ok = _run_compiled(_stats_stage, key, (a, b, _tau_tensor(tau, cdt, a.device), cdt,
                                                    engines.accumulation_dtype(a)))
        if ok:
            return out
    stats = torch.empty((n, kl_spec.N_KL_STATS), dtype=cdt, device=a.device)
    step = _rows_per_chunk(a.shape[-1])
    for i in range(0, n, step):
        stats[i:i + step] = kl_spec.block_stats(xp, a[i:i + step], b[i:i + step], tau, dtype=cdt)
    return stats


def _forward(logits, ref_logits, row_mask, tau, direction, group, engine: str = "eager"):
    """``(kl [...], res [5, n])``: the KL and the residuals ``(ma, log_sa, mb, log_sb, kl)`` per row."""
    v = logits.shape[-1]
    cdt = _compute_dtype(logits.dtype, ref_logits.dtype)
    a, b = kl_spec.operands(direction, logits.reshape(-1, v), ref_logits.reshape(-1, v))
    stats = _local_stats(a, b, tau, cdt, engine)
    if group is not None and collectives.group_rank_world(group)[1] > 1:
        device = collectives.comm_device(group, stats)
        table = collectives.all_gather_rows(stats.to(device), group).to(stats.device)  # the forward's collective
    else:
        table = stats[None]
    comb = kl_spec.combine_stats(xp, table, tau)
    mask = None if row_mask is None else row_mask.reshape(-1)
    kl = kl_spec.outputs(xp, comb, mask)
    return kl.reshape(logits.shape[:-1]), torch.stack([comb.ma, comb.log_sa, comb.mb, comb.log_sb, comb.kl])


def _grad(logits, ref_logits, row_mask, res, grad, tau, direction, need_logits, need_ref, engine: str = "eager"):
    """``(d_logits or None, d_ref or None)``, each in its input's dtype, written chunk by chunk."""
    v = logits.shape[-1]
    cdt = _compute_dtype(logits.dtype, ref_logits.dtype)
    a, b = kl_spec.operands(direction, logits.reshape(-1, v), ref_logits.reshape(-1, v))
    want_a, want_b = (need_logits, need_ref) if direction == "forward" else (need_ref, need_logits)
    g = grad.reshape(-1)
    mask = None if row_mask is None else row_mask.reshape(-1)
    done = False
    if engine == "triton":
        ga, gb = _triton_grad(a, b, res, g, mask, tau, cdt, want_a, want_b)
        done = True
    elif engine == "compiled" and a.shape[0] > 0:
        key = (a.dtype, b.dtype, a.device.type, mask is not None, want_a, want_b)
        out, done = _run_compiled(_grad_stage, key, (a, b, *res.unbind(0), g.to(cdt),
                                                      _tau_tensor(tau, cdt, a.device), mask, cdt, want_a, want_b))
        if done:
            ga, gb = out
    if not done:
        ga = torch.empty_like(a, memory_format=torch.contiguous_format) if want_a else None
        gb = torch.empty_like(b, memory_format=torch.contiguous_format) if want_b else None
        step = _rows_per_chunk(v)
        for i in range(0, a.shape[0], step):
            sl = slice(i, i + step)
            comb = kl_spec.KLCombined(*(res[k, sl] for k in range(5)))
            da, db = kl_spec.block_grad(xp, a[sl], b[sl], comb, g[sl], tau,
                                        row_mask=None if mask is None else mask[sl], dtype=cdt,
                                        want_a=want_a, want_b=want_b)
            if want_a:
                ga[sl] = da
            if want_b:
                gb[sl] = db
    d_logits, d_ref = (ga, gb) if direction == "forward" else (gb, ga)
    return (None if d_logits is None else d_logits.view(logits.shape),
            None if d_ref is None else d_ref.view(ref_logits.shape))


# --- the custom ops ---------------------------------------------------------------------------


@torch.library.custom_op("dualvp::kl_divergence_fwd", mutates_args=())
def _fwd(logits: Tensor, ref_logits: Tensor, row_mask: Optional[Tensor], group_name: str, temperature: float,
         direction: str, validate: bool, impl: str) -> list[Tensor]:
    group = _group(group_name)
    _validated(logits, ref_logits, row_mask, temperature, direction, group, validate, impl or None)
    kl, res = _forward(logits, ref_logits, row_mask, temperature, direction, group,
                       _engine(impl or None, logits.device))
    return [kl, res]


@_fwd.register_fake
def _fwd_fake(logits, ref_logits, row_mask, group_name, temperature, direction, validate, impl):
    cdt = _compute_dtype(logits.dtype, ref_logits.dtype)
    n = logits.numel() // logits.shape[-1] if logits.dim() and logits.shape[-1] else 0
    return [logits.new_empty(logits.shape[:-1], dtype=cdt), logits.new_empty((5, n), dtype=cdt)]


@torch.library.custom_op("dualvp::kl_divergence_bwd", mutates_args=())
def _bwd(logits: Tensor, ref_logits: Tensor, row_mask: Optional[Tensor], res: Tensor, grad: Tensor,
         temperature: float, direction: str, impl: str, need_logits: bool, need_ref: bool) -> list[Tensor]:
    d_logits, d_ref = _grad(logits, ref_logits, row_mask, res, grad, temperature, direction, need_logits, need_ref,
                            _engine(impl or None, logits.device))
    # a custom op returns tensors: an empty one stands for "not needed"
    empty = logits.new_empty((0,))
    return [empty if d_logits is None else d_logits, empty if d_ref is None else d_ref]


@_bwd.register_fake
def _bwd_fake(logits, ref_logits, row_mask, res, grad, temperature, direction, impl, need_logits, need_ref):
    return [torch.empty_like(logits, memory_format=torch.contiguous_format) if need_logits else logits.new_empty((0,)),
            torch.empty_like(ref_logits, memory_format=torch.contiguous_format) if need_ref
            else ref_logits.new_empty((0,))]


def _setup_context(ctx, inputs, output):
    logits, ref_logits, row_mask, _, temperature, direction, _, impl = inputs
    ctx.save_for_backward(logits, ref_logits, row_mask, output[1])
    ctx.options = (temperature, direction, impl)


def _backward(ctx, grads):
    g = grads[0]
    logits, ref_logits, row_mask, res = ctx.saved_tensors
    need_logits, need_ref = bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1])
    if g is None or not (need_logits or need_ref):
        return (None,) * 8
    d_logits, d_ref = _bwd(logits, ref_logits, row_mask, res, g, *ctx.options, need_logits, need_ref)
    return (d_logits if need_logits else None, d_ref if need_ref else None) + (None,) * 6


_fwd.register_autograd(_backward, setup_context=_setup_context)


def _eligible(logits, ref_logits, row_mask, temperature, direction, group, validate, impl) -> bool:
    # the types a custom op can take; anything else fails _check_local (and raises through _validated)
    return (isinstance(logits, Tensor) and isinstance(ref_logits, Tensor)
            and (row_mask is None or isinstance(row_mask, Tensor))
            and isinstance(temperature, numbers.Real) and not isinstance(temperature, (bool, Tensor))
            and isinstance(direction, str) and isinstance(validate, bool)
            and (group is None or collectives.is_process_group(group)) and (impl is None or isinstance(impl, str)))


def kl_divergence(logits: Tensor, ref_logits: Tensor, *, group=None, row_mask: Optional[Tensor] = None,
                  temperature: float = 1.0, direction: str = "forward", validate: bool = True,
                  impl: Optional[str] = None) -> Tensor:
    """Per-row KL divergence over the full vocabulary, from this rank's vocab shards of two logits.

    ``direction="forward"``: ``KL(p || q) = sum_v p_v (log p_v - log q_v)`` with
    ``p = softmax(logits / tau)``, ``q = softmax(ref_logits / tau)`` over all
    ``W * V_local`` columns (the KL penalty to a reference policy, or
    distillation from a teacher in ``ref_logits``); ``"reverse"``: ``KL(q || p)``.

    Args:
      logits: ``[..., V_local]`` float32 / bfloat16 / float16 / float64, this
        rank's shard (rank ``r`` of ``group`` holds columns ``[r*V_local,
        (r+1)*V_local)``). Gets a gradient when it requires one.
      ref_logits: the same shape and sharding, any of those dtypes; gets a
        gradient when it requires one (a detached reference costs none).
      group: the tensor-parallel ``ProcessGroup`` splitting the vocabulary,
        or ``None`` (unsharded).
      row_mask: ``None`` (every row counts) or ``[...]`` bool, the same on
        every rank: rows where it is ``False`` (padding, prompt tokens: the
        ``ignore_index`` rows of a loss) get KL 0 and zero gradients, whatever
        their logits hold (NaN included).
      temperature: ``tau > 0``, a Python number: both distributions are
        ``softmax(. / tau)``.
      direction: ``"forward"`` or ``"reverse"`` (above).
      validate: with a group of ``W > 1``, one extra all-gather (and one host
        sync) checks that the ranks agree on the shapes, dtypes, options and
        ``row_mask``, raising the same error on every rank. ``False``: no
        agreement step; the local checks still run.
      impl: the engine: ``"compiled"`` (``torch.compile`` of the
        :mod:`dualvp.kl_spec` stages over the whole shard, one fused pass per
        stage), ``"eager"`` (the same stages op by op over row chunks of
        ``CHUNK_ELEMENTS`` elements), or ``None``: as
        :func:`dualvp_torch.logprob_entropy` chooses (``"compiled"`` unless
        ``DUALVP_COMPILE=0`` or compiling failed), never ``"triton"``: the
        kernels of :mod:`dualvp_torch.triton_kernels.kl` (CUDA tensors, or CPU
        tensors under ``TRITON_INTERPRET=1``; opt-in until a GPU run has
        measured them). Every engine gives a row results that do not depend on
        the other rows or ``T``.

    Returns:
      ``[...]`` float32 (float64 if either input is float64), identical on
      every rank of the group.

    Banned tokens: ``-inf`` logits are legal. A column with ``p_v = 0``
    contributes nothing; a column with ``p_v > 0`` and ``q_v = 0`` makes the
    row's KL ``+inf`` (and its gradient to the ``p``-side logits non-finite).
    A row whose logits or ref_logits are all ``-inf`` or hold NaN / ``+inf``
    gives NaN unless masked.

    Raises:
      ``TypeError`` / ``ValueError`` naming the argument; with ``validate=True``
      and a group, on every rank (``RuntimeError`` naming the ranks when they
      fail differently or disagree).
    """
    if not _eligible(logits, ref_logits, row_mask, temperature, direction, group, validate, impl):
        _validated(logits, ref_logits, row_mask, temperature, direction, group, validate, impl)
    name = "" if group is None else group.group_name
    return _fwd(logits, ref_logits, row_mask, name, float(temperature), direction, validate, impl or "")[0]
