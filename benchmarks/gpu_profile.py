"""Where one forward + backward of ``dualvp_torch.logprob_entropy`` spends its time: kernels, launches, host.

Per mode, through :func:`dualvp.tools.bench.timing.measure` (the bench's own
timing): the synchronised wall time per call, the device time summed over
kernels and the number of launches per call (``torch.profiler``; CUDA only),
the host CPU time per call of a queued loop (``validate=False``); then the
kernels (CPU: the aten ops) that take the most time, and with ``--host``
the Python functions under cProfile, and the number of Python calls made in
dualvp's own files per call.

``--sizes`` and ``--dtypes`` take lists (one process: compiles are paid
once); ``--results CSV`` appends one row per (size, dtype, mode) to a bench
results file (``impl`` ``dualvp-torch-<impl>``, ``note`` ``gpu_profile``:
wall, kernel time, launches, host time, the floor from the copy bandwidth
measured in this run); a mode that fails is a row with its error and the
next one runs.

Usage: python benchmarks/gpu_profile.py [--device cuda] [--T 4096 --V 32000 --dtype float32]
    [--sizes 16384x19008,4096x75968] [--dtypes float32,bfloat16]
    [--modes lp,lp+ent+grad,lp+ent+grad.keep] [--impl triton] [--host] [--results CSV]
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
from dualvp.tools.bench import results, timing
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


def _profile_case(a, dev, T: int, V: int, dtype: str, bw: float, env: dict) -> int:
    """Every mode at one (size, dtype); returns the number of modes that failed."""
    cuda = a.device == "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    z = (torch.randn(T, V, device=dev, generator=g) * 3 + 10).to(getattr(torch, dtype)).requires_grad_(True)
    y = torch.randint(0, V, (T,), device=dev, generator=g)
    keep = torch.rand(T, V, device=dev, generator=g) < 0.5
    gl = torch.randn(T, device=dev, generator=g)
    sync = torch.cuda.synchronize if cuda else None
    B = z.numel() * z.element_size()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s; {dtype} T={T} V={V}: B = {B / 2**20:.0f} MiB", flush=True)
    failed = 0
    for name in a.modes.split(","):
        mode = MODES[name]
        k = keep if mode.masked else None
        floor = timing.floor_ms(B, bw, T * V if mode.masked else 0)
        row = dict(env, impl=f"dualvp-torch-{a.impl or 'default'}", op="logits", dtype=dtype, mode=name, T=T,
                   V_local=V, W=1, floor_ms=floor)

        def fwd(validate=True, k=k, mode=mode):
            return logprob_entropy(z, y, keep_mask=k, validate=validate, impl=a.impl, **mode.options())

        def bwd(out, mode=mode):
            lp, h = out
            ((lp * gl).sum() + (h.sum() if mode.entropy_grad else 0)).backward()

        def clear():
            z.grad = None

        try:
            rec, _ = timing.measure((fwd, bwd), clear, B, reps=a.reps, warmup=a.warmup, loop=a.calls, sync=sync,
                                    peak=(lambda: timing.CudaPeak(torch)) if cuda else timing.NoPeak,
                                    fast_step=(lambda: fwd(False), bwd), torch=torch if cuda else None,
                                    profiled=a.calls if cuda else 0)
        except Exception as e:  # a row with the error; the next mode runs
            msg = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
            print(f"== {name} {dtype} T={T} V={V}: failed: {msg}", flush=True)
            if a.results:
                results.append(a.results, [dict(row, note=f"error: {msg}"[:300])])
            failed += 1
            continue
        kern = f", kernels {rec['kernel_ms']:.3f} ms ({rec['kernel_ms'] / floor:.2f}x floor), " \
               f"{rec['launches']:.0f} launches" if cuda else ""
        print(f"== {name} {dtype} T={T} V={V}: wall {rec['wall_ms']:.3f} ms ({rec['wall_ms'] / floor:.2f}x "
              f"floor {floor:.3f} ms){kern}, host {rec['host_us']:.0f} us/call queued", flush=True)
        if a.results:
            results.append(a.results, [dict(row, wall_ms=rec["wall_ms"], fwd_ms=rec["fwd_ms"], bwd_ms=rec["bwd_ms"],
                                            kernel_ms=rec.get("kernel_ms"), queued_ms=rec.get("queued_ms"),
                                            host_us=rec.get("host_us"), launches=rec.get("launches"),
                                            first_ms=rec.get("first_ms"), peak_extra_B=rec.get("peak_extra_B"),
                                            reps=rec.get("reps"), note="gpu_profile")])
        if a.top <= 0 and not a.host:
            continue
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
            print("\n".join(ln for ln in buf.getvalue().splitlines() if ln.strip())[-3000:], flush=True)
    return failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--V", type=int, default=32000)
    ap.add_argument("--sizes", default=None, help="comma list of TxV (default --T x --V)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--dtypes", default=None, help="comma list of float32,bfloat16 (default --dtype)")
    ap.add_argument("--modes", default="lp,lp+ent+grad,lp+ent+grad.keep")
    ap.add_argument("--impl", default=None, help="the op's impl= (default: its own selection)")
    ap.add_argument("--calls", type=int, default=10, help="calls of the queued loop and of each profile")
    ap.add_argument("--reps", type=int, default=5, help="timed (synchronised) calls per mode")
    ap.add_argument("--warmup", type=int, default=2, help="untimed calls after the first one")
    ap.add_argument("--top", type=int, default=8, help="kernels (CPU: aten ops) listed per mode; 0: no profile")
    ap.add_argument("--host", action="store_true", help="also the host side under cProfile")
    ap.add_argument("--results", default=None, metavar="CSV", help="append a row per (size, dtype, mode) here")
    a = ap.parse_args()
    dev = torch.device(a.device)
    sizes = [tuple(int(x) for x in s.lower().split("x")) for s in a.sizes.split(",")] if a.sizes else [(a.T, a.V)]
    dtypes = a.dtypes.split(",") if a.dtypes else [a.dtype]
    bad = [d for d in dtypes if d not in ("float32", "bfloat16")] + [m for m in a.modes.split(",") if m not in MODES]
    if bad:
        ap.error(f"unknown {bad}")
    bw = timing.copy_bandwidth(a.device)
    env = results.environment(a.device) if a.results else {}
    failed = 0
    for T, V in sizes:
        for dtype in dtypes:
            failed += _profile_case(a, dev, T, V, dtype, bw, env)
            if a.device == "cuda":
                torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
