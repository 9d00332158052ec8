"""Where one forward + backward of ``dualvp_torch.logprob_entropy`` spends its time: kernels, launches, host.

Per mode, through :func:`dualvp.tools.bench.timing.measure` (the bench's own
timing): the synchronised wall time per call, the device time summed over
kernels and the number of launches per call (``torch.profiler``; CUDA only),
the host CPU time per call of a queued loop (``validate=False``); then the
kernels (CPU: the aten ops) that take the most time, and with ``--host``
the Python functions under cProfile, and the number of Python calls made in
dualvp's own files per call.

Usage: python benchmarks/gpu_profile.py [--device cuda] [--T 4096 --V 32000 --dtype float32]
    [--modes lp,lp+ent+grad,lp+ent+grad.keep] [--impl triton] [--host]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats

import torch
from torch.profiler import ProfilerActivity, profile

from dualvp.testing.modes import MODES
from dualvp.tools.bench import timing
from dualvp_torch import logprob_entropy


def _top(prof, cuda: bool, calls: int, top: int) -> list:
    ev = prof.key_averages()
    if cuda:
        dev = torch.autograd.DeviceType.CUDA
        rows = [(e.self_device_time_total, e.count, e.key) for e in ev if getattr(e, "device_type", None) == dev]
    else:
        rows = [(e.self_cpu_time_total, e.count, e.key) for e in ev if e.key.startswith("aten::")]
    return [f"   {us / calls / 1e3:8.3f} ms  x{n // calls:<3d} {k[:110]}" for us, n, k in sorted(rows)[::-1][:top]]


def _own_calls(stats: pstats.Stats, calls: int) -> float:
    """Python calls per forward + backward made in dualvp's own files."""
    roots = [os.path.dirname(os.path.abspath(m.__file__)) for m in (__import__("dualvp"), __import__("dualvp_torch"))]
    n = sum(nc for (path, _, _), (_, nc, *_rest) in stats.stats.items() if any(path.startswith(r) for r in roots))
    return n / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--V", type=int, default=32000)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--modes", default="lp,lp+ent+grad,lp+ent+grad.keep")
    ap.add_argument("--impl", default=None, help="the op's impl= (default: its own selection)")
    ap.add_argument("--calls", type=int, default=10, help="calls of the queued loop and of each profile")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--host", action="store_true", help="also the host side under cProfile")
    a = ap.parse_args()
    dev, cuda = torch.device(a.device), a.device == "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    z = (torch.randn(a.T, a.V, device=dev, generator=g) * 3 + 10).to(getattr(torch, a.dtype)).requires_grad_(True)
    y = torch.randint(0, a.V, (a.T,), device=dev, generator=g)
    keep = torch.rand(a.T, a.V, device=dev, generator=g) < 0.5
    gl = torch.randn(a.T, device=dev, generator=g)
    sync = torch.cuda.synchronize if cuda else None
    B = z.numel() * z.element_size()
    bw = timing.copy_bandwidth(a.device)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; B = {B / 2**20:.0f} MiB")
    for name in a.modes.split(","):
        mode = MODES[name]
        k = keep if mode.masked else None

        def fwd(validate=True, k=k, mode=mode):
            return logprob_entropy(z, y, keep_mask=k, validate=validate, impl=a.impl, **mode.options())

        def bwd(out, mode=mode):
            lp, h = out
            ((lp * gl).sum() + (h.sum() if mode.entropy_grad else 0)).backward()

        def clear():
            z.grad = None

        rec, _ = timing.measure((fwd, bwd), clear, B, reps=5, warmup=2, loop=a.calls, sync=sync,
                                peak=(lambda: timing.CudaPeak(torch)) if cuda else timing.NoPeak,
                                fast_step=(lambda: fwd(False), bwd), torch=torch if cuda else None,
                                profiled=a.calls if cuda else 0)
        floor = timing.floor_ms(B, bw, a.T * a.V if mode.masked else 0)
        kern = f", kernels {rec['kernel_ms']:.3f} ms ({rec['kernel_ms'] / floor:.2f}x floor), " \
               f"{rec['launches']:.0f} launches" if cuda else ""
        print(f"== {name} {a.dtype} T={a.T} V={a.V}: wall {rec['wall_ms']:.3f} ms ({rec['wall_ms'] / floor:.2f}x "
              f"floor {floor:.3f} ms){kern}, host {rec['host_us']:.0f} us/call queued")
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            for _ in range(a.calls):
                bwd(fwd(False))
                clear()
            if sync:
                sync()
        print("\n".join(_top(prof, cuda, a.calls, a.top)))
        if a.host:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(a.calls):
                bwd(fwd(False))
                clear()
            if sync:
                sync()
            pr.disable()
            st = pstats.Stats(pr, stream=(buf := io.StringIO()))
            print(f"-- host: {_own_calls(st, a.calls):.0f} Python calls per call in dualvp's own files; "
                  "top functions by own time:")
            st.sort_stats("tottime").print_stats(a.top)
            print("\n".join(ln for ln in buf.getvalue().splitlines() if ln.strip())[-3000:])


if __name__ == "__main__":
    main()
