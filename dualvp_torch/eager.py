"""The eager path: the spec stages run op by op over row chunks, for environments without a compiler.

Without a keep mask the stages run in their torch forms (:mod:`dualvp_torch.eager_forms`: the same
spec functions in fewer aten ops, two scratch buffers per stage shared by the chunks); with one, the
spec's own functions over torch (:mod:`dualvp_torch.stages`).

A chunk holds :func:`chunk_rows` rows, sized from a memory budget: the
temporaries of the chunks in flight (at most :data:`STATS_SCRATCH_BYTES` /
:data:`GRAD_SCRATCH_BYTES` bytes per chunk element) stay within a fraction of
the shard's bytes ``B``: :data:`STATS_FRACTION` in the forward (nothing else
is alive then), :data:`GRAD_FRACTION` next to a fresh gradient buffer (peak
``<= 1.1 B``), :data:`INPLACE_FRACTION` for the in-place gradient (``<= 0.05
B``); on CPU one chunk's scratch also stays within
``Tuning.cpu_chunk_scratch_bytes``; and a chunk has at least
:data:`MIN_CHUNK_ELEMENTS` elements, so that tiny shards do not run one row at
a time. Row sums accumulate in float32 (eager torch sums are cascaded).

On CPU the chunks run in parallel on up to ``torch.get_num_threads()`` worker
threads (at most ``Tuning.max_eager_workers``), each running its ops
single-threaded; the caller's thread settings are unchanged
(docs/decisions.md, "Eager chunks on single-threaded workers").
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch

from dualvp import spec

from . import eager_forms, host_memory, stages, tuning

__all__ = [
    "STATS_SCRATCH_BYTES",
    "GRAD_SCRATCH_BYTES",
    "STATS_FRACTION",
    "GRAD_FRACTION",
    "INPLACE_FRACTION",
    "MIN_CHUNK_ELEMENTS",
    "SMALL_SHARD_ELEMENTS",
    "SMALL_CHUNK_ELEMENTS",
    "FORM_SMALL_CHUNK_ELEMENTS",
    "chunk_rows",
    "stats",
    "grad",
    "redo_marked_rows",
]

#: Upper bound of the spec's live temporaries per chunk element, in bytes, for
#: the statistics (the profiler's allocation trace at the peak, chunks in the
#: calling thread, float32 and bfloat16 input, with and without a mask and
#: the entropy) ...
STATS_SCRATCH_BYTES = 28
#: ... and for the gradient, its output chunk included
#: (tests/torch/test_logits_memory.py holds the resulting peaks).
GRAD_SCRATCH_BYTES = 44
#: The chunks' scratch in the forward, as a fraction of the shard's bytes.
STATS_FRACTION = 0.5
#: ... in the in-place gradient.
INPLACE_FRACTION = 0.04
#: ... and next to a fresh gradient buffer (the backward's peak is then <= 1.1 B).
GRAD_FRACTION = 0.09
#: ... but a chunk has at least this many elements (or all rows).
MIN_CHUNK_ELEMENTS = 1 << 12
#: A shard of at most this many elements runs in the calling thread in
#: chunks of :data:`SMALL_CHUNK_ELEMENTS`, whatever the fractions above: its
#: scratch is cache-sized (at most 5.5 MiB), and at such sizes the per-chunk
#: cost (a thread hand-off, some 25 small ops) of 2-row chunks dominated the
#: call (docs/decisions.md, "Small shards in the calling thread").
SMALL_SHARD_ELEMENTS = 1 << 17
#: ATen's grain (``at::internal::GRAIN_SIZE``): a CPU reduction splits a row between threads only when
#: the row is longer than this (see :func:`_split_rows_possible`).
ATEN_GRAIN = 32768
#: ... chunks whose temporaries (256 KiB in float32) glibc recycles
#: without faulting their pages in again, where a whole-shard chunk's did.
SMALL_CHUNK_ELEMENTS = 1 << 16
#: ... but the torch forms of the unmasked stages (:mod:`dualvp_torch.eager_forms`) run such a shard as one
#: chunk: their two scratch buffers are made once per stage, and a chunk costs ~20 aten ops.
FORM_SMALL_CHUNK_ELEMENTS = SMALL_SHARD_ELEMENTS


def chunk_rows(
    n_rows: int, v_local: int, itemsize: int = 4, fraction: float = STATS_FRACTION,
    scratch_bytes: int = STATS_SCRATCH_BYTES, workers: int = 1, cap_bytes: Optional[int] = None,
    small_chunk: int = SMALL_CHUNK_ELEMENTS,
) -> int:
    """Rows per chunk (at least 1, at most ``n_rows``).

    ``workers * scratch_bytes * rows * v_local <= fraction * n_rows * v_local
    * itemsize`` (the temporaries of the chunks in flight are that fraction
    of the shard's bytes) and, when ``cap_bytes`` is given (on CPU:
    ``Tuning.cpu_chunk_scratch_bytes``), ``scratch_bytes * rows * v_local <=
    cap_bytes``; but at least :data:`MIN_CHUNK_ELEMENTS` elements per chunk;
    for a shard of at most :data:`SMALL_SHARD_ELEMENTS` elements,
    ``small_chunk`` (:data:`SMALL_CHUNK_ELEMENTS`) per chunk instead.
    """
    v = max(1, v_local)
    if n_rows * v <= SMALL_SHARD_ELEMENTS:
        return max(1, min(n_rows, small_chunk // v))
    budget = int(fraction * n_rows * itemsize / (scratch_bytes * max(1, workers)))
    if cap_bytes is not None:
        budget = min(budget, cap_bytes // (scratch_bytes * v))
    return max(1, min(n_rows, max(budget, MIN_CHUNK_ELEMENTS // v)))


def _cap(z: torch.Tensor, setting: tuning.Tuning) -> Optional[int]:
    # On CPU a chunk's temporaries stay small enough to stay in cache between
    # the spec's ops instead of being page-faulted afresh
    # (docs/decisions.md, "Eager CPU chunks within a cache-sized bound").
    return setting.cpu_chunk_scratch_bytes if z.device.type == "cpu" else None


# --- worker threads --------------------------------------------------------------------
#
# On CPU one chunk runs per worker thread, each worker's ops single-threaded,
# instead of one chunk at a time with every op split over torch's intra-op
# threads: the spec's ops are small at chunk size, and an intra-op team pays a
# barrier per op, which under CPU contention waits for a descheduled thread.
# Independent chunks need no barrier.

_pool: dict = {}
_lock = threading.Lock()


def _set_threads(n: int, barrier: Optional[threading.Barrier] = None) -> None:
    # ATen's OpenMP backend initialises a thread's team size from the
    # process-wide count at the thread's first parallel op (a thread-local
    # lazy init); a set_num_threads before that init is undone by it (the
    # workers then ran every op on the caller's thread count, and a row split
    # between threads got other bits). get_num_threads() runs the init first.
    torch.get_num_threads()
    torch.set_num_threads(n)
    if barrier is not None:
        barrier.wait()


def _workers(z: torch.Tensor, n_chunks_max: int, setting: tuning.Tuning) -> int:
    if z.device.type != "cpu" or z.numel() <= SMALL_SHARD_ELEMENTS:
        return 1  # kernel launches are asynchronous; one host thread suffices (a small shard: see above)
    return max(1, min(torch.get_num_threads(), setting.max_eager_workers, n_chunks_max))


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


def _split_rows_possible(z: torch.Tensor, setting: tuning.Tuning) -> bool:
    # Batch invariance: a CPU reduction over a few rows with more than one
    # intra-op thread splits each row between the threads (TensorIterator
    # parallelises the reduced dimension when the outputs are fewer than the
    # threads' grain), so a row of a small call was summed in another order
    # than the same row in a large one (V_local = 40000: entropy 2 ulp
    # apart). On CPU with several intra-op threads every chunk therefore runs
    # on the single-threaded workers, one chunk included: each row is summed
    # in one thread, in the order the row's length alone decides.
    # ATen splits no row narrower than its grain (at::internal::GRAIN_SIZE): such shards (small ones
    # included: docs/decisions.md, "Small shards in the calling thread") stay in the calling thread.
    # ``Tuning(max_eager_workers=1)`` keeps the chunks in the calling thread
    # (where the profiler sees their allocations: tests/torch/test_logits_memory.py),
    # and with it this guarantee only for rows narrower than ATen's grain.
    return (z.device.type == "cpu" and z.shape[-1] > ATEN_GRAIN and torch.get_num_threads() > 1
            and setting.max_eager_workers > 1)


def _map_chunks(
    fn: Callable, z: torch.Tensor, fraction: float, scratch_bytes: int, setting: tuning.Tuning,
    release: bool = False, bufs: Optional[int] = None, small_chunk: int = SMALL_CHUNK_ELEMENTS,
) -> list:
    """``fn(i, j)`` over the row chunks ``[i, j)``; with ``bufs`` given, ``fn(i, j, b)`` where ``b`` is that many
    scratch buffers of a chunk's size shared by the chunks in the calling thread, or None on the workers."""
    n, v = z.shape
    workers = _workers(z, n, setting)
    glibc = setting.glibc_heap and z.device.type == "cpu"
    if glibc:
        host_memory.keep_chunk_scratch_mapped(setting.cpu_chunk_scratch_bytes)
    step = chunk_rows(n, v, z.element_size(), fraction, scratch_bytes, workers, _cap(z, setting), small_chunk)
    chunks = [(i, min(n, i + step)) for i in range(0, n, step)]

    def run(c):
        with torch.no_grad():  # grad mode is thread-local: a worker starts with it on
            return fn(*c)

    try:
        if not _split_rows_possible(z, setting):
            if bufs is not None:
                b = eager_forms.scratch(min(n, step), v, stages.compute_dtype(z.dtype), z.device, bufs)
                return [fn(i, j, b) for i, j in chunks]
            return [fn(i, j) for i, j in chunks]
        if bufs is not None:
            return list(_executor(min(workers, len(chunks))).map(run, [c + (None,) for c in chunks]))
        return list(_executor(min(workers, len(chunks))).map(run, chunks))
    finally:
        if release and glibc and len(chunks) > 1:
            host_memory.release_chunk_scratch()


# --- the stages over row chunks --------------------------------------------------------


def _rows(x, i, j):
    return None if x is None else x[i:j]


def stats(z, local, owns, keep, tau, with_entropy: bool = True) -> torch.Tensor:
    """``[T, 6]`` statistics of the shard, chunk by chunk (``tau``: a 0-d tensor or the number 1)."""
    setting = tuning.current()
    if keep is None:
        return _stats_unmasked(z, local, owns, tau, with_entropy, setting)
    shift = stages.kept_shift(z, keep)
    n, v = z.shape
    if n <= chunk_rows(n, v, z.element_size(), STATS_FRACTION, STATS_SCRATCH_BYTES, _workers(z, n, setting),
                       _cap(z, setting)) and not _split_rows_possible(z, setting):
        # One chunk in the calling thread: the stage's own output, no buffer, no copy (as grad below).
        if setting.glibc_heap and z.device.type == "cpu":
            host_memory.keep_chunk_scratch_mapped(setting.cpu_chunk_scratch_bytes)
        st = stages.stats_stage(z, local, owns, keep, tau, None, with_entropy, shift)
        if shift == "max":
            redo_marked_rows(st, z, local, owns, keep, tau, with_entropy, setting)
        return st

    # Each chunk's statistics go into one [T, k] buffer, made by the first
    # chunk to finish (k and the dtype come from the spec). A list of
    # per-chunk results, concatenated at the end, kept one small allocation
    # alive per chunk, and glibc's heap then grew by about one chunk's
    # scratch per chunk (tests/torch/test_eager_path.py reproduces it).
    out = []

    def chunk(i, j):
        st = stages.stats_stage(z[i:j], local[i:j], owns[i:j], _rows(keep, i, j), tau, None, with_entropy, shift)
        if shift == "max":
            redo_marked_rows(st, z[i:j], local[i:j], owns[i:j], keep[i:j], tau, with_entropy, setting)
        if not out:
            with _lock:
                if not out:
                    out.append(st.new_empty((z.shape[0],) + st.shape[1:]))
        out[0][i:j] = st

    _map_chunks(chunk, z, STATS_FRACTION, STATS_SCRATCH_BYTES, setting, release=True)
    return out[0]


def _stats_unmasked(z, local, owns, tau, with_entropy: bool, setting: tuning.Tuning) -> torch.Tensor:
    # spec.block_stats without a mask in its torch form (dualvp_torch.eager_forms): bit for bit the same
    n, v = z.shape
    out = torch.empty((n, spec.N_STATS), dtype=stages.compute_dtype(z.dtype), device=z.device)
    glibc = setting.glibc_heap and z.device.type == "cpu"
    if not glibc and not _split_rows_possible(z, setting) and n <= chunk_rows(
            n, v, z.element_size(), STATS_FRACTION, STATS_SCRATCH_BYTES, _workers(z, n, setting), _cap(z, setting),
            FORM_SMALL_CHUNK_ELEMENTS):  # one chunk in the calling thread (as _map_chunks would run it)
        eager_forms.stats_rows(z, out, tau, with_entropy)
        return eager_forms.finish_stats(out, z, local, owns)

    def chunk(i, j, bufs):
        eager_forms.stats_rows(z[i:j], out[i:j], tau, with_entropy, bufs)

    _map_chunks(chunk, z, STATS_FRACTION, STATS_SCRATCH_BYTES, setting, release=True, bufs=2,
                small_chunk=FORM_SMALL_CHUNK_ELEMENTS)
    return eager_forms.finish_stats(out, z, local, owns)


def _grad_unmasked(z, out, local, owns, M, log_s, c, valid, gl, ge, tau, setting: tuning.Tuning) -> torch.Tensor:
    # spec.block_grad without a mask in its torch form (dualvp_torch.eager_forms)
    coef = eager_forms.grad_coefficients(M, log_s, c, valid, owns, gl, ge, tau)
    inplace = out is not None and out.data_ptr() == z.data_ptr()
    fraction = INPLACE_FRACTION if inplace else GRAD_FRACTION
    n, v = z.shape
    step = chunk_rows(n, v, z.element_size(), fraction, GRAD_SCRATCH_BYTES, _workers(z, n, setting), _cap(z, setting),
                      FORM_SMALL_CHUNK_ELEMENTS)
    if out is None and n <= step and not _split_rows_possible(z, setting):
        return eager_forms.grad_rows(z, None, local, valid, coef, tau)  # one chunk: its own output
    if out is None:
        out = torch.empty(z.shape, dtype=z.dtype, device=z.device)

    def chunk(i, j, bufs):
        eager_forms.grad_rows(z[i:j], out[i:j], local[i:j], valid[i:j], [_rows(x, i, j) for x in coef], tau, bufs)

    nbuf = eager_forms.grad_buffers(z.dtype, log_s.dtype, ge is not None)
    _map_chunks(chunk, z, fraction, GRAD_SCRATCH_BYTES, setting, bufs=nbuf,
                small_chunk=FORM_SMALL_CHUNK_ELEMENTS)
    return out


def grad(z, out, local, owns, keep, *row_args) -> torch.Tensor:
    """The shard's gradient, chunk by chunk, written into ``out`` (``z`` itself for the in-place gradient).

    ``out=None``: a fresh gradient (a shard of one chunk: the stage's own
    output, no copy). ``row_args``: ``M, log_s, c, mk, log_sk, valid, gl,
    ge, tau`` as in :func:`dualvp_torch.engines.shard_grad`.
    """
    setting = tuning.current()
    *per_row, tau = row_args
    if keep is None:
        M, log_s, c, mk, log_sk, valid, gl, ge = per_row
        return _grad_unmasked(z, out, local, owns, M, log_s, c, valid, gl, ge, tau, setting)
    inplace = out is not None and out.data_ptr() == z.data_ptr()
    fraction = INPLACE_FRACTION if inplace else GRAD_FRACTION
    n, v = z.shape
    if out is None and n <= chunk_rows(n, v, z.element_size(), fraction, GRAD_SCRATCH_BYTES, _workers(z, n, setting),
                                       _cap(z, setting)) and not _split_rows_possible(z, setting):
        return stages.grad_stage(z, local, owns, keep, *per_row, tau)
    if out is None:
        out = torch.empty(z.shape, dtype=z.dtype, device=z.device)

    def chunk(i, j):
        rows = [_rows(x, i, j) for x in per_row]
        out[i:j] = stages.grad_stage(z[i:j], local[i:j], owns[i:j], _rows(keep, i, j), *rows, tau)

    _map_chunks(chunk, z, fraction, GRAD_SCRATCH_BYTES, setting)
    return out


def redo_marked_rows(out, z, local, owns, keep, tau, with_entropy: bool, setting: Optional[tuning.Tuning] = None):
    """Recompute with ``kept_shift="kept"`` the rows that ``kept_shift="max"`` marked in ``out``.

    CPU only: the marked rows are found with ``nonzero`` on host memory (no
    device to synchronise with). They are rows whose kept max lies more than
    ``spec.KEPT_GAP`` temperature units below the overall max (rare with
    top-k / top-p masks, which keep the argmax) and rows holding NaN (NaN
    again); they are gathered in row chunks of the eager path's size.
    """
    rows = spec.marked_rows(stages.xp, out).nonzero()[:, 0]
    if rows.numel() == 0:
        return
    setting = setting or tuning.current()
    step = chunk_rows(z.shape[0], z.shape[1], z.element_size(), cap_bytes=_cap(z, setting))
    def redo(idx):
        with torch.no_grad():
            out[idx] = stages.stats_stage(z[idx], local[idx], owns[idx], keep[idx], tau, None,
                                          with_entropy).to(out.dtype)

    for idx in rows.split(step):
        if _split_rows_possible(z, setting):  # on a single-threaded worker (see _split_rows_possible)
            _executor(1).submit(redo, idx).result()
        else:
            redo(idx)
