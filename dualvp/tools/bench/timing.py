"""How ``dualvp bench`` (and the scripts in ``benchmarks/``) time and measure one forward + backward.

:func:`measure` is the one timing loop. For a ``step`` (forward, backward)
it reports, with ``B`` the bytes of the input the op reads:

* ``first_ms``: the first call (compilation, tracing, warm-up), apart;
  then ``warmup`` untimed calls and the ``reps`` timed calls; the queued
  loop and the profile below come last;
* ``wall_ms``, ``fwd_ms``, ``bwd_ms``: medians over ``reps`` calls, each
  clock read preceded by ``sync()`` (on a GPU: the queued work is inside the
  interval it belongs to);
* ``peak_extra_B``: the largest peak extra memory of those calls
  (:class:`PeakRSS` on a CPU, :class:`CudaPeak` on a GPU) over ``B``;
* ``host_us``: process CPU time per call of a loop of ``loop`` calls queued
  without synchronisation (the host work a training step pays per call);
  ``queued_ms``: wall time per call of that loop, the queue drained at its
  end (CUDA events on a GPU). The loop includes ``clear()`` (for an op whose
  gradient overwrites its input: the copy that makes the next input). A JAX
  step blocks on its results, so its loop is not queued;
* on a GPU, ``kernel_ms`` and ``launches``: the summed device time and the
  number of device activities (kernels, copies, memsets) per call, from
  ``torch.profiler`` over ``profiled`` calls (:func:`cuda_profile`).

:func:`copy_bandwidth` measures the device's copy bandwidth in the same run,
which sets the floor: ``floor_ms = 3 B / bandwidth`` (a read in the forward,
a read and a gradient write in the backward), plus the keep mask's bytes
twice when a mode reads it.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import statistics
import time
from typing import Any, Callable, Optional

__all__ = ["PeakRSS", "CudaPeak", "NoPeak", "measure", "cuda_profile", "copy_bandwidth", "floor_ms", "trim"]


# --------------------------------------------------------------------------- memory


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


_libc: Any = None


def trim() -> None:
    """``gc.collect()`` and glibc's ``malloc_trim(0)``: freed memory leaves the RSS before a measurement."""
    global _libc
    gc.collect()
    try:
        if _libc is None:
            _libc = ctypes.CDLL("libc.so.6")
        _libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRSS:
    """Peak extra RSS of a block: ``VmHWM`` after minus ``VmRSS`` before.

    The high-water mark is reset through ``/proc/self/clear_refs`` (value
    5); where that is not writable, a thread samples ``/proc/self/statm``
    every millisecond instead (it can miss short peaks).
    """

    method: Optional[str] = None

    def __enter__(self):
        trim()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            PeakRSS.method = "VmHWM-reset"
            self._sampler = None
        except OSError:
            PeakRSS.method = "statm-sampling-1ms"
            self._sampler = _Sampler()
        self.before = _status_kb("VmRSS") * 1024
        if self._sampler:
            self._sampler.start()
        return self

    def __exit__(self, *exc):
        self.peak = self._sampler.stop() if self._sampler else _status_kb("VmHWM") * 1024
        self.extra = max(0, self.peak - self.before)
        return False


class _Sampler:
    def __init__(self):
        import threading

        self._stop = threading.Event()
        self._peak = 0
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._t = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self._read())
            time.sleep(0.001)

    def start(self) -> None:
        self._peak = self._read()
        self._t.start()

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return max(self._peak, self._read())


class CudaPeak:
    """Peak extra CUDA memory of a block: ``max_memory_allocated`` after minus ``memory_allocated`` before.

    The caching allocator's peak is reset on entry, after a synchronize (no
    earlier kernel is still freeing); the exit synchronizes before it reads.
    """

    method = "cuda-max_memory_allocated"

    def __init__(self, torch):
        self.torch = torch

    def __enter__(self):
        gc.collect()
        self.torch.cuda.synchronize()
        self.before = self.torch.cuda.memory_allocated()
        self.torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc):
        self.torch.cuda.synchronize()
        self.peak = self.torch.cuda.max_memory_allocated()
        self.extra = max(0, self.peak - self.before)
        return False


class NoPeak:
    """No memory measurement (JAX on a GPU: XLA's peak counter cannot be reset between calls)."""

    method = "not measured"
    extra = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --------------------------------------------------------------------------- time


def cuda_profile(torch, call: Callable[[], None], calls: int,
                 clear: Callable[[], None] = lambda: None) -> tuple[float, float]:
    """``(kernel_ms, launches)`` per call: the device time and the number of device activities
    (kernels, copies, memsets) of ``call()`` under ``torch.profiler``, averaged over ``calls`` calls,
    each profiled on its own with ``clear()`` before it, outside the profile."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.autograd.DeviceType.CUDA
    total_ns = count = 0
    for _ in range(calls):
        clear()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        dev = [e for e in prof.profiler.kineto_results.events() if e.device_type() == cuda]
        total_ns += sum(e.duration_ns() for e in dev)
        count += len(dev)
    clear()
    return total_ns / 1e6 / calls, count / calls


def _median_ms(xs: list) -> Optional[float]:
    return statistics.median(xs) * 1e3 if xs else None


def measure(step: Callable, clear: Callable[[], None], B: int, *, reps: int, warmup: int = 0,
            loop: int = 5, sync: Optional[Callable[[], None]] = None, peak: Callable = PeakRSS,
            fast_step: Optional[Callable] = None, torch=None, profiled: int = 0,
            between: Callable[[], None] = lambda: None, counter=None,
            snapshot: Optional[Callable[[Any], Any]] = None) -> tuple[dict, Any]:
    """Time and measure ``step`` (see the module docstring); returns ``(record, kept)``.

    ``kept``: ``snapshot(outputs)`` of the last timed call, taken before
    ``clear()`` (the caller's copy of what it judges: outputs, gradient), or
    the outputs themselves without ``snapshot``.

    The record also has ``times_ms`` (each timed call) and ``spans`` (each
    timed call's start and end, seconds since the epoch: comparable across
    processes).

    ``step`` is ``(fwd, bwd)``: ``out = fwd()``, then ``bwd(out)``; ``clear()``
    runs after each call (drops the gradient, makes fresh non-leaf inputs).
    ``fast_step`` (default ``step``) is what the queued loop runs (the op
    with ``validate=False``). ``torch`` with ``profiled > 0``: the CUDA
    profile (:func:`cuda_profile`). ``between()`` runs before each timed
    call (an interleaved run hands the turn on there). ``counter``: a
    collectives counter (``.on``, ``.take()``), read over one extra call.
    """
    fwd, bwd = step
    ffwd, fbwd = fast_step or step

    def clock() -> float:
        if sync is not None:
            sync()
        return time.perf_counter()

    t0 = clock()
    out = fwd()
    t1 = clock()
    bwd(out)
    t2 = clock()
    del out
    clear()
    rec: dict = {"first_ms": (t2 - t0) * 1e3}
    for _ in range(warmup):
        bwd(fwd())
        clear()
    if counter is not None:
        counter.on = True
        out = fwd()
        cf = counter.take()
        bwd(out)
        cb = counter.take()
        counter.on = False
        del out
        clear()
        rec["collectives"] = {"fwd": cf, "bwd": cb}

    # the timed calls right after the warm-up; what the last one left is kept for the error check
    tf, tb, tfb, peaks, spans = [], [], [], [], []
    out = None
    method = None
    for _ in range(max(1, reps)):
        if out is not None:
            del out
            clear()
        between()
        with peak() as pk:
            t0 = clock()
            e0 = time.time()
            out = fwd()
            t1 = clock()
            bwd(out)
            t2 = clock()
            spans.append((e0, time.time()))
        tf.append(t1 - t0)
        tb.append(t2 - t1)
        tfb.append(t2 - t0)
        peaks.append(pk.extra)
        method = pk.method
    rec.update(fwd_ms=_median_ms(tf), bwd_ms=_median_ms(tb), wall_ms=_median_ms(tfb), reps=len(tfb),
               times_ms=[t * 1e3 for t in tfb], spans=spans, memory_method=method,
               peak_extra_B=None if None in peaks else max(peaks) / B)
    kept = snapshot(out) if snapshot is not None else out
    del out
    clear()

    def fast_call():
        fbwd(ffwd())
        clear()

    fast_call()  # a fast_step that is not step compiles here, outside the loop
    if sync is not None:
        sync()
    events = None
    if torch is not None and profiled:
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record()
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(max(1, loop)):
        fast_call()
    c1 = time.process_time()
    if events is not None:
        events[1].record()
    if sync is not None:
        sync()
    w1 = time.perf_counter()
    n = max(1, loop)
    rec["host_us"] = (c1 - c0) / n * 1e6
    rec["queued_ms"] = events[0].elapsed_time(events[1]) / n if events is not None else (w1 - w0) / n * 1e3
    if torch is not None and profiled:
        rec["kernel_ms"], rec["launches"] = cuda_profile(torch, lambda: fbwd(ffwd()), profiled, clear)
    return rec, kept


# --------------------------------------------------------------------------- floor


def copy_bandwidth(device: str = "cpu", nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Bytes per second of a large on-device copy (bytes read plus bytes written), best of ``reps``.

    CUDA: ``nbytes`` (default 1 GiB) copied by ``Tensor.copy_`` between
    two device buffers, timed with CUDA events. CPU: a quarter of that, with
    torch's threads (NumPy's single-threaded copy where torch is missing).
    """
    if device == "cuda":
        import torch

        a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        b.copy_(a)
        best = float("inf")
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            b.copy_(a)
            e.record()
            e.synchronize()
            best = min(best, s.elapsed_time(e) / 1e3)
        del a, b
        torch.cuda.empty_cache()
        return 2 * nbytes / best
    nbytes //= 4
    try:
        import torch

        src = torch.ones(nbytes, dtype=torch.uint8)
        copy = torch.empty_like(src).copy_
    except ImportError:
        import numpy as np

        src = np.ones(nbytes, dtype=np.uint8)
        copy = functools.partial(np.copyto, np.empty_like(src))
    copy(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        copy(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def floor_ms(B: int, bandwidth: float, mask_bytes: int = 0) -> float:
    """``3 B`` (forward read, backward read, gradient write) plus the mask's bytes twice, at ``bandwidth``."""
    return (3 * B + 2 * mask_bytes) / bandwidth * 1e3
