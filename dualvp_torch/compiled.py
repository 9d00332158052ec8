"""The compiled path: ``torch.compile`` of the stages, its cache, and the fallback when compiling fails.

:func:`run` compiles a stage of :mod:`dualvp_torch.stages` with
``torch.compile(dynamic=True, fullgraph=True)`` (C++/OpenMP on CPU, Triton on
GPU) and runs it. One compiled function per (stage, input dtype, device
type, mask present, entropy gradient present, static width), reused for every
``T`` and ``V_local``; the temperature is a 0-d tensor input, so a new
temperature never recompiles. If compiling fails (the exception types in
:data:`COMPILE_ERRORS`), :func:`run` warns once, returns ``(None, False)``, and
:func:`failed` is ``True`` for the rest of the process. A runtime error of a
compiled kernel (an out-of-memory error included, even one raised while
compiling) propagates.

:func:`one_graph_break` is how an op meets a caller's ``torch.compile``
when it is not a custom op of :mod:`dualvp_torch.library`: one graph break.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types
import warnings
from typing import Callable, Optional

import torch

from . import engine_names, stages, tuning

__all__ = ["COMPILE_ERRORS", "failed", "run", "one_graph_break"]  # noqa: F822 - COMPILE_ERRORS: module __getattr__

# The compile cache (tests reset it with a fresh dict); the fallback flag is dualvp_torch.engine_names's,
# which choosing an engine reads without importing this module.
_state: dict = {}
_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _compile_errors() -> tuple:
    import torch._dynamo.exc as dynamo_exc
    import torch._inductor.exc as inductor_exc

    names = ("InductorError", "CppCompileError", "CUDACompileError", "InvalidCxxCompiler", "LoweringException")
    found = [getattr(inductor_exc, n) for n in names if isinstance(getattr(inductor_exc, n, None), type)]
    return (dynamo_exc.TorchDynamoException, *found)


def __getattr__(name: str):
    # COMPILE_ERRORS (what counts as "compiling failed") is built on first
    # use: importing torch._dynamo takes about a second, which a process that
    # never compiles (an eager-only rank, a tool) would pay at import.
    if name == "COMPILE_ERRORS":
        return _compile_errors()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def failed() -> bool:
    """``True`` once compiling a stage has failed in this process."""
    return engine_names.compile_failed()


# Each stage is meant to be one fused pass over the shard. Inductor stores a
# pointwise expression as an intermediate once it reads more than
# ``realize_acc_reads_threshold`` buffers or exceeds an op count; the masked
# gradient with entropy reads more than the default, and was then written as
# a float32 [T, V_local] buffer (tests/torch/test_logits_memory.py holds the
# peaks). The read threshold is raised for every stage; the op count and the
# per-node read count only for the masked stages, which need them (raised for
# all, inductor recomputed the unmasked exponentials in each reduction)
# (docs/decisions.md, "Inductor thresholds for one-pass stages").
#
# ``cpp.dynamic_threads``: otherwise inductor's C++ code decides at compile
# time, from the example size, whether a loop runs in parallel, and a
# dynamic-shape kernel first compiled at a small shape (or served from the FX
# graph cache where such a compile left it) ran serially at every size
# (tests/torch/test_recompile.py checks the generated code).
_INDUCTOR_OPTIONS = {"realize_acc_reads_threshold": 64, "cpp.dynamic_threads": True}
_MASKED_OPTIONS = dict(_INDUCTOR_OPTIONS, realize_opcount_threshold=400, realize_reads_threshold=16)


def _static_vocab(fn: Callable, z: torch.Tensor) -> bool:
    # compiled for the width first seen, rows dynamic: Tuning.static_vocab_devices
    # (docs/decisions.md, "Static vocabulary width on CUDA")
    return fn in stages.SHARD_STAGES and z.device.type in tuning.current().static_vocab_devices


def _compiled(fn: Callable, z: torch.Tensor, has_keep: bool, has_entropy: bool) -> Callable:
    # Each variant compiles its own copy of the stage's code object: dynamo's
    # recompile limit counts per code object, and these variants are
    # expected, not recompiles to be limited.
    static = _static_vocab(fn, z)
    key = (fn.__name__, z.dtype, z.device.type, has_keep, has_entropy, static)
    with _lock:
        compiled = _state.get(key)
        if compiled is None:
            name = (f"{fn.__name__}_{str(z.dtype).replace('torch.', '')}_{z.device.type}_"
                    f"{'mask' if has_keep else 'nomask'}{'_ent' if has_entropy else ''}{'_static_v' if static else ''}")
            code = fn.__code__.replace(co_name=name)
            variant = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
            # static: sizes are constants unless marked dynamic (_mark_rows_dynamic marks the row count)
            compiled = _state[key] = torch.compile(variant, dynamic=None if static else True, fullgraph=True,
                                                   options=_MASKED_OPTIONS if has_keep else _INDUCTOR_OPTIONS)
        return compiled


def _mark_rows_dynamic(args: tuple) -> None:
    # dim 0 of every tensor argument is the row count T (logits, mask, [T] vectors); a
    # size of 0 or 1 cannot be marked (dynamo specialises it), and gets its own graph
    for a in args:
        if isinstance(a, torch.Tensor) and a.ndim >= 1 and a.shape[0] >= 2:
            torch._dynamo.mark_dynamic(a, 0)


# torch.fx.experimental._config (private; present since torch 2.1): holds the
# setting dynamo's shape environment reads when it starts a trace.
try:
    from torch.fx.experimental import _config as _fx_config
except ImportError:  # pragma: no cover - a torch without it traces with its default
    _fx_config = None


def _no_duck_shapes():
    return contextlib.nullcontext() if _fx_config is None else _fx_config.patch(use_duck_shape=False)


def _caused_by_oom(exc: BaseException) -> bool:
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, torch.OutOfMemoryError):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def run(fn: Callable, args: tuple, has_entropy: bool, has_keep: Optional[bool] = None):
    """``(out, True)`` from the compiled ``fn(*args)``; ``(None, False)`` if compiling failed (warned once).

    ``has_keep``: whether a keep mask is present; by default ``args[3] is not
    None`` (the keep argument of the shard and block stages).
    """
    # Dynamo guards a view argument on its base's sizes and strides as well
    # (the logits as a slice of a larger tensor, the uint8 view of the mask,
    # the [T] statistics as columns of the [T, 6] block): a later call whose
    # bases differ would recompile, and past dynamo's recompile limit fall
    # back to eager for good. ``detach()`` gives the same memory without a
    # base (the in-place stage writes through it into the caller's tensor);
    # the O(T) vectors are made contiguous. Duck sizing is off while a stage
    # is traced: it ties sizes that are equal at the first call (T and a
    # stride of 6, V_local and a storage offset) for good
    # (tests/torch/test_recompile.py).
    args = tuple((a.contiguous() if a.ndim == 1 else a).detach() if isinstance(a, torch.Tensor) else a
                 for a in args)
    if fn in stages.SHARD_STAGES and args[0].shape[0] == 1:
        return _run_one_row(fn, args, has_entropy, has_keep)
    try:
        keep = args[3] is not None if has_keep is None else has_keep
        compiled = _compiled(fn, args[0], keep, has_entropy)
        static = _static_vocab(fn, args[0])
        # The row marks and duck sizing matter only when dynamo traces: at a
        # variant's first call (for a static width: its first call at each
        # width). Later calls skip them, as they cost host time on every call.
        first = ("first call", compiled, args[0].shape[-1] if static else None)
        if first not in _state:
            with _no_duck_shapes():
                if static:
                    _mark_rows_dynamic(args)
                out = compiled(*args)
            _state[first] = False
            return out, True
        return compiled(*args), True
    except _compile_errors() as exc:
        if _caused_by_oom(exc):
            raise
        if engine_names.record_compile_failure():
            warnings.warn(
                f"dualvp_torch: torch.compile of the local kernels failed ({type(exc).__name__}: {exc}); "
                "falling back to the eager row-chunked path for the rest of the process",
                RuntimeWarning,
                stacklevel=4,
            )
        return None, False


def one_graph_break(fn: Callable) -> Callable:
    """``fn``, run as one graph break when a caller's ``torch.compile`` traces it.

    Under dynamo the call goes through ``torch.compiler.disable(fn)``: the op
    runs as it runs eagerly (its own compiled kernels included, bit for bit).
    Traced into, an op would split the caller into many graphs around its
    validation and thread pool. The disabled wrapper is made at trace time,
    not here: ``torch.compiler.disable`` imports ``torch._dynamo`` (a second),
    which an eager-only process never pays.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():
            return torch.compiler.disable(fn)(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper


def _run_one_row(fn: Callable, args: tuple, has_entropy: bool, has_keep: Optional[bool]):
    # Batch invariance: dynamo specialises a row count of 1, and the graph it
    # compiles for one row may block or split the row's reductions otherwise
    # than the dynamic-T graph every other row count shares. A one-row shard
    # runs as two rows (the row twice: the shard's [T] and [T, V_local]
    # arguments repeated, a copy of one row) through that shared graph, and
    # row 0 of the result is kept; the in-place stage's row is copied back.
    two = tuple(torch.cat([a, a]) if isinstance(a, torch.Tensor) and a.ndim >= 1 else a for a in args)
    out, ok = run(fn, two, has_entropy, has_keep)
    if not ok:
        return None, False
    if fn is stages.grad_inplace_stage:
        args[0].copy_(two[0][:1])
        return out, True
    return out[:1], True
