"""How the spec runs in torch: the shard-local stages of the op, compiled or eager.

This module holds no math. The two stages are the spec functions themselves,
run over the array namespace ``array_api_compat.torch``:

* statistics (forward): :func:`dualvp.spec.block_stats` of the shard
  ``z [T, V_local]`` -> ``[T, 6]`` in the compute dtype;
* gradient (backward): :func:`dualvp.spec.block_grad` -> ``[T, V_local]``
  in the input dtype, either into a fresh buffer or (``inplace=True``) into
  the logits' own storage.

The compute dtype is float64 for float64 input and float32 otherwise; the row
sums of the compiled CPU kernels accumulate in float64 (see
:func:`accumulation_dtype`).

Implementations (the registry :data:`IMPLEMENTATIONS`)
------------------------------------------------------
``"compiled"``
    ``torch.compile(dynamic=True, fullgraph=True)`` of the spec stage (C++/
    OpenMP on CPU, Triton on GPU): fused single-pass loop nests with no
    ``[T, V_local]`` intermediate. One graph per (stage, input dtype, mask
    present, entropy gradient present), reused for every ``T`` and
    ``V_local``; the temperature is a 0-d tensor input, so changing it never
    recompiles. On CPU the masked statistics shift the kept sum by the
    overall max (``spec.block_stats(kept_shift="max")``: the mask is read in
    one pass, not two; masked forward 186 -> 79 ms at T=2048, V_local=32000,
    float32; without a kept-max reduction since 2026-12-05, 0.62-0.94x
    again at that size), and the rows that marks (a kept sum below
    ``e^-spec.KEPT_GAP``, i.e. a kept max more than ``spec.KEPT_GAP`` below
    the overall max, or NaN) are recomputed with the kept max on the eager
    path. The in-place gradient is compiled too: the
    stage ends in ``z.copy_(grad)``, which inductor fuses into one kernel
    that reads each element and writes its gradient over it (O(T) extra
    memory).
``"eager"``
    The same spec stages run op by op over row chunks, for environments
    without a compiler. A chunk holds :func:`chunk_rows` rows, sized from a
    memory budget: the temporaries of the chunks in flight (at most
    :data:`STATS_SCRATCH_BYTES` / :data:`GRAD_SCRATCH_BYTES` bytes per chunk
    element, measured) stay within a fraction of the shard's bytes ``B``:
    :data:`STATS_FRACTION` in the forward (nothing else is alive then),
    :data:`GRAD_FRACTION` next to a fresh gradient buffer (peak ``<= 1.1
    B``), :data:`INPLACE_FRACTION` for the in-place gradient (``<= 0.05 B``);
    and on CPU, a chunk's scratch is at most :data:`CPU_CHUNK_SCRATCH_BYTES`
    (temporaries that stay in cache and are not page-faulted afresh: the
    first CPU chunk loop of a process raises glibc's heap trim threshold
    above that bound, so that a chunk reuses the pages the chunk before it
    freed); a chunk
    has at least :data:`MIN_CHUNK_ELEMENTS` elements, so that tiny shards do
    not run one row at a time. Row sums accumulate in float32
    (eager torch sums are cascaded). On CPU the chunks run in parallel on up
    to ``torch.get_num_threads()`` worker threads (at most
    :data:`MAX_EAGER_WORKERS`), each running its ops single-threaded: the
    spec's out-of-place ops are small at chunk size, and splitting each of
    them over an intra-op team costs a barrier per op, which under CPU
    contention waits for a descheduled thread (5-20x slower, measured). The
    caller's thread settings are unchanged.

Selection (:func:`select`): the ``impl`` argument when given; otherwise the
environment variable ``DUALVP_COMPILE``, read at each call (``0`` / ``false``
/ ``no``: ``"eager"``; anything else or unset: ``"compiled"``). If compiling a
stage fails (no C++ compiler, an inductor or dynamo error: the exception
types in :data:`COMPILE_ERRORS`), a warning is issued once and ``"compiled"``
selects ``"eager"`` for the rest of the process. Only compilation failures
switch: a runtime error of a compiled kernel (an out-of-memory error
included, even when raised during compilation) propagates to the caller.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import types
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import array_api_compat.torch as _compat_torch
import torch

from dualvp import spec


def _take_along_axis(x: torch.Tensor, indices: torch.Tensor, /, *, axis: int = -1) -> torch.Tensor:
    # array_api_compat maps take_along_axis to torch.take_along_dim, whose
    # meta function makes dynamo guard on the exact sizes: every new
    # (T, V_local) recompiled the stage, and past the recompile limit (8)
    # dynamo raised, which the op takes as a compilation failure: one warning,
    # then the eager path for the rest of the process. torch.gather takes the
    # same indices (same rank, int64) and keeps the sizes symbolic.
    return torch.gather(x, axis, indices)


#: The array namespace the stages run the spec over: ``array_api_compat.torch``
#: with ``take_along_axis`` as :func:`torch.gather` (see ``_take_along_axis``).
xp = types.SimpleNamespace(**{k: getattr(_compat_torch, k) for k in dir(_compat_torch) if not k.startswith("__")})
xp.take_along_axis = _take_along_axis

__all__ = [
    "IMPLEMENTATIONS",
    "COMPILE_ERRORS",
    "STATS_SCRATCH_BYTES",
    "GRAD_SCRATCH_BYTES",
    "MAX_EAGER_WORKERS",
    "STATS_FRACTION",
    "GRAD_FRACTION",
    "INPLACE_FRACTION",
    "MIN_CHUNK_ELEMENTS",
    "CPU_CHUNK_SCRATCH_BYTES",
    "STATIC_VOCAB_DEVICES",
    "FLOAT64_SUMS_DEVICES",
    "HUGE_PAGE_DEVICES",
    "HUGE_PAGE_MIN_BYTES",
    "advise_huge_pages",
    "compute_dtype",
    "accumulation_dtype",
    "compile_enabled",
    "select",
    "chunk_rows",
    "shard_stats",
    "shard_grad",
    "merge",
]

#: The registered implementations, in order of preference.
IMPLEMENTATIONS = ("compiled", "eager")

#: Upper bound of the spec's live temporaries per chunk element on the eager
#: path, in bytes, for the statistics (measured with the profiler's allocation
#: trace at the peak, chunks in the calling thread: 8-26 B, float32 and
#: bfloat16 input, with and without a mask and the entropy) ...
STATS_SCRATCH_BYTES = 28
#: ... and for the gradient (19-41 B, its output chunk included).
#: tests/torch/test_memory_compat.py holds the resulting peaks.
GRAD_SCRATCH_BYTES = 44
#: Most worker threads of the eager path on CPU.
MAX_EAGER_WORKERS = 8
#: The eager chunk's scratch in the forward, as a fraction of the shard's bytes.
STATS_FRACTION = 0.5
#: ... in the in-place gradient.
INPLACE_FRACTION = 0.04
#: ... and next to a fresh gradient buffer (the backward's peak is then <= 1.1 B).
GRAD_FRACTION = 0.09
#: ... but a chunk has at least this many elements (or all rows).
MIN_CHUNK_ELEMENTS = 1 << 12
#: On CPU, one chunk's scratch also stays within this many bytes (a float32
#: temporary of the chunk then holds at most ~2.3 MiB). Larger temporaries
#: leave the last-level cache between the spec's ops and are page-faulted
#: afresh (glibc maps every allocation of 32 MiB or more anew; fresh pages
#: are most of what writing a buffer costs on CPU, see the README's floors).
#: Measured (benchmarks/vs_slime.py, T=2048, two workers): V_local=152064
#: float32 forward 1.6-1.9 s -> 0.40-0.62 s, lp+ent+grad 1.9-2.1 -> 0.79-0.97
#: s; V_local=32000 and bfloat16 within noise. One worker (chunks twice as
#: large before): forward at V_local=32000 218 -> 101 ms (float32).
CPU_CHUNK_SCRATCH_BYTES = 16 << 20


@functools.lru_cache(maxsize=None)
def _compile_errors() -> tuple:
    import torch._dynamo.exc as dynamo_exc
    import torch._inductor.exc as inductor_exc

    names = ("InductorError", "CppCompileError", "CUDACompileError", "InvalidCxxCompiler", "LoweringException")
    found = [getattr(inductor_exc, n) for n in names if isinstance(getattr(inductor_exc, n, None), type)]
    return (dynamo_exc.TorchDynamoException, *found)


def __getattr__(name: str):
    # COMPILE_ERRORS, the exceptions that count as "compiling failed" (the
    # fallback catches only these), is built on first use: importing
    # torch._dynamo takes about a second, which a process that never compiles
    # (an eager-only rank, a tool) would otherwise pay at `import dualvp_torch`.
    if name == "COMPILE_ERRORS":
        return _compile_errors()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 input, float32 for every 16/32-bit float."""
    return torch.float64 if dtype == torch.float64 else torch.float32


#: Device types whose compiled kernels sum rows in float64 (see
#: :func:`accumulation_dtype`). Remove ``"cuda"`` for float32 sums on a GPU.
FLOAT64_SUMS_DEVICES: frozenset = frozenset({"cpu", "cuda"})


def accumulation_dtype(z: torch.Tensor, impl: str = "compiled") -> Optional[torch.dtype]:
    """float64 row sums for compiled kernels on :data:`FLOAT64_SUMS_DEVICES` (CPU and CUDA), else ``None``.

    The CPU code that inductor generates sums a row sequentially in a few
    vector lanes, so a float32 sum over ~1e5 columns drifts by ~sqrt(V) eps
    (measured: entropy error 7e-6 at V = 32000, against 3e-7 for eager
    torch's cascade summation); float64 accumulation costs one conversion per
    element inside the fused loop. Eager torch sums are cascaded (as precise
    as the float64 path here), and there a float64 sum would cost a float64
    copy of the chunk and two more passes. On a GPU the same holds: on the
    H200 (README "GPU", T=16384, V_local=19008, float32, lp + entropy with
    gradient, ``benchmarks/gpu_precision.py``) float32 sums gave an entropy
    error of 2.8e-6 and a gradient error of 2.8e-6, float64 sums 1.0e-6 and
    3.0e-7, for 3.48 ms per call against 3.40 ms (+2 %).
    """
    return torch.float64 if impl == "compiled" and z.device.type in FLOAT64_SUMS_DEVICES else None


def compile_enabled() -> bool:
    """``False`` when ``DUALVP_COMPILE=0`` (read at call time) or compiling failed before."""
    return select() == "compiled"


def select(impl: Optional[str] = None) -> str:
    """The implementation a call runs: ``impl`` if given, else from ``DUALVP_COMPILE``.

    ``"compiled"`` becomes ``"eager"`` once compiling has failed in this process.

    Raises:
      ValueError: ``impl`` is not ``None`` or one of :data:`IMPLEMENTATIONS`.
    """
    if impl is None:
        off = os.environ.get("DUALVP_COMPILE", "1").strip().lower() in ("0", "false", "no")
        impl = "eager" if off else "compiled"
    elif impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl: expected None or one of {IMPLEMENTATIONS}, got {impl!r}")
    if impl == "compiled" and _state["failed"]:
        return "eager"
    return impl


def chunk_rows(
    n_rows: int, v_local: int, itemsize: int = 4, fraction: float = STATS_FRACTION,
    scratch_bytes: int = STATS_SCRATCH_BYTES, workers: int = 1, cap_bytes: Optional[int] = None,
) -> int:
    """Rows per chunk of the eager path (at least 1, at most ``n_rows``).

    ``workers * scratch_bytes * rows * v_local <= fraction * n_rows * v_local
    * itemsize`` (the temporaries of the chunks in flight are that fraction
    of the shard's bytes) and, when ``cap_bytes`` is given (on CPU:
    :data:`CPU_CHUNK_SCRATCH_BYTES`), ``scratch_bytes * rows * v_local <=
    cap_bytes``; but at least ``MIN_CHUNK_ELEMENTS`` elements per chunk.
    """
    v = max(1, v_local)
    budget = int(fraction * n_rows * itemsize / (scratch_bytes * max(1, workers)))
    if cap_bytes is not None:
        budget = min(budget, cap_bytes // (scratch_bytes * v))
    return max(1, min(n_rows, max(budget, MIN_CHUNK_ELEMENTS // v)))


def _cap(z: torch.Tensor) -> Optional[int]:
    return CPU_CHUNK_SCRATCH_BYTES if z.device.type == "cpu" else None


# --- the stages: spec functions over torch -------------------------------------------


def _as_bool(keep: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    # The compiled CPU stages receive the bool mask as its uint8 view
    # (:func:`_mask_arg`) and turn it into a float compare here, inside the
    # graph: the generated code then converts 16 bytes to 16 floats with one
    # vector instruction and compares them as floats, where `keep != 0`
    # builds a uint8 lane mask whose conversion to a float blend mask is
    # slow (T=2048, V_local=32000, masked statistics: 368 ms with `!= 0`,
    # 224 ms with the float compare; unmasked 92 ms).
    return keep if keep is None or keep.dtype == torch.bool else keep.to(torch.float32) > 0


def _mask_arg(keep: Optional[torch.Tensor], z: torch.Tensor) -> Optional[torch.Tensor]:
    # Inductor's CPU code loads a bool tensor lane by lane (VecMask::from
    # bool*), a uint8 tensor as one vector load: masked statistics at T=2048,
    # V_local=32000 took 0.45-0.56 s from the bool mask and 0.25-0.30 s from
    # its uint8 view compared with 0 (the same bytes; no copy).
    return keep.view(torch.uint8) if keep is not None and z.device.type == "cpu" else keep


def _stats_stage(
    z, local, owns, keep: Optional[torch.Tensor], tau, acc_dtype: Optional[torch.dtype] = None,
    with_entropy: bool = True, kept_shift: str = "kept",
):
    return spec.block_stats(
        xp, z, local, owns, _as_bool(keep), tau, dtype=compute_dtype(z.dtype), acc_dtype=acc_dtype,
        with_entropy=with_entropy, kept_shift=kept_shift,
    )


def _grad_stage(z, local, owns, keep: Optional[torch.Tensor], M, log_s, c, mk, log_sk, valid, gl, ge, tau):
    comb = spec.Combined(M=M, log_s=log_s, c=c, mk=mk, log_sk=log_sk, zy=None)
    g = spec.block_grad(xp, z, local, owns, _as_bool(keep), comb, valid, gl, ge, tau, dtype=compute_dtype(z.dtype))
    return xp.astype(g, z.dtype)


def _grad_inplace_stage(z, local, owns, keep: Optional[torch.Tensor], M, log_s, c, mk, log_sk, valid, gl, ge, tau):
    z.copy_(_grad_stage(z, local, owns, keep, M, log_s, c, mk, log_sk, valid, gl, ge, tau))


def _grad_into_stage(z, local, owns, keep: Optional[torch.Tensor], M, log_s, c, mk, log_sk, valid, gl, ge, tau, out):
    # the gradient written into a buffer the caller allocated (see _fresh_grad)
    out.copy_(_grad_stage(z, local, owns, keep, M, log_s, c, mk, log_sk, valid, gl, ge, tau))


def _merge_stage(all_stats, valid, tau):
    comb = spec.finalize(xp, spec.reduce_stats(xp, all_stats, axis=0, temperature=tau), tau)
    return (*comb, *spec.outputs(xp, comb, valid, tau))


# --- "compiled" ----------------------------------------------------------------------

_state: dict = {"failed": False}
_lock = threading.Lock()


# Each stage is meant to be one fused pass over the shard. Inductor splits a
# pointwise expression into a stored intermediate once it reads more than
# ``realize_*acc_reads_threshold`` buffers (12 on CPU) or exceeds an op count
# (100 inside a node; more with dynamic shapes' index arithmetic): the masked
# gradient with entropy reads 13 ([T] statistics and upstream gradients), and
# was then written as a float32 [T, V_local] buffer before its cast to the
# input dtype (2 B extra for bfloat16, tests/torch/test_memory_compat.py).
# The read threshold is raised for every stage (no effect on speed measured);
# the op count and the read count of one node (the one-exponential masked
# stages read their exponential in several selects and sums, and inductor
# stored it as a float32 [T, V_local] buffer) only for the masked stages,
# which need them: raised for all, the op count made inductor recompute the
# exponentials of the unmasked statistics in each reduction (bfloat16 forward
# 90 -> 132 ms at T=2048, V_local=32000).
#
# ``cpp.dynamic_threads``: inductor's C++ code otherwise decides at compile
# time, from the example input's size and ``torch.get_num_threads()``,
# whether a loop runs in parallel, and a ``dynamic=True`` kernel keeps that
# decision for every later shape. Compiled first at a small shape (a test, a
# short first batch), or served from the FX graph cache where such a compile
# left it, the stage ran serially at every size: 141 vs 65 ms at T=2048,
# V_local=32000 on 2 cores (a factor of the core count on a larger host).
# With it, each kernel has a parallel region whose size OpenMP decides at run
# time (no speed difference measured at full size).
_INDUCTOR_OPTIONS = {"realize_acc_reads_threshold": 64, "cpp.dynamic_threads": True}
_MASKED_OPTIONS = dict(_INDUCTOR_OPTIONS, realize_opcount_threshold=400, realize_reads_threshold=16)


#: Device types ("cpu", "cuda") on which the shard stages are compiled for
#: the vocabulary width they first see, with only the row count dynamic (a
#: new width recompiles; in training V_local is fixed). On the H200 (README
#: "GPU", T=16384, V_local=19008, float32, ``benchmarks/gpu_profile.py``) the
#: kernels of one forward + backward took 1.19 / 1.32 / 2.12 ms (lp / + entropy
#: / + keep mask) against 3.18 / 2.30 / 3.73 ms with a symbolic width: the
#: gradient kernel over a known width ran at 0.74 ms instead of 2.59 ms. On
#: the CPU a fixed width made no difference, and one kernel for every shape
#: spares the tests (many widths) their compiles.
STATIC_VOCAB_DEVICES: frozenset = frozenset({"cuda"})

#: Input dtypes whose compiled CPU statistics always include the entropy's
#: ``t`` (``with_entropy=False`` then only drops it afterwards: the log-prob
#: does not depend on it). Without ``t`` inductor tiles the bfloat16 sum loop
#: 32 columns wide (float64 accumulators four vectors deep), with it 16 wide,
#: and the leaner kernel is the slower one: on the 2-core EPYC the
#: log-prob-only forward took 37 vs 29 ms (bfloat16), 33 vs 25 ms (float16)
#: at T=2048, V_local=32000, 152 vs 113 ms (bfloat16) at V_local=152064, lean
#: vs with ``t`` (``benchmarks/lean_stats.py``; the same log-probs). float32
#: is the other way round (23 vs 28 ms, 110 vs 135 ms), so it keeps the lean
#: statistics.
FULL_STATS_CPU_DTYPES: frozenset = frozenset({torch.bfloat16, torch.float16})

_SHARD_STAGES = ("_stats_stage", "_grad_stage", "_grad_inplace_stage", "_grad_into_stage")


def _static_vocab(fn: Callable, z: torch.Tensor) -> bool:
    return fn.__name__ in _SHARD_STAGES and z.device.type in STATIC_VOCAB_DEVICES


def _compiled(fn: Callable, z: torch.Tensor, has_keep: bool, has_entropy: bool) -> Callable:
    # One compiled function per (stage, input dtype, mask present, entropy
    # gradient present), each over its own copy of the code object: dynamo's
    # recompile limit counts per code object, and these variants are expected,
    # not recompiles to be limited.
    static = _static_vocab(fn, z)
    key = (fn.__name__, z.dtype, z.device.type, has_keep, has_entropy, static)
    with _lock:
        compiled = _state.get(key)
        if compiled is None:
            name = (f"{fn.__name__.lstrip('_')}_{str(z.dtype).replace('torch.', '')}_{z.device.type}_"
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
# setting dynamo's shape environment reads when it starts a trace. Looked up
# once here, not on every call of a stage.
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


def _run_compiled(fn: Callable, args: tuple, has_entropy: bool, has_keep: Optional[bool] = None):
    """Run the compiled stage; on a compilation failure warn once and return ``None``.

    ``has_keep``: whether a keep mask is present; by default ``args[3] is not
    None`` (the keep argument of the shard and block stages).
    """
    # Dynamo guards a view argument on its base's sizes and strides as well:
    # the logits as a slice or reshape of a larger tensor, the uint8 view of
    # the bool mask, the [T] statistics as columns of the [T, 6] block, each
    # with whatever layout its base had at the first call. A later call whose
    # bases differ (another batch shape, a contiguous input), or whose row
    # count happens to equal a base's stride (duck sizing), recompiled the
    # stage (15 recompiles of ~3 s in the shared table at W = 1; past dynamo's
    # limit of 8 a stage would fall back to eager for good). ``detach()``
    # gives the same memory without a base; the in-place stage writes through
    # it into the caller's tensor. The O(T) vectors are made contiguous (a
    # column of the statistics has stride 6). And duck sizing is off while a
    # stage is traced: it assumes that sizes equal at the first call are equal
    # for good, and tied T to that stride when the first batch had 6 rows, or
    # V_local to the storage offset of a slice one row into its base.
    args = tuple((a.contiguous() if a.ndim == 1 else a).detach() if isinstance(a, torch.Tensor) else a
                 for a in args)
    try:
        keep = args[3] is not None if has_keep is None else has_keep
        compiled = _compiled(fn, args[0], keep, has_entropy)
        static = _static_vocab(fn, args[0])
        # The row marks and duck sizing matter when dynamo traces: at a
        # variant's first call (compiled for the width: its first call at each
        # width). Later calls run without them: on every call they cost 25 us
        # a marked tensor and 13 us the patch (host time per forward + backward
        # with the GPU's settings on the CPU at T=64: 373 -> 291 us log-prob
        # only, 463 -> 333 us with a mask; on the H200 the kernels of T = 4096
        # rows take about 0.1 ms of the ~3.8 ms a call took).
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
        if not _state["failed"]:
            _state["failed"] = True
            warnings.warn(
                f"dualvp_torch: torch.compile of the local kernels failed ({type(exc).__name__}: {exc}); "
                "falling back to the eager row-chunked path for the rest of the process",
                RuntimeWarning,
                stacklevel=4,
            )
        return None, False


# --- "eager" -------------------------------------------------------------------------


# The eager path runs its row chunks on CPU in parallel, one chunk per worker
# thread, each worker's ops single-threaded, instead of one chunk at a time
# with every op split over torch's intra-op threads. The spec's ops are
# small at chunk size (a few MB), and an intra-op team pays a barrier per
# op: when another process occupies a core, each barrier waits for a
# descheduled thread (measured at T=2048, V_local=32000 with the machine
# oversubscribed: 17-31 s per call, against 3.4 s chunk-parallel and 3.4 s
# for plain eager torch on the same run). Independent chunks need no barrier.

_pool: dict = {}


def _set_threads(n: int, barrier: Optional[threading.Barrier] = None) -> None:
    torch.set_num_threads(n)
    if barrier is not None:
        barrier.wait()


def _workers(z: torch.Tensor, n_chunks_max: int) -> int:
    if z.device.type != "cpu":
        return 1  # kernel launches are asynchronous; one host thread suffices
    return max(1, min(torch.get_num_threads(), MAX_EAGER_WORKERS, n_chunks_max))


def _executor(workers: int) -> ThreadPoolExecutor:
    # Workers with one intra-op thread each. torch.set_num_threads in a
    # thread sets that thread's OpenMP team size, and also the default that
    # threads started later initialise from: a throwaway thread restores that
    # default (and MKL's global count) to the caller's value, so that nothing
    # outside these workers changes.
    with _lock:
        ex = _pool.get(workers)
        if ex is None:
            ex = ThreadPoolExecutor(workers, thread_name_prefix="dualvp-eager")
            barrier = threading.Barrier(workers)
            for f in [ex.submit(_set_threads, 1, barrier) for _ in range(workers)]:
                f.result()
            restore = threading.Thread(target=_set_threads, args=(torch.get_num_threads(),))
            restore.start()
            restore.join()
            _pool[workers] = ex
        return ex


def _map_chunks(fn: Callable, z: torch.Tensor, fraction: float, scratch_bytes: int, release: bool = False) -> list:
    n, v = z.shape
    workers = _workers(z, n)
    if z.device.type == "cpu":
        _keep_chunk_scratch_mapped()
    step = chunk_rows(n, v, z.element_size(), fraction, scratch_bytes, workers, _cap(z))
    chunks = [(i, min(n, i + step)) for i in range(0, n, step)]

    def run(c):
        with torch.no_grad():  # grad mode is thread-local: a worker starts with it on
            return fn(*c)

    try:
        if workers == 1 or len(chunks) == 1:
            return [fn(i, j) for i, j in chunks]
        return list(_executor(min(workers, len(chunks))).map(run, chunks))
    finally:
        if release and z.device.type == "cpu" and len(chunks) > 1:
            _release_chunk_scratch()


@functools.lru_cache(maxsize=None)
def _libc_function(name: str, *argtypes: str, restype: Optional[str] = "c_int") -> Optional[Callable]:
    """The C library's ``name`` on Linux, else ``None``.

    ``restype name(argtypes...)`` in ctypes type names; ``restype=None``: void.
    """
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):  # no C library, or not glibc (malloc_trim)
        return None
    fn.argtypes = [getattr(ctypes, t) for t in argtypes]
    fn.restype = None if restype is None else getattr(ctypes, restype)
    return fn


def _malloc_trim() -> Optional[Callable]:
    return _libc_function("malloc_trim", "c_size_t")


@functools.lru_cache(maxsize=None)
def _keep_chunk_scratch_mapped() -> None:
    # glibc returns the free top of a heap to the kernel once it exceeds its
    # trim threshold, which follows the largest mmap'd block freed so far (2x
    # its size; 2x 128 KiB at the start). The chunk temporaries (a few MiB)
    # raise it only to about twice their own size, below one chunk's scratch
    # (up to CPU_CHUNK_SCRATCH_BYTES): each chunk's freed scratch went back to
    # the kernel and the next chunk page-faulted it in again (float32
    # log-prob forward + backward at T=2048, V_local=32000: 150-300 thousand
    # minor faults a call, half its time in the kernel). Freeing one block of
    # CPU_CHUNK_SCRATCH_BYTES (mapped, never touched) moves the thresholds
    # where glibc's own rule puts them after any such block is freed: a
    # worker's chunks then reuse the same pages (12-17 thousand faults; forward
    # 115-145 -> 67-83 ms float32). Once per process; a no-op where glibc's
    # threshold is already higher, and without glibc.
    malloc = _libc_function("malloc", "c_size_t", restype="c_void_p")
    free = _libc_function("free", "c_void_p", restype=None)
    if malloc is not None and free is not None:
        free(malloc(CPU_CHUNK_SCRATCH_BYTES))


def _release_chunk_scratch() -> None:
    # Each worker thread allocates from a glibc arena of its own, and glibc
    # keeps the chunk scratch freed there (its mmap threshold rises to the
    # size of what was freed, so later chunks come from the arenas): the
    # forward's scratch was still resident when the backward allocated the
    # gradient. Called after the forward's statistics (_stats_eager). Peak
    # extra RSS of the eager bfloat16 log-prob forward + backward at T=2048,
    # V_local=32000: 1.90 B, 1.03-1.07 B with it, at no measurable cost in
    # time; trimming after the backward as well gave 1.07-1.10 B and cost
    # 20-35 % (its next pages fault afresh), after every chunk 1.01-1.04 B
    # at 3x the time; MALLOC_ARENA_MAX=1: 1.07-1.21 B. With one worker (the
    # chunks in the calling thread, its arena) the same: float32 1.31-1.35 ->
    # 1.06 B, bfloat16 1.19-1.46 -> 1.11-1.17 B (medians of 6 calls).
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _rows(x, i, j):
    return None if x is None else x[i:j]


def _stats_eager(z, local, owns, keep, tau, with_entropy: bool = True) -> torch.Tensor:
    acc = accumulation_dtype(z, "eager")
    shift = _kept_shift(z, keep)

    # Each chunk's statistics go into one [T, k] buffer, made by the first
    # chunk to finish (k and the dtype come from the spec). A list of
    # per-chunk results (concatenated at the end) kept one small allocation
    # alive per chunk, and with those glibc's heap grew by about one chunk's
    # scratch per chunk, in some processes always, in others never (likely:
    # a result at the heap's top, above its chunk's freed temporaries, so
    # the next chunk's went above it). Eager bfloat16 forward at T=2048,
    # V_local=152064: 0.7-1.9 B of peak RSS, 0.02-0.06 B with the buffer
    # (tests/torch/test_eager_threads.py reproduces it at a small size).
    out = []

    def chunk(i, j):
        st = _stats_stage(z[i:j], local[i:j], owns[i:j], _rows(keep, i, j), tau, acc, with_entropy, shift)
        if shift == "max":
            _redo_marked_rows(st, z[i:j], local[i:j], owns[i:j], keep[i:j], tau, with_entropy)
        if not out:
            with _lock:
                if not out:
                    out.append(st.new_empty((z.shape[0],) + st.shape[1:]))
        out[0][i:j] = st

    _map_chunks(chunk, z, STATS_FRACTION, STATS_SCRATCH_BYTES, release=True)
    return out[0]


def _grad_eager(z, out, local, owns, keep, *row_args) -> None:
    *per_row, tau = row_args
    fraction = INPLACE_FRACTION if out.data_ptr() == z.data_ptr() else GRAD_FRACTION

    def chunk(i, j):
        rows = [_rows(x, i, j) for x in per_row]
        out[i:j] = _grad_stage(z[i:j], local[i:j], owns[i:j], _rows(keep, i, j), *rows, tau)

    _map_chunks(chunk, z, fraction, GRAD_SCRATCH_BYTES)


# --- entry points ----------------------------------------------------------------------


def _eager_tau(tau, temperature):
    # The eager path hands the spec the number 1 rather than a tensor holding
    # 1, and the spec skips that division (exact either way): one op fewer
    # per chunk in the statistics and in the gradient at the common tau = 1
    # (benchmarks/vs_slime.py, T=2048, V_local=32000, separate processes:
    # forward 75-78 -> 68-78 ms float32, 86-92 -> 68-82 ms bfloat16;
    # lp+ent+grad 156-173 -> 140-145 ms float32). The compiled stages keep
    # the tensor (a temperature that changes must not recompile them; they
    # fuse the division anyway).
    return 1 if temperature == 1 else tau


# _ONE_ROW: a shard of one row runs the eager path even when the compiled one
# is selected. Dynamo specialises a size of 1 (it cannot stand for every row
# count), so a one-row call compiled its own graph per stage variant, seconds
# each (5 of the W = 1 table's 35 graphs), for a call that costs microseconds
# either way.


def shard_stats(
    z, local, owns, keep, tau, *, with_entropy: bool = True, impl: Optional[str] = None,
    temperature: Optional[float] = None,
) -> torch.Tensor:
    """``[T, 6]`` statistics ``spec.block_stats`` of the shard ``z [T, V_local]``.

    ``tau`` is a 0-d tensor of the compute dtype; ``with_entropy=False``
    skips the entropy's statistic (see ``spec.block_stats``; the compiled CPU
    stage computes it anyway for :data:`FULL_STATS_CPU_DTYPES`); ``impl`` as in
    :func:`select`; ``temperature``: the same temperature as a Python
    number, when the caller has it (the eager path skips dividing by 1).
    """
    n = z.shape[0]
    if n == 0:
        return torch.zeros((0, spec.N_STATS), dtype=tau.dtype, device=z.device)
    if select(impl) == "compiled" and n > 1:  # one row: eager (see _ONE_ROW)
        shift = _kept_shift(z, keep)
        full = with_entropy or (z.device.type == "cpu" and z.dtype in FULL_STATS_CPU_DTYPES)
        args = (z, local, owns, _mask_arg(keep, z), tau, accumulation_dtype(z), full, shift)
        out, ok = _run_compiled(_stats_stage, args, full)
        if ok:
            if shift == "max":
                _redo_marked_rows(out, z, local, owns, keep, _eager_tau(tau, temperature), with_entropy)
            return out
    return _stats_eager(z, local, owns, keep, _eager_tau(tau, temperature), with_entropy)


def merge(all_stats, valid, tau, *, impl: Optional[str] = None, compiled: Optional[bool] = None) -> tuple:
    """``(comb, logprob, entropy)``: ``spec.reduce_stats`` over the ranks' ``[W, T, 6]`` statistics, finalized.

    ``valid`` is ``[T]`` and ``tau`` the 0-d compute-dtype temperature; the
    outputs are ``[T]``. Compiled, the merge is one region instead of some
    34 eager ops on ``[T]`` vectors: on a GPU each eager op is a kernel
    launch that the CPU issues while the GPU waits for it. ``compiled``:
    ``None`` compiles it off the CPU when ``impl`` selects the compiled
    path. On the CPU the eager ops cost what the compiled region costs
    (0.46 ms per forward + backward at T=64 either way), and compiling it
    added 0.6-1 s to every process's first call (more graphs to trace and
    look up), so there it stays eager unless ``compiled=True`` (the tests).
    """
    if compiled is None:
        compiled = all_stats.device.type != "cpu"
    res = None
    if compiled and select(impl) == "compiled" and all_stats.shape[1] > 0:
        res, _ = _run_compiled(_merge_stage, (all_stats, valid, tau), False, has_keep=False)
    if res is None:
        res = _merge_stage(all_stats, valid, tau)
    return spec.Combined(*res[:6]), res[6], res[7]


def _kept_shift(z, keep) -> str:
    # On CPU the masked statistics shift the kept sum by the overall max (one
    # read of the mask, one exponential with no blended argument; eager: four
    # chunk-sized ops fewer), and the rows that marks are recomputed after a
    # host-side check, which on a GPU would be a synchronisation.
    return "max" if keep is not None and z.device.type == "cpu" else "kept"


def _redo_marked_rows(out, z, local, owns, keep, tau, with_entropy: bool) -> None:
    """Recompute, with ``kept_shift="kept"`` on the eager path, the rows ``kept_shift="max"`` marked.

    CPU only: the marked rows are found with ``nonzero`` on host memory (no
    device to synchronise with). They are rows whose kept max lies more than
    ``spec.KEPT_GAP`` temperature units below the overall max (rare with
    top-k / top-p masks, which keep the argmax) and rows holding NaN (NaN
    again); they are gathered in row chunks of the eager path's size.
    """
    rows = spec.marked_rows(xp, out).nonzero()[:, 0]
    if rows.numel() == 0:
        return
    step = chunk_rows(z.shape[0], z.shape[1], z.element_size(), cap_bytes=_cap(z))
    for idx in rows.split(step):
        out[idx] = _stats_stage(z[idx], local[idx], owns[idx], keep[idx], tau, None, with_entropy).to(out.dtype)


#: Device types whose fresh ``[T, V_local]`` gradient buffers are advised to
#: the kernel as transparent huge pages (``madvise(MADV_HUGEPAGE)``, Linux,
#: buffers of :data:`HUGE_PAGE_MIN_BYTES` or more) before they are written.
#: Empty by default: no advice, the gradient is the compiled stage's own
#: output. Opt in with ``frozenset({"cpu"})``. A fresh buffer's first write
#: faults in every 4 KiB page, which on the 2-core EPYC VM cost more than the
#: gradient's arithmetic (filling a fresh float32 2048 x 32000 buffer: 70 ms,
#: 12 ms advised; ``benchmarks/fresh_buffer.py``), so the op alone, called in
#: a loop of its own, takes 0.5-0.66 of the median time advised. But a huge
#: page that the host has to back again (a VM that reports free 2 MiB blocks
#: to its host) or that the kernel has to compact stalls the write, and in a
#: training-like loop, the logits made by a matmul in the same step, it
#: stalled nearly every call: the whole LM-head step took 1.0-2.9x as long
#: advised (float32 2048 x 256 x 152064: median 8620 against 3515 ms;
#: ``benchmarks/head_step.py``). The gradient is bit-identical either way.
HUGE_PAGE_DEVICES: frozenset = frozenset()

#: Smallest buffer advised. glibc serves requests of 32 MiB or more (its
#: largest dynamic mmap threshold) from a mapping of their own, so the advice
#: never reaches memory that the heap later hands to something else.
HUGE_PAGE_MIN_BYTES = 32 << 20

_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


def _madvise() -> Optional[Callable]:
    return _libc_function("madvise", "c_void_p", "c_size_t", "c_int")


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Advise the 2 MiB-aligned part of ``t``'s memory as huge pages; ``True`` if the kernel took it.

    Only a hint: a refusal (another OS, THP disabled, an old kernel) leaves
    ``t`` as it was. Call it before the first write: pages already touched
    stay small until the kernel's background thread merges them.
    """
    fn = _madvise()
    nbytes = t.numel() * t.element_size()
    if fn is None or t.device.type != "cpu" or nbytes < HUGE_PAGE_MIN_BYTES:
        return False
    huge = 2 << 20
    lo = -(-t.data_ptr() // huge) * huge
    hi = (t.data_ptr() + nbytes) // huge * huge
    return hi > lo and fn(lo, hi - lo, _MADV_HUGEPAGE) == 0


def _fresh_grad(z: torch.Tensor) -> torch.Tensor:
    out = torch.empty(z.shape, dtype=z.dtype, device=z.device)
    if z.device.type in HUGE_PAGE_DEVICES:
        advise_huge_pages(out)
    return out


def shard_grad(
    z, local, owns, keep, M, log_s, c, mk, log_sk, valid, gl, ge, tau, *, inplace: bool = False,
    impl: Optional[str] = None, temperature: Optional[float] = None,
):
    """Gradient ``spec.block_grad`` of the shard ``z [T, V_local]``, in ``z.dtype``.

    ``M, log_s, c, mk, log_sk``: the finalized statistics (``c`` may be
    ``None`` with ``ge`` ``None``: no entropy term); ``valid, gl, ge``:
    ``[T]``; ``tau``: 0-d tensor of the compute dtype. ``inplace=True``
    writes the gradient into ``z`` itself (``z`` must be contiguous) and
    returns ``z``. ``temperature``: as in :func:`shard_stats`.
    """
    n = z.shape[0]
    if n == 0:
        return z if inplace else torch.empty_like(z, memory_format=torch.contiguous_format)
    args = (z, local, owns, keep, M, log_s, c, mk, log_sk, valid, gl, ge, tau)
    # the output buffer: z itself, or one advised before its first write (HUGE_PAGE_DEVICES, opt-in),
    # which the eager path reuses if compiling fails; None: the compiled stage allocates its own
    out = z if inplace else _fresh_grad(z) if z.device.type in HUGE_PAGE_DEVICES else None
    if select(impl) == "compiled" and n > 1:  # one row: eager (see _ONE_ROW)
        stage_args = (z, local, owns, _mask_arg(keep, z)) + args[4:]
        if out is None:
            out, ok = _run_compiled(_grad_stage, stage_args, ge is not None)
        elif inplace:
            _, ok = _run_compiled(_grad_inplace_stage, stage_args, ge is not None)
        else:
            _, ok = _run_compiled(_grad_into_stage, stage_args + (out,), ge is not None)
        if ok:
            return out
    if out is None:
        out = _fresh_grad(z)
    _grad_eager(z, out, *args[1:-1], _eager_tau(tau, temperature))
    return out


# --- block-level entry points (the fused LM-head op) -----------------------------------
#
# The fused op (dualvp_torch/linear.py) forms one float32 logits block
# ``z = h_i W_j^T`` at a time and runs the spec on it: ``spec.block_stats``
# with ``start=`` the block's first column in the shard, and ``spec.block_grad``
# written over the block itself (the block is the op's own scratch, so the
# gradient ``G`` takes its storage: no second block-sized buffer). The block is
# already sized to the op's memory budget, so the eager path runs each stage on
# the whole block (no row chunks here: the op counts BLOCK_SCRATCH_BYTES per
# element into its tile size instead). ``start`` is a Python int; with
# ``dynamic=True`` it is traced as a symbolic int, so new block offsets do not
# recompile.

__all__ += ["BLOCK_SCRATCH_BYTES", "block_stats", "block_grad_"]

#: The eager path's temporaries per block element, in bytes, for either stage
#: (the larger of the measured :data:`STATS_SCRATCH_BYTES` and
#: :data:`GRAD_SCRATCH_BYTES`; the in-place gradient writes no separate output).
BLOCK_SCRATCH_BYTES = max(STATS_SCRATCH_BYTES, GRAD_SCRATCH_BYTES)


def _block_stats_stage(z, local, owns, keep: Optional[torch.Tensor], tau, start, acc_dtype=None):
    return spec.block_stats(xp, z, local, owns, keep, tau, start=start, dtype=tau.dtype, acc_dtype=acc_dtype)


def _block_grad_inplace_stage(
    z, local, owns, keep: Optional[torch.Tensor], M, log_s, c, mk, log_sk, valid, gl, ge, tau, start
):
    comb = spec.Combined(M=M, log_s=log_s, c=c, mk=mk, log_sk=log_sk, zy=None)
    g = spec.block_grad(xp, z, local, owns, keep, comb, valid, gl, ge, tau, start=start, dtype=tau.dtype)
    z.copy_(xp.astype(g, z.dtype))


def block_stats(z, local, owns, keep, tau, *, start: int = 0, impl: Optional[str] = None) -> torch.Tensor:
    """``[n, 6]`` statistics ``spec.block_stats`` of the block ``z [n, b]`` = columns ``[start, start + b)``.

    ``local, owns``: ``[n]`` from ``spec.target_to_local`` (columns within the
    *shard*); ``keep``: ``[n, b]`` bool or ``None``; ``tau``: 0-d tensor of
    the compute dtype; ``impl`` as in :func:`select`.
    """
    if z.shape[0] == 0:
        return torch.zeros((0, spec.N_STATS), dtype=tau.dtype, device=z.device)
    args = (z, local, owns, keep, tau, int(start))
    if select(impl) == "compiled":
        out, ok = _run_compiled(_block_stats_stage, args + (accumulation_dtype(z, "compiled"),), False)
        if ok:
            return out
    return _block_stats_stage(*args, accumulation_dtype(z, "eager"))


def block_grad_(
    z, local, owns, keep, M, log_s, c, mk, log_sk, valid, gl, ge, tau, *, start: int = 0,
    impl: Optional[str] = None,
) -> torch.Tensor:
    """Write ``spec.block_grad`` of the block ``z [n, b]`` (columns ``[start, start + b)``) over ``z``; return ``z``.

    ``z`` must be contiguous and is typically a float32 scratch block; the
    other arguments as in :func:`shard_grad` (rows of this block only).
    """
    if z.shape[0] == 0:
        return z
    args = (z, local, owns, keep, M, log_s, c, mk, log_sk, valid, gl, ge, tau, int(start))
    if select(impl) == "compiled":
        _, ok = _run_compiled(_block_grad_inplace_stage, args, ge is not None)
        if ok:
            return z
    _block_grad_inplace_stage(*args)
    return z
