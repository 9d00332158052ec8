"""One subprocess of ``dualvp bench``: one implementation, one (size, dtype).

Run as ``python -m dualvp._bench_worker SPEC.json``. The parent
(:mod:`dualvp.bench`) writes the inputs (``logits.npy`` rounded to the dtype and
stored as float32, ``target.npy``, ``keep.npy``, ``gl.npy``, ``gh.npy``) into a
data directory and a spec naming the implementation, the modes and the
repetitions. For each mode the worker:

1. calls forward and backward once and times it (the *first call*: compile /
   trace / warm-up, reported apart);
2. runs ``warmup`` untimed calls, then ``reps`` timed calls, forward and
   backward timed separately (wall clock, ``time.perf_counter``; the process
   CPU time of forward+backward is recorded too, as it is less sensitive to
   other work on a shared machine);
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

With ``world > 1`` the worker is one rank of a gloo group (rank, world and port
in the spec): it takes its contiguous vocab shard, and counts the collectives
issued per forward and per backward by wrapping the ``torch.distributed``
collective functions.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any, Optional

import numpy as np

# name -> (with_entropy, entropy_grad, keep mask)
MODES = {
    "lp": (False, False, False),
    "lp+ent": (True, False, False),
    "lp+ent+grad": (True, True, False),
    "lp.keep": (False, False, True),
    "lp+ent.keep": (True, False, True),
    "lp+ent+grad.keep": (True, True, True),
}


def emit(kind: str, **kw) -> None:
    print("@@" + json.dumps({"kind": kind, **kw}), flush=True)


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


# --------------------------------------------------------------------------- implementations


def _torch_baseline(torch):
    def f(z, y, keep, with_entropy, entropy_grad, group):
        logp = torch.log_softmax(z, dim=-1)
        if keep is None:
            lq = logp
        else:
            kept = keep.scatter(-1, y[:, None], True)
            lq = torch.log_softmax(z.masked_fill(~kept, float("-inf")), dim=-1)
        lp = lq.gather(-1, y[:, None])[:, 0]
        h = None
        if with_entropy:
            src = logp if entropy_grad else logp.detach()
            h = -(src.exp() * src).sum(-1)
        return lp, h

    return f


def _tp_entropy_fn(torch, dist):
    """The unfused vocab-parallel entropy RL frameworks used next to Megatron's
    fused cross-entropy: all-reduce MAX, SUM of exp, SUM of p*z; saves softmax."""

    class TPEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, z, group):
            zf = z.float()
            m = zf.max(dim=-1, keepdim=True)[0]
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            e = (zf - m).exp()
            s = e.sum(dim=-1, keepdim=True)
            dist.all_reduce(s, op=dist.ReduceOp.SUM, group=group)
            p = e.div_(s)
            pz = (p * zf).sum(dim=-1, keepdim=True)
            dist.all_reduce(pz, op=dist.ReduceOp.SUM, group=group)
            h = m + s.log() - pz
            ctx.save_for_backward(p, zf, pz)
            ctx.in_dtype = z.dtype
            return h[:, 0]

        @staticmethod
        def backward(ctx, gh):
            p, zf, pz = ctx.saved_tensors
            g = p * (pz - zf) * gh[:, None]
            return g.to(ctx.in_dtype), None

    return TPEntropy


def _megatron(torch, dist):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    ent = _tp_entropy_fn(torch, dist)

    def f(z, y, keep, with_entropy, entropy_grad, group):
        zz = z
        if keep is not None:
            zz = z.masked_fill(~_kept_with_target(torch, keep, y, group_lo[0]), float("-inf"))
        # Megatron's fused CE subtracts the max from its input in place when the
        # input is already float32: give it a copy (the caller still needs z).
        if zz is z and z.dtype == torch.float32:
            zz = z.clone()
        lp = -fused_vocab_parallel_cross_entropy(zz[:, None, :], y[:, None], group)[:, 0]
        h = None
        if with_entropy:
            h = ent.apply(z if entropy_grad else z.detach(), group)
        return lp, h

    return f


group_lo = [0]


def _kept_with_target(torch, keep, y, lo):
    v = keep.shape[-1]
    loc = y - lo
    owns = (loc >= 0) & (loc < v)
    cols = torch.arange(v, device=keep.device)
    return keep | ((cols[None, :] == loc[:, None]) & owns[:, None])


def _dualvp_torch(torch):
    from dualvp_torch import logprob_entropy

    def f(z, y, keep, with_entropy, entropy_grad, group):
        return logprob_entropy(z, y, group=group, keep_mask=keep, with_entropy=with_entropy, entropy_grad=entropy_grad)

    return f


def run_torch(spec: dict, data: dict) -> None:
    import torch

    torch.set_num_threads(int(spec.get("threads") or torch.get_num_threads()))
    world, rank = spec.get("world", 1), spec.get("rank", 0)
    group = None
    counter = None
    impl = spec["impl"]
    if world > 1 or impl == "megatron":
        import torch.distributed as dist

        if world > 1:
            counter = CollectiveCounter()
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(spec["port"])
        dist.init_process_group("gloo", rank=rank, world_size=world)
        group = dist.group.WORLD
    if impl in ("dualvp-torch", "dualvp-torch-eager"):
        fn = _dualvp_torch(torch)
    elif impl == "torch-eager":
        fn = _torch_baseline(torch)
    elif impl == "megatron":
        import torch.distributed as dist

        fn = _megatron(torch, dist)
    else:
        raise ValueError(impl)
    if impl == "dualvp-torch" and world == 1:
        group = None

    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
    v_local = data["logits"].shape[-1] // world
    lo = rank * v_local
    group_lo[0] = lo
    sl = slice(lo, lo + v_local)
    z = torch.from_numpy(np.ascontiguousarray(data.pop("logits")[:, sl])).to(dt)
    keep_full = data.pop("keep")
    keep_t = torch.from_numpy(np.ascontiguousarray(keep_full[:, sl]))
    del keep_full
    y = torch.from_numpy(data["target"])
    gl = torch.from_numpy(data["gl"]).float()
    gh = torch.from_numpy(data["gh"]).float()
    z.requires_grad_(True)
    _trim()
    B = z.numel() * z.element_size()

    for i, mode in enumerate(spec["modes"]):
        with_ent, ent_grad, masked = MODES[mode]
        keep = keep_t if masked else None

        def fwd():
            return fn(z, y, keep, with_ent, ent_grad, group)

        def bwd(out):
            lp, h = out
            loss = (lp.float() * gl).sum()
            if ent_grad:
                loss = loss + (h.float() * gh).sum()
            loss.backward()

        rec, out = _measure(spec, mode, fwd, bwd, lambda: setattr(z, "grad", None), counter, B)
        lp, h = out
        np.savez(
            os.path.join(spec["out_dir"], f"out_{i}_r{rank}.npz"),
            lp=lp.detach().double().numpy(),
            h=(h.detach().double().numpy() if h is not None else np.zeros(0)),
            g=z.grad[: spec["err_rows"]].float().numpy(),
        )
        del out, lp, h
        z.grad = None
        emit("result", **rec)


def run_jax(spec: dict, data: dict) -> None:
    import jax
    import jax.numpy as jnp

    impl = spec["impl"]
    if impl == "dualvp-jax":
        import dualvp_jax

        def core(z, y, keep, with_ent, ent_grad):
            return dualvp_jax.logprob_entropy(z, y, keep_mask=keep, with_entropy=with_ent, entropy_grad=ent_grad)

    elif impl == "jax-naive":

        def core(z, y, keep, with_ent, ent_grad):
            logp = jax.nn.log_softmax(z, axis=-1)
            if keep is None:
                lq = logp
            else:
                kept = keep | (jnp.arange(z.shape[-1]) == y[:, None])
                lq = jax.nn.log_softmax(jnp.where(kept, z, -jnp.inf), axis=-1)
            lp = jnp.take_along_axis(lq, y[:, None], axis=-1)[:, 0]
            h = None
            if with_ent:
                h = -(jnp.exp(logp) * logp).sum(-1)
                if not ent_grad:
                    h = jax.lax.stop_gradient(h)
            return lp, h

    else:
        raise ValueError(impl)

    dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[spec["dtype"]]
    z = jnp.asarray(data.pop("logits"), dtype=dt)
    keep_t = jnp.asarray(data.pop("keep"))
    y = jnp.asarray(data["target"].astype(np.int32))
    gl = jnp.asarray(data["gl"], dtype=jnp.float32)
    gh = jnp.asarray(data["gh"], dtype=jnp.float32)
    z.block_until_ready()
    _trim()
    B = z.size * z.dtype.itemsize

    for i, mode in enumerate(spec["modes"]):
        with_ent, ent_grad, masked = MODES[mode]

        def f(z, y, keep, with_ent=with_ent, ent_grad=ent_grad):
            lp, h = core(z, y, keep, with_ent, ent_grad)
            return (lp, h) if with_ent else (lp,)

        def vjp_fwd(z, y, keep):
            return jax.vjp(lambda zz: f(zz, y, keep), z)

        jf = jax.jit(vjp_fwd)

        @jax.jit
        def jb(vjp_fn, outs):
            ct = [gl.astype(outs[0].dtype)]
            if with_ent:
                ct.append(gh.astype(outs[1].dtype) if ent_grad else jnp.zeros_like(outs[1]))
            return vjp_fn(tuple(ct))[0]

        keep = keep_t if masked else None
        state: dict[str, Any] = {}

        def fwd():
            outs, vjp_fn = jf(z, y, keep)
            jax.block_until_ready(outs)
            return outs, vjp_fn

        def bwd(out):
            outs, vjp_fn = out
            g = jb(vjp_fn, outs)
            g.block_until_ready()
            state["g"] = g

        rec, out = _measure(spec, mode, fwd, bwd, lambda: state.pop("g", None), None, B)
        outs = out[0]
        np.savez(
            os.path.join(spec["out_dir"], f"out_{i}_r0.npz"),
            lp=np.asarray(outs[0], dtype=np.float64),
            h=(np.asarray(outs[1], dtype=np.float64) if with_ent else np.zeros(0)),
            g=np.asarray(state.pop("g")[: spec["err_rows"]], dtype=np.float32),
        )
        del out, outs
        emit("result", **rec)


def _measure(spec, mode, fwd, bwd, clear, counter, B) -> dict:
    t0 = time.perf_counter()
    out = fwd()
    t1 = time.perf_counter()
    bwd(out)
    t2 = time.perf_counter()
    del out
    clear()
    first = {"fwd": t1 - t0, "bwd": t2 - t1}
    for _ in range(spec["warmup"]):
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
    tf, tb, tfb, cpu, peaks = [], [], [], [], []
    out = None
    for i in range(max(1, spec["reps"])):
        if out is not None:
            del out
            clear()
        with PeakRSS() as pk:
            c0 = time.process_time()
            t0 = time.perf_counter()
            out = fwd()
            t1 = time.perf_counter()
            bwd(out)
            t2 = time.perf_counter()
            c1 = time.process_time()
        tf.append(t1 - t0)
        tb.append(t2 - t1)
        tfb.append(t2 - t0)
        cpu.append(c1 - c0)
        peaks.append(pk.extra)
    rec = {
        "impl": spec["impl"],
        "mode": mode,
        "dtype": spec["dtype"],
        "T": spec["T"],
        "V_local": spec["V"] // spec.get("world", 1),
        "world": spec.get("world", 1),
        "rank": spec.get("rank", 0),
        "first_call_s": first,
        "fwd_s": statistics.median(tf) if tf else None,
        "bwd_s": statistics.median(tb) if tb else None,
        "fwdbwd_s": statistics.median(tfb) if tfb else None,
        "times_fwdbwd_s": tfb,
        "cpu_fwdbwd_s": statistics.median(cpu),
        "reps": len(tfb),
        "B": B,
        "peak_extra_bytes": max(peaks),
        "peak_extra_B": max(peaks) / B,
        "memory_method": PeakRSS.method,
    }
    if coll is not None:
        rec["collectives"] = coll
    return rec, out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    d = spec["data_dir"]
    try:
        data = {k: np.load(os.path.join(d, k + ".npy")) for k in ("logits", "target", "keep", "gl", "gh")}
        if spec["impl"] in ("dualvp-jax", "jax-naive"):
            run_jax(spec, data)
        else:
            run_torch(spec, data)
    except Exception as e:  # reported to the parent, which marks the impl failed
        emit("error", impl=spec["impl"], error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        return 1
    finally:
        if spec.get("world", 1) > 1 or spec["impl"] == "megatron":
            try:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group()
            except Exception:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
