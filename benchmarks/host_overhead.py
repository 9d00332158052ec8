"""Host time of the logits op per forward + backward, kernel launches stubbed, against a minimal Function.

Issue 45's host goal: with the kernel launches replaced by no-ops, one
forward + backward of ``dualvp_torch.logprob_entropy`` (the Triton engine,
``W = 1``, ``validate=False``) costs at most 2x a minimal
``torch.autograd.Function`` that allocates the same outputs (``logprob``,
``entropy``, ``res [5, T]`` in the forward; the gradient in the backward) and
makes the same number of (no-op) launches; and dualvp's own files make at most
20 Python calls per forward + backward.

What runs: CPU tensors, the Triton engine as ``TRITON_INTERPRET=1`` selects it
on a CPU, with the kernel objects that ``dualvp_torch.logits_triton`` launches
(``logits_stats_kernel[grid](...)``, ...) replaced by stubs whose launch does
nothing; so everything on the host runs as on a GPU (checks, plan, output
allocation, the custom op's dispatch, autograd) except Triton's own launch
path (``JITFunction.run``, ~6-8 us per launch, which a minimal op pays as
well). Both sides run the same step: a fresh non-leaf ``z`` (``z0 * 1``, one
aten op), the op, ``torch.autograd.backward`` with preallocated upstream
gradients; the two alternate in blocks so both see the same phases of a
shared machine's load. Per side: min and median over blocks of the mean wall
time per step (``perf_counter``), and the thread CPU time (``thread_time``),
which a descheduled thread does not accumulate.

Then one step under cProfile: the Python calls made in dualvp's own files
(``dualvp/``, ``dualvp_torch/``, ``dualvp_jax/``) and in all files, with the
functions of dualvp's files by count.

``--impl compiled`` / ``--impl eager``: the same step on those engines, whose
work runs on the CPU itself (nothing to stub; at the default T=4 x V=256 it is
a few microseconds of arithmetic, so the figure is the engine's host cost).

Usage: python benchmarks/host_overhead.py [--T 4] [--V 256] [--blocks 60] [--steps 200] [--top 25]
       [--impl triton|compiled|eager]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import statistics
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton engine on CPU tensors (its launches are stubbed)
# this checkout's packages, not an installed copy (sys.path[0] is benchmarks/ when run as a script)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import dualvp  # noqa: E402
import dualvp_torch  # noqa: E402
from dualvp_torch import logits_triton  # noqa: E402


class _NoLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **meta)`` does nothing."""

    def __getitem__(self, grid):
        return self._launch

    @staticmethod
    def _launch(*args, **kwargs):
        return None


_STUB = _NoLaunch()
for _name in ("logits_stats_kernel", "logits_merge_kernel", "logits_grad_kernel"):
    setattr(logits_triton, _name, _STUB)


class Minimal(torch.autograd.Function):
    """The floor: the op's outputs allocated, one (stubbed) launch each way, nothing else."""

    @staticmethod
    def forward(ctx, z, y):
        T = y.numel()
        logprob = torch.empty(y.shape, dtype=torch.float32)
        entropy = torch.empty(y.shape, dtype=torch.float32)
        res = torch.empty((5, T), dtype=torch.float32)
        _STUB[(T,)](z, y, logprob, entropy, res)
        ctx.save_for_backward(z, y, res)
        return logprob, entropy

    @staticmethod
    def backward(ctx, gl, ge):
        z, y, res = ctx.saved_tensors
        g = torch.empty(z.shape, dtype=z.dtype)
        _STUB[(z.shape[0],)](z, g, y, res, gl, ge)
        return g, None


IMPL = "triton"  # --impl


def _dualvp(z, y):
    return dualvp_torch.logprob_entropy(z, y, validate=False, impl=IMPL)


def _minimal(z, y):
    return Minimal.apply(z, y)


def _step(op, z0, y, grads):
    z = z0 * 1  # a non-leaf, as logits from a model are
    lp, h = op(z, y)
    torch.autograd.backward([lp, h], grads)
    z0.grad = None


def _block(op, z0, y, grads, steps: int) -> tuple:
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        _step(op, z0, y, grads)
    return (time.perf_counter() - t0) / steps, (time.thread_time() - c0) / steps


def measure(T: int, V: int, blocks: int, steps: int) -> dict:
    z0 = torch.randn(T, V, requires_grad=True)
    y = torch.randint(0, V, (T,))
    grads = [torch.ones(T), torch.ones(T)]
    ops = {"dualvp": _dualvp, "minimal": _minimal}
    for op in ops.values():  # warm-up: checks cached, plan made, dispatch tables filled
        for _ in range(20):
            _step(op, z0, y, grads)
    wall = {k: [] for k in ops}
    cpu = {k: [] for k in ops}
    gc.collect()
    gc.disable()
    try:
        for b in range(blocks):
            order = list(ops) if b % 2 == 0 else list(ops)[::-1]
            for k in order:
                w, c = _block(ops[k], z0, y, grads, steps)
                wall[k].append(w)
                cpu[k].append(c)
    finally:
        gc.enable()
    return {k: (min(wall[k]), statistics.median(wall[k]), min(cpu[k]), statistics.median(cpu[k])) for k in ops}


def own_calls(T: int, V: int, top: int) -> tuple:
    """``(dualvp's calls, all calls, [(count, function)])`` of one step under cProfile."""
    roots = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (dualvp, dualvp_torch))
    roots += (os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(dualvp.__file__))), "dualvp_jax")
              + os.sep,)
    z0 = torch.randn(T, V, requires_grad=True)
    y = torch.randint(0, V, (T,))
    grads = [torch.ones(T), torch.ones(T)]
    _step(_dualvp, z0, y, grads)
    prof = cProfile.Profile()
    prof.enable()
    _step(_dualvp, z0, y, grads)
    prof.disable()
    st = pstats.Stats(prof).stats
    ours = {k: v[1] for k, v in st.items() if k[0].startswith(roots)}
    total = sum(v[1] for v in st.values())
    here = os.path.abspath(__file__)
    total -= sum(v[1] for k, v in st.items() if k[0] == here)  # this script's own step and stubs
    rows = sorted(((n, f"{os.path.relpath(k[0], os.path.dirname(roots[1][:-1]))}:{k[1]} {k[2]}")
                   for k, n in ours.items()), reverse=True)
    return sum(ours.values()), total, rows[:top]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=4)
    ap.add_argument("--V", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=60, help="timed blocks per side, alternating")
    ap.add_argument("--steps", type=int, default=200, help="forward + backward steps per block")
    ap.add_argument("--top", type=int, default=25, help="dualvp functions listed by call count")
    ap.add_argument("--impl", default="triton", choices=("triton", "compiled", "eager"),
                    help="the engine (triton: launches stubbed; compiled, eager: their CPU work runs)")
    a = ap.parse_args(argv)
    global IMPL
    IMPL = a.impl
    torch.set_num_threads(1)
    r = measure(a.T, a.V, a.blocks, a.steps)
    print(f"host time per forward + backward, impl={a.impl}, T={a.T} V={a.V}"
          f"{', launches stubbed' if a.impl == 'triton' else ''} "
          f"({a.blocks} blocks x {a.steps} steps per side, alternating), torch {torch.__version__}")
    print(f"{'':10s} {'wall min us':>12s} {'wall med us':>12s} {'cpu min us':>11s} {'cpu med us':>11s}")
    for k, (wmin, wmed, cmin, cmed) in r.items():
        print(f"{k:10s} {wmin * 1e6:12.1f} {wmed * 1e6:12.1f} {cmin * 1e6:11.1f} {cmed * 1e6:11.1f}")
    d, m = r["dualvp"], r["minimal"]
    print(f"ratio      {d[0] / m[0]:12.2f} {d[1] / m[1]:12.2f} {d[2] / m[2]:11.2f} {d[3] / m[3]:11.2f}")
    n, total, rows = own_calls(a.T, a.V, a.top)
    print(f"Python calls per forward + backward: dualvp's files {n}, all files {total}")
    for c, f in rows:
        print(f"  {c:4d}  {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
