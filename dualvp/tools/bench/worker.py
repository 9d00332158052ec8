"""One subprocess of ``dualvp bench``: one implementation, one or more (size, dtype) cases.

Run as ``python -m dualvp.tools.bench.worker JOB.json``. The parent
(:mod:`dualvp.tools.bench.driver`) writes each case's inputs
(``logits.npy`` rounded to the dtype and stored as float32, ``target.npy``,
``keep.npy``, ``gl.npy``, ``gh.npy``) into a data directory, and a job file
naming the implementation (a key of
:data:`dualvp.tools.bench.implementations.IMPLS`), the cases, the modes and
the repetitions. For each case and mode the worker measures
``sum(gl * logprob) + sum(gh * entropy)`` and its backward with
:func:`dualvp.tools.bench.timing.measure`, and writes the log-prob, the
entropy and the first ``err_rows`` rows of the gradient to
``out_<mode index>_r<rank>.npz`` for the parent, which compares them with
the float64 oracle.

Each line printed to stdout that starts with ``@@`` is a JSON record for
the parent (``result``, ``error``, ``unavailable``, ``yield``); everything
else is log.

``"device": "cuda"``: the inputs go to the GPU, clock reads follow
``torch.cuda.synchronize()``, memory is :class:`.timing.CudaPeak`, and the
profiler gives the kernel time and launches. The JAX loop runs on JAX's
default device (the parent sets ``JAX_PLATFORMS``) and reports no memory on
a GPU. ``world > 1``: this worker is one rank of a gloo group (rank, world,
port in the job; on a GPU every rank shares device 0, with CUDA tensors,
since NCCL refuses two ranks on one device); it takes its contiguous vocab
shard and counts the collectives each forward and backward issue.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np

from . import timing
from .implementations import IMPLS, MODES, Context, Unavailable


def emit(kind: str, **kw) -> None:
    print("@@" + json.dumps({"kind": kind, **kw}), flush=True)


class Turns:
    """This worker's turns in an interleaved run (``"interleave": true`` in the job).

    The driver starts every implementation of a case at once and hands a
    turn to one worker at a time (a line on its stdin); the worker ends it
    with a ``yield`` record. A worker's first turn covers its start, then it
    yields before every timed call (:meth:`between`). Off: no-ops.
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

# --------------------------------------------------------------------------- collectives

_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
                "reduce_scatter_tensor", "broadcast", "all_to_all", "all_to_all_single", "all_gather_object",
                "barrier")


class CollectiveCounter:
    """Wraps the ``torch.distributed`` collectives; counts calls and the bytes of their results on this rank."""

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
                self.calls.append((name, nbytes(args[0] if args else next(iter(kwargs.values()), None))))
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


# --------------------------------------------------------------------------- torch


class _TorchLogits:
    """The logits each call sees, and the gradient it left.

    Normally a leaf ``z``; its gradient is ``z.grad``. For an implementation
    with ``nonleaf_logits`` (the gradient overwrites the logits) every call
    gets a fresh copy made by an autograd node *before* the timed region, as
    an LM head's output exists before the op; the gradient reaching the copy
    is kept, not accumulated, so both kinds report the op's own memory.
    """

    def __init__(self, torch, z, nonleaf: bool):
        self.base, self.nonleaf = z.requires_grad_(True), nonleaf
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


def _load(case: dict, wait_s: float = 0.0) -> dict:
    """A case's inputs; with ``wait_s`` (the driver's jobs), once the driver has marked them ``READY``
    (it may still be making them)."""
    d = case["data_dir"]
    t0 = time.monotonic()
    while wait_s > 0 and not os.path.exists(os.path.join(d, "READY")):
        failed = os.path.join(d, "FAILED")
        if os.path.exists(failed):
            with open(failed) as f:
                raise RuntimeError(f"the bench could not make the inputs of {case['T']}x{case['V']}: {f.read()}")
        if time.monotonic() - t0 > wait_s:
            raise TimeoutError(f"no inputs for {case['T']}x{case['V']} {case['dtype']} after {wait_s:.0f} s")
        time.sleep(0.1)
    return {k: np.load(os.path.join(d, k + ".npy")) for k in ("logits", "target", "keep", "gl", "gh")}


def _start_group(job: dict, cuda: bool):
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(job["port"])
    world = job.get("world", 1)
    # NCCL wants one device per rank; W ranks sharing one GPU talk over gloo with CUDA tensors
    backend = "nccl" if cuda and not job.get("shared_device", True) else "gloo"
    dist.init_process_group(backend, rank=job.get("rank", 0), world_size=world)
    return dist.group.WORLD


def run_torch(job: dict) -> None:
    import torch

    impl = IMPLS[job["impl"]]
    torch.set_num_threads(int(job.get("threads") or torch.get_num_threads()))
    world, rank = job.get("world", 1), job.get("rank", 0)
    cuda = job.get("device", "cpu") == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    group = _start_group(job, cuda) if world > 1 or impl.process_group else None
    counter = CollectiveCounter() if world > 1 else None
    sync = torch.cuda.synchronize if cuda else None
    peak = (lambda: timing.CudaPeak(torch)) if cuda else timing.PeakRSS
    forward = None
    for case in job["cases"]:
        data = _load(case, job.get("wait_s", 0.0))
        dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[case["dtype"]]
        v_local = data["logits"].shape[-1] // world
        lo = rank * v_local
        if forward is None:
            forward = impl.build(Context(torch, group=group, rank=rank, world=world, vocab_start=lo,
                                         options=job.get("options") or {}, device=dev.type))
        sl = slice(lo, lo + v_local)
        z = torch.from_numpy(np.ascontiguousarray(data.pop("logits")[:, sl])).to(device=dev, dtype=dt)
        keep_t = torch.from_numpy(np.ascontiguousarray(data.pop("keep")[:, sl])).to(dev)
        y = torch.from_numpy(data["target"]).to(dev)
        gl = torch.from_numpy(data["gl"]).float().to(dev)
        gh = torch.from_numpy(data["gh"]).float().to(dev)
        logits = _TorchLogits(torch, z, impl.nonleaf_logits)
        timing.trim()
        B = z.numel() * z.element_size()
        for i, name in enumerate(job["modes"]):
            mode = MODES[name]
            keep = keep_t if mode.masked else None

            def bwd(out, mode=mode):
                lp, h = out
                loss = (lp.float() * gl).sum()
                if mode.entropy_grad:
                    loss = loss + (h.float() * gh).sum()
                loss.backward()

            step = (lambda keep=keep, mode=mode: forward(logits.z, y, keep, mode), bwd)
            fast = (lambda keep=keep, mode=mode: forward(logits.z, y, keep, mode, validate=False), bwd)
            def snapshot(out):
                lp, h = out
                return lp.detach(), None if h is None else h.detach(), logits.grad()[: job["err_rows"]].clone()

            rec, (lp, h, g) = timing.measure(
                step, logits.reset, B, reps=job["reps"], warmup=job["warmup"], loop=job.get("loop", 5), sync=sync,
                peak=peak, fast_step=fast, torch=torch if cuda else None,
                profiled=job.get("profiled", 3) if cuda else 0, between=_TURNS.between, counter=counter,
                snapshot=snapshot)
            np.savez(os.path.join(case["out_dir"], f"out_{i}_r{rank}.npz"),
                     lp=lp.double().cpu().numpy(), h=(h.double().cpu().numpy() if h is not None else np.zeros(0)),
                     g=g.float().cpu().numpy())
            del lp, h, g
            emit("result", **_record(job, case, name, rec, B, world, rank))
        logits = None  # the case's inputs go before the next case's arrive
        del z, keep_t, data


def _record(job, case, mode, rec, B, world, rank) -> dict:
    return dict(rec, impl=job["impl"], mode=mode, dtype=case["dtype"], T=case["T"], V_local=case["V"] // world,
                world=world, rank=rank, B=B, case=case["index"], device=job.get("device", "cpu"))


# --------------------------------------------------------------------------- jax


def run_jax(job: dict) -> None:
    import jax
    import jax.numpy as jnp

    impl = IMPLS[job["impl"]]
    forward = impl.build(Context(jax, device=job.get("device", "cpu")))
    cuda = job.get("device", "cpu") == "cuda"
    for case in job["cases"]:
        data = _load(case, job.get("wait_s", 0.0))
        dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[case["dtype"]]
        z = jnp.asarray(data.pop("logits"), dtype=dt)
        keep_t = jnp.asarray(data.pop("keep"))
        y = jnp.asarray(data["target"].astype(np.int32))
        gl = jnp.asarray(data["gl"], dtype=jnp.float32)
        gh = jnp.asarray(data["gh"], dtype=jnp.float32)
        z.block_until_ready()
        timing.trim()
        B = z.size * z.dtype.itemsize
        for i, name in enumerate(job["modes"]):
            mode = MODES[name]

            def f(z, y, keep, mode=mode):
                lp, h = forward(z, y, keep, mode)
                return (lp, h) if mode.with_entropy else (lp,)

            # jax.vjp of a jitted function, not a jit returning the vjp closure: the latter makes the
            # residuals outputs of a compiled program, and XLA then copies the logits into them
            jf = jax.jit(f)
            keep = keep_t if mode.masked else None
            state: dict = {}

            def fwd(jf=jf, keep=keep, z=z):
                outs, vjp_fn = jax.vjp(lambda zz: jf(zz, y, keep), z)
                jax.block_until_ready(outs)
                return outs, vjp_fn

            def bwd(out, mode=mode, state=state):
                outs, vjp_fn = out
                ct = [gl.astype(outs[0].dtype)]
                if mode.with_entropy:
                    ct.append(gh.astype(outs[1].dtype) if mode.entropy_grad else jnp.zeros_like(outs[1]))
                g = vjp_fn(tuple(ct))[0]
                g.block_until_ready()
                state["g"] = g

            rec, (outs, g) = timing.measure(
                (fwd, bwd), lambda state=state: state.pop("g", None), B, reps=job["reps"], warmup=job["warmup"],
                loop=job.get("loop", 5), peak=timing.NoPeak if cuda else timing.PeakRSS, between=_TURNS.between,
                snapshot=lambda out, state=state: (out[0], state["g"]))
            np.savez(os.path.join(case["out_dir"], f"out_{i}_r0.npz"),
                     lp=np.asarray(outs[0], dtype=np.float64),
                     h=(np.asarray(outs[1], dtype=np.float64) if mode.with_entropy else np.zeros(0)),
                     g=np.asarray(g[: job["err_rows"]], dtype=np.float32))
            del outs, g
            emit("result", **_record(job, case, name, rec, B, 1, 0))
        del z, keep_t, data


def main(argv=None) -> int:
    global _TURNS
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        job = json.load(f)
    _TURNS = Turns(bool(job.get("interleave")))
    _TURNS.take()
    impl = IMPLS[job["impl"]]
    try:
        (run_jax if impl.framework == "jax" else run_torch)(job)
    except Unavailable as e:  # the parent lists the implementation as skipped
        emit("unavailable", impl=job["impl"], why=str(e))
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
