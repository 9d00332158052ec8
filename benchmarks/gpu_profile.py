"""Where one call of ``dualvp_torch.logprob_entropy`` spends its time (torch.profiler).

The first H200 run (README "GPU") took about 4 ms per forward + backward at
every size and dtype, 3-10x the bandwidth floors: a fixed per-call cost.
This script profiles warmed-up calls and prints, per mode, the wall time per
call, the device time summed over kernels, the number of kernel launches
(device) or top-level ops (CPU), and the kernels (ops) that take the most
time, so that the next change aims at what costs. On the CPU it runs the
same (CPU ops only), which is how it is tested.

``--static-vocab`` compiles the shard stages for the given V_local (rows
dynamic; ``kernels.STATIC_VOCAB_DEVICES``, the default on CUDA) instead of
for every shape; ``--dynamic-vocab`` the opposite.

``--host`` adds, per mode, the host (Python) side of the same calls under
cProfile: where a call whose wall time exceeds its kernel time waits.

Usage: python benchmarks/gpu_profile.py [--device cuda] [--T 4096 --V 32000 --dtype float32 --modes lp,ent,mask] [--static-vocab | --dynamic-vocab] [--host]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from dualvp_torch import kernels, logprob_entropy


def _call(z0, y, keep, with_entropy):
    z = z0.detach().requires_grad_(True)
    lp, h = logprob_entropy(z, y, keep_mask=keep, with_entropy=with_entropy, validate=False)
    (lp.sum() + (h.sum() if h is not None else 0)).backward()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--V", type=int, default=32000)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--modes", default="lp,ent,mask")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--static-vocab", action="store_true",
                    help="compile the shard stages for this V_local, rows dynamic (kernels.STATIC_VOCAB_DEVICES)")
    ap.add_argument("--dynamic-vocab", action="store_true",
                    help="compile the shard stages for every shape (kernels.STATIC_VOCAB_DEVICES emptied)")
    ap.add_argument("--host", action="store_true", help="also profile the host side (cProfile, top functions by own time)")
    a = ap.parse_args()
    dev, cuda = torch.device(a.device), a.device.startswith("cuda")
    if a.static_vocab:
        kernels.STATIC_VOCAB_DEVICES = frozenset({dev.type})
    if a.dynamic_vocab:
        kernels.STATIC_VOCAB_DEVICES = frozenset()
    g = torch.Generator(device=dev).manual_seed(0)
    z0 = (torch.randn(a.T, a.V, device=dev, generator=g) * 3 + 10).to(getattr(torch, a.dtype))
    y = torch.randint(0, a.V, (a.T,), device=dev, generator=g)
    keep = torch.rand(a.T, a.V, device=dev, generator=g) < 0.5
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    tag = " static V" if a.static_vocab else " dynamic V" if a.dynamic_vocab else ""
    for mode in a.modes.split(","):
        args = (z0, y, keep if mode == "mask" else None, mode != "lp")
        for _ in range(3):
            _call(*args)
        sync()
        t = time.perf_counter()
        for _ in range(a.calls):
            _call(*args)
        sync()
        wall = (time.perf_counter() - t) / a.calls
        with profile(activities=acts) as prof:
            for _ in range(a.calls):
                _call(*args)
            sync()
        ev = prof.key_averages()
        if cuda:
            kern = [e for e in ev if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
            key = "self_device_time_total" if hasattr(kern[0] if kern else None, "self_device_time_total") \
                else "self_cuda_time_total"
            dev_us = sum(getattr(e, key) for e in kern) / a.calls
            launches = sum(e.count for e in kern) / a.calls
            print(f"== {mode} {a.dtype} T={a.T} V={a.V}{tag}: wall {wall * 1e3:.3f} ms/call, kernels {dev_us / 1e3:.3f} ms/call, "
                  f"{launches:.0f} kernel launches/call")
            rows = sorted(kern, key=lambda e: -getattr(e, key))[: a.top]
            for e in rows:
                print(f"   {getattr(e, key) / a.calls / 1e3:8.3f} ms  x{e.count // a.calls:<3d} {e.key[:110]}")
        else:
            ops = [e for e in ev if e.key.startswith("aten::")]
            print(f"== {mode} {a.dtype} T={a.T} V={a.V}{tag}: wall {wall * 1e3:.3f} ms/call")
            for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[: a.top]:
                print(f"   {e.self_cpu_time_total / a.calls / 1e3:8.3f} ms  x{e.count // a.calls:<3d} {e.key[:110]}")
        if a.host:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(a.calls):
                _call(*args)
            sync()
            pr.disable()
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(a.top)
            print(f"-- host, {a.calls} calls (cProfile adds its own overhead):")
            print("\n".join(ln for ln in buf.getvalue().splitlines() if ln.strip())[-4000:])


if __name__ == "__main__":
    main()
