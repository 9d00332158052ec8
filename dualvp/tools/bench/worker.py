"""One subprocess of ``dualvp bench``: one implementation, one (size, dtype).

Run as ``python -m dualvp.tools.bench.worker JOB.json``. The parent
(:mod:`dualvp.tools.bench.driver`) writes the inputs (``logits.npy`` rounded to
the dtype and stored as float32, ``target.npy``, ``keep.npy``, ``gl.npy``,
``gh.npy``) into a data directory and a job file naming the implementation
(a key of :data:`dualvp.tools.bench.implementations.IMPLS`), the modes and the
repetitions. For each mode the worker:

1. calls forward and backward once and times it (the *first call*: compile /
   trace / warm-up, reported apart);
2. runs ``warmup`` untimed calls, then ``reps`` timed calls, forward and
   backward timed separately (wall clock, ``time.perf_counter``; the process
   CPU time of forward+backward is recorded too, as it is less sensitive to
   other work on a shared machine); in an interleaved run (:class:`Turns`)
   the worker lets the other implementations run one call before each timed
   call;
3. measures, on each timed call, the peak extra resident memory of the
   forward+backward (the maximum over the calls is reported): inputs
   allocated and touched, previous gradients freed, ``gc.collect()`` and
   ``malloc_trim(0)``, then the kernel's peak-RSS counter is reset
   (``echo 5 > /proc/self/clear_refs``); the peak is ``VmHWM`` read from
   ``/proc/self/status`` after the call, minus ``VmRSS`` just before it. The
   gradient the call returns is part of the peak (it is live memory the op
   allocates);
4. writes the log-prob, the entropy and the first ``err_rows`` rows of the
   gradient to ``out_<i>.npz`` for the parent, which compares them with the
   float64 oracle.

Each line printed to stdout that starts with ``@@`` is a JSON progress record
for the parent; everything else is passed through as log.

With ``"device": "cuda"`` in the job the torch loop puts the inputs on the
GPU, calls ``torch.cuda.synchronize()`` before it reads each timer, and
measures memory with :class:`CudaPeak` (``torch.cuda.reset_peak_memory_stats``,
then ``max_memory_allocated`` after the call minus ``memory_allocated``
before it) instead of the RSS; the JAX loop runs on JAX's default device
(the parent sets ``JAX_PLATFORMS``), which blocks on its results already, and
reports no memory on a GPU (XLA's peak counter cannot be reset).

With ``world > 1`` the worker is one rank of a gloo group (rank, world and port
in the job): it takes its contiguous vocab shard, and counts the collectives
issued per forward and per backward by wrapping the ``torch.distributed``
collective functions.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import resource
import statistics
import sys
import time
import traceback
from typing import Any, Optional

import numpy as np

from .implementations import IMPLS, MODES, Context

def emit(kind: str, **kw) -> None:
    print("@@" + json.dumps({"kind": kind, **kw}), flush=True)


class Turns:
    """This worker's turns in an interleaved run (``"interleave": true`` in the job).

    The driver starts every implementation of a (size, dtype) at once and
    hands a turn to one worker at a time (a line on its stdin); the worker
    ends it with a ``yield`` record. A worker's first turn covers its start
    (imports, inputs, the first calls of the first mode); after that it
    yields before every timed call (:meth:`between`), so the timed calls of
    the implementations alternate and no two workers compute at once. Off
    (the default): every method returns at once.
    """

    def __init__(self, on: bool = False):
        self.on = on

    def take(self) -> None:
        """Block until the driver hands this worker the turn."""
        if self.on and not sys.stdin.readline():
            raise RuntimeError("interleave: the bench driver closed this worker's turns")

    def between(self) -> None:
        """End this turn and wait for the next."""
        if self.on:
            emit("yield")
            self.take()


_TURNS = Turns()


# --------------------------------------------------------------------------- memory


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


_libc = None


def _trim() -> None:
    global _libc
    gc.collect()
    try:
        if _libc is None:
            _libc = ctypes.CDLL("libc.so.6")
        _libc.malloc_trim(0)
    except OSError:
        pass


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class PeakRSS:
    """Peak extra RSS of a block: ``VmHWM`` after minus ``VmRSS`` before.

    Uses ``/proc/self/clear_refs`` (value 5) to reset the high-water mark; if
    that is not writable, falls back to a sampling thread reading
    ``/proc/self/statm`` every millisecond (can miss short peaks).
    """

    method: Optional[str] = None

    def __enter__(self):
        _trim()
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
        if self._sampler:
            self.peak = self._sampler.stop()
        else:
            self.peak = _status_kb("VmHWM") * 1024
        self.extra = max(0, self.peak - self.before)
        return False


class CudaPeak:
    """Peak extra CUDA memory of a block: ``max_memory_allocated`` after minus ``memory_allocated`` before.

    The caching allocator's peak is reset on entry (after a synchronize, so
    no earlier kernel is still freeing); the exit synchronizes before it reads.
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
    """No memory measurement (JAX on a GPU: XLA's ``peak_bytes_in_use`` cannot be reset between calls)."""

    method = "not measured (JAX on a GPU: no resettable peak counter)"
    extra = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Sampler:
    def __init__(self):
        import threading

        self._stop = threading.Event()
        self._peak = 0
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._t = threading.Thread(target=self._run, daemon=True)

    def _read(self):
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self):
        while not self._stop.is_set():
            self._peak = max(self._peak, self._read())
            time.sleep(0.001)

    def start(self):
        self._peak = self._read()
        self._t.start()

    def stop(self):
        self._stop.set()
        self._t.join()
        return max(self._peak, self._read())


# --------------------------------------------------------------------------- collectives

_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "all_to_all",
    "all_to_all_single",
    "all_gather_object",
    "barrier",
)


class CollectiveCounter:
    """Wraps the ``torch.distributed`` collectives; counts calls and bytes.

    Bytes: the size of the collective's result on this rank (the output list
    or tensor of a gather, the tensor of an all-reduce).
    """

    def __init__(self):
        import torch
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.calls: list[tuple[str, int]] = []
        self.on = False
        for name in _COLLECTIVES:
            orig = getattr(dist, name, None)
            if orig is None:
                continue
            wrapped = self._wrap(name, orig, torch)
            setattr(dist, name, wrapped)
            if getattr(c10d, name, None) is orig:
                setattr(c10d, name, wrapped)

    def _wrap(self, name, orig, torch):
        def nbytes(x):
            if isinstance(x, torch.Tensor):
                return x.numel() * x.element_size()
            if isinstance(x, (list, tuple)):
                return sum(nbytes(t) for t in x)
            return 0

        def wrapper(*args, **kwargs):
            if self.on:
                out = args[0] if args else next(iter(kwargs.values()), None)
                self.calls.append((name, nbytes(out)))
            return orig(*args, **kwargs)

        wrapper.__wrapped__ = orig
        return wrapper

    def take(self) -> dict:
        by_op: dict[str, int] = {}
        for n, _ in self.calls:
            by_op[n] = by_op.get(n, 0) + 1
        out = {"count": len(self.calls), "bytes": sum(b for _, b in self.calls), "by_op": by_op}
        self.calls = []
        return out


# --------------------------------------------------------------------------- torch loop


class _TorchLogits:
    """The logits each call sees, and the gradient it left.

    Normally a leaf ``z`` (``requires_grad``); its gradient is ``z.grad``.
    For an implementation with ``nonleaf_logits`` (``inplace_grad=True``
    writes the gradient into the logits, which therefore must be the output
    of an autograd node, as an LM head's logits are) every call gets a fresh
    copy made by :class:`_Produced` *before* the timed, memory-measured
    region: like the LM head's output in training, the logits exist before
    the op is called and are not counted. The gradient that reaches the copy
    is kept and not passed on, so no ``.grad`` is accumulated anywhere; the
    other implementations' gradients are not copied either (the leaf's
    ``AccumulateGrad`` keeps the tensor the op returned), so both report the
    memory the op itself allocates.
    """

    def __init__(self, torch, z, nonleaf: bool):
        self.torch, self.base, self.nonleaf = torch, z.requires_grad_(True), nonleaf
        self._grad = None
        if nonleaf:
            owner = self

            class _Produced(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x):
                    return x.clone()

                @staticmethod
                def backward(ctx, g):
                    owner._grad = g
                    return None

            self._produce = _Produced.apply
        self.z = self.base
        self.reset()

    def reset(self) -> None:
        """Drop the last gradient (and, non-leaf, make the next call's logits)."""
        self.base.grad = None
        self._grad = None
        if self.nonleaf:
            self.z = None  # free the last copy before making the next
            self.z = self._produce(self.base)

    def grad(self):
        return (self._grad if self.nonleaf else self.base.grad).detach()


def run_torch(job: dict, data: dict) -> None:
    import torch

    impl = IMPLS[job["impl"]]
    torch.set_num_threads(int(job.get("threads") or torch.get_num_threads()))
    world, rank = job.get("world", 1), job.get("rank", 0)
    cuda = job.get("device", "cpu") == "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    group = None
    counter = None
    if world > 1 or impl.process_group:
        import torch.distributed as dist

        if world > 1:
            counter = CollectiveCounter()
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(job["port"])
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
        group = dist.group.WORLD

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[job["dtype"]]
    v_local = data["logits"].shape[-1] // world
    lo = rank * v_local
    forward = impl.build(Context(torch, group=group, rank=rank, world=world, vocab_start=lo,
                                 options=job.get("options") or {}))
    sl = slice(lo, lo + v_local)
    z = torch.from_numpy(np.ascontiguousarray(data.pop("logits")[:, sl])).to(device=dev, dtype=dt)
    keep_full = data.pop("keep")
    keep_t = torch.from_numpy(np.ascontiguousarray(keep_full[:, sl])).to(dev)
    del keep_full
    y = torch.from_numpy(data["target"]).to(dev)
    gl = torch.from_numpy(data["gl"]).float().to(dev)
    gh = torch.from_numpy(data["gh"]).float().to(dev)
    logits = _TorchLogits(torch, z, impl.nonleaf_logits)
    _trim()
    B = z.numel() * z.element_size()
    # on a GPU: wait for the queue before each clock read, and the caching allocator's peak as the memory
    sync = torch.cuda.synchronize if cuda else None
    peak = (lambda: CudaPeak(torch)) if cuda else PeakRSS

    for i, name in enumerate(job["modes"]):
        mode = MODES[name]
        keep = keep_t if mode.masked else None

        def fwd():
            return forward(logits.z, y, keep, mode)

        def bwd(out):
            lp, h = out
            loss = (lp.float() * gl).sum()
            if mode.entropy_grad:
                loss = loss + (h.float() * gh).sum()
            loss.backward()

        rec, out = _measure(job, name, fwd, bwd, logits.reset, counter, B, sync=sync, peak=peak)
        if cuda:
            rec["gpu"] = torch.cuda.get_device_name(dev)
        lp, h = out
        np.savez(
            os.path.join(job["out_dir"], f"out_{i}_r{rank}.npz"),
            lp=lp.detach().double().cpu().numpy(),
            h=(h.detach().double().cpu().numpy() if h is not None else np.zeros(0)),
            g=logits.grad()[: job["err_rows"]].float().cpu().numpy(),
        )
        del out, lp, h
        logits.reset()
        emit("result", **rec)


# --------------------------------------------------------------------------- jax loop


def run_jax(job: dict, data: dict) -> None:
    import jax
    import jax.numpy as jnp

    impl = IMPLS[job["impl"]]
    forward = impl.build(Context(jax))

    dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[job["dtype"]]
    z = jnp.asarray(data.pop("logits"), dtype=dt)
    keep_t = jnp.asarray(data.pop("keep"))
    y = jnp.asarray(data["target"].astype(np.int32))
    gl = jnp.asarray(data["gl"], dtype=jnp.float32)
    gh = jnp.asarray(data["gh"], dtype=jnp.float32)
    z.block_until_ready()
    _trim()
    B = z.size * z.dtype.itemsize

    for i, mode in enumerate(job["modes"]):
        with_ent, ent_grad, masked = MODES[mode]

        def f(z, y, keep, with_ent=with_ent, ent_grad=ent_grad):
            lp, h = forward(z, y, keep, MODES[mode])
            return (lp, h) if with_ent else (lp,)

        # jax.vjp of a jitted function, not a jit returning the vjp closure:
        # the latter makes the residuals outputs of a compiled program, and
        # XLA then copies the logits and the keep mask into them (+1 B or
        # more), which measures the harness rather than the op. Here the
        # residuals that are inputs are forwarded as they are; the backward
        # runs as the compiled transpose.
        jf = jax.jit(f)

        def jb(vjp_fn, outs):
            ct = [gl.astype(outs[0].dtype)]
            if with_ent:
                ct.append(gh.astype(outs[1].dtype) if ent_grad else jnp.zeros_like(outs[1]))
            return vjp_fn(tuple(ct))[0]

        keep = keep_t if masked else None
        state: dict[str, Any] = {}

        if impl.donate:
            # One program, forward and backward, that donates a buffer of the
            # gradient's shape and dtype: XLA may then write the gradient into
            # it. "logits": its copy of the logits (the JAX counterpart of
            # inplace_grad), made outside the measured call, as the LM head's
            # output exists before the op. "gradient": the previous call's
            # gradient, unused by the program (hence keep_unused, without
            # which jit drops the argument and the donation); it is resident
            # before the measured call, so the call's own peak omits it. The
            # whole call counts as the forward (bwd 0).
            # The target and the mask are arguments, as in the other path: a
            # program that captures them gets them as constants, which XLA
            # compiles differently (with a captured target the gradient's
            # loop took the same time with either of spec.block_grad's
            # indicators; passed in, "arith" was faster,
            # benchmarks/grad_indicator.py), and a captured mask is T * V_local
            # bytes of program constants.
            def both(zz, yy, kk):
                outs, vjp_fn = jax.vjp(lambda q: f(q, yy, kk), zz)
                return outs, jb(vjp_fn, outs)

            if impl.donate == "logits":
                step = jax.jit(both, donate_argnums=0)

                def renew():
                    state.pop("g", None)
                    state["z"] = jnp.copy(z)
                    state["z"].block_until_ready()

                def call():
                    return step(state.pop("z"), y, keep)

                clear = renew
                renew()
            else:
                step = jax.jit(lambda zz, yy, kk, old: both(zz, yy, kk), donate_argnums=3, keep_unused=True)
                state["g"] = jnp.zeros_like(z)

                def call():
                    return step(z, y, keep, state.pop("g"))

                def clear():
                    pass

            def fwd():
                outs, g = call()
                jax.block_until_ready((outs, g))
                state["g"] = g
                return outs, None

            def bwd(out):
                pass

        else:
            def fwd():
                outs, vjp_fn = jax.vjp(lambda zz: jf(zz, y, keep), z)
                jax.block_until_ready(outs)
                return outs, vjp_fn

            def bwd(out):
                outs, vjp_fn = out
                g = jb(vjp_fn, outs)
                g.block_until_ready()
                state["g"] = g

            def clear():
                state.pop("g", None)

        rec, out = _measure(job, mode, fwd, bwd, clear, None, B,
                            peak=NoPeak if job.get("device", "cpu") == "cuda" else PeakRSS)
        outs = out[0]
        np.savez(
            os.path.join(job["out_dir"], f"out_{i}_r0.npz"),
            lp=np.asarray(outs[0], dtype=np.float64),
            h=(np.asarray(outs[1], dtype=np.float64) if with_ent else np.zeros(0)),
            g=np.asarray(state.pop("g")[: job["err_rows"]], dtype=np.float32),
        )
        del out, outs
        emit("result", **rec)


def _measure(job, mode, fwd, bwd, clear, counter, B, sync=None, peak=PeakRSS) -> tuple:
    """Time and measure ``bwd(fwd())`` for one mode; ``clear()`` runs after every call.

    ``sync()`` (if given) runs before every clock read, so that a GPU's queued
    work is inside the interval it belongs to; ``peak()`` is the memory
    context manager (its ``extra``: bytes, or ``None`` when not measured).
    Returns the record for the parent and the outputs of the last timed call.
    """

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
    first = {"fwd": t1 - t0, "bwd": t2 - t1}
    for _ in range(job["warmup"]):
        bwd(fwd())
        clear()
    coll = None
    if counter is not None:
        counter.on = True
        out = fwd()
        cf = counter.take()
        bwd(out)
        cb = counter.take()
        counter.on = False
        del out
        clear()
        coll = {"fwd": cf, "bwd": cb}
    # Timed calls; each one is also a memory measurement (the peak-RSS reset
    # and the malloc_trim happen outside the timed region). The outputs of the
    # last call are returned for the error check.
    tf, tb, tfb, cpu, peaks, faults, wall = [], [], [], [], [], [], []
    out = None
    for i in range(max(1, job["reps"])):
        if out is not None:
            del out
            clear()
        _TURNS.between()  # interleaved: the other implementations' next calls run here
        with peak() as pk:
            f0 = _minor_faults()
            c0 = time.process_time()
            w0 = time.time()
            t0 = clock()
            out = fwd()
            t1 = clock()
            bwd(out)
            t2 = clock()
            w1 = time.time()
            c1 = time.process_time()
            f1 = _minor_faults()
        tf.append(t1 - t0)
        tb.append(t2 - t1)
        tfb.append(t2 - t0)
        cpu.append(c1 - c0)
        peaks.append(pk.extra)
        faults.append(f1 - f0)
        wall.append([w0, w1])
    rec = {
        "impl": job["impl"],
        "mode": mode,
        "dtype": job["dtype"],
        "T": job["T"],
        "V_local": job["V"] // job.get("world", 1),
        "world": job.get("world", 1),
        "rank": job.get("rank", 0),
        "first_call_s": first,
        "fwd_s": statistics.median(tf) if tf else None,
        "bwd_s": statistics.median(tb) if tb else None,
        "fwdbwd_s": statistics.median(tfb) if tfb else None,
        "times_fwdbwd_s": tfb,
        # each timed call's [start, end], seconds since the epoch: comparable across the workers
        # (an interleaved run's calls alternate, and no two overlap)
        "wall_fwdbwd": wall,
        # what a loop of such calls pays; far above the median when some calls stall (on a VM,
        # fresh huge pages that the host must back again: benchmarks/fresh_buffer.py)
        "mean_fwdbwd_s": statistics.mean(tfb) if tfb else None,
        "cpu_fwdbwd_s": statistics.median(cpu),
        # first-touch page faults of the whole process per call: a fresh [T, V] buffer in 4 KiB
        # pages costs B / 4096 of them, which is most of its cost on a CPU
        "minor_faults_fwdbwd": statistics.median(faults),
        "reps": len(tfb),
        "B": B,
        "peak_extra_bytes": None if None in peaks else max(peaks),
        "peak_extra_B": None if None in peaks else max(peaks) / B,
        "memory_method": pk.method,
        "device": job.get("device", "cpu"),
        # the worker's own (an implementation may set it: *-hugetlb); meta.machine has the parent's
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
    }
    if coll is not None:
        rec["collectives"] = coll
    return rec, out


def main(argv=None) -> int:
    global _TURNS
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        job = json.load(f)
    _TURNS = Turns(bool(job.get("interleave")))
    _TURNS.take()
    impl = IMPLS[job["impl"]]
    d = job["data_dir"]
    try:
        data = {k: np.load(os.path.join(d, k + ".npy")) for k in ("logits", "target", "keep", "gl", "gh")}
        (run_jax if impl.framework == "jax" else run_torch)(job, data)
    except Exception as e:  # reported to the parent, which marks the impl failed
        emit("error", impl=job["impl"], error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        return 1
    finally:
        if job.get("world", 1) > 1 or impl.process_group:
            try:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group()
            except Exception:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
