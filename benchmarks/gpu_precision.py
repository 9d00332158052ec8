"""Precision and time of the compiled kernels with float32 vs float64 row sums.

On the first H200 run (README "GPU") the compiled kernels, which sum rows in
float32 off the CPU (``kernels.accumulation_dtype``), gave a float32 entropy
error of 2.4e-6 and an entropy-gradient error of 2.8e-6 at T=16384,
V_local=19008, where the CPU path (float64 sums) gives 6.3e-7 and 1.6e-7 on
the same inputs. This script runs ``logprob_entropy`` (compiled, log-prob and
entropy, both differentiated) with the row sums in float32 and in float64
(``kernels.FLOAT64_SUMS_DEVICES`` without and with the device), on the inputs of
``benchmarks/vs_slime.py`` (same seed: the same numbers as its tables), and
prints per variant the median forward + backward time and the largest
errors against the float64 oracle (log-prob and entropy over all rows, the
gradient over the first ``--check-rows`` rows). If float64 sums close the
gap at a small cost, they should become the GPU default; if not, the
remaining error comes from elsewhere (Triton's approximate exponential).

Usage: python benchmarks/gpu_precision.py --device cuda [--T 16384 --V 19008]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from dualvp import reference
from dualvp_torch import kernels, logprob_entropy


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--V", type=int, default=19008)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--check-rows", type=int, default=64)
    ap.add_argument("--impl", default="compiled", choices=kernels.IMPLEMENTATIONS,
                    help="eager: the setting has no effect (its sums are torch's own); for a quick check of this script")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rng = torch.Generator().manual_seed(0)  # benchmarks/vs_slime.py's float32 inputs
    z0 = torch.randn(a.T, a.V, generator=rng) * 2.0
    z0[:, :8] += 8.0
    y = torch.randint(0, a.V, (a.T,), generator=rng)
    torch.rand(a.T, a.V, generator=rng)  # vs_slime's keep mask: drawn, unused here
    gl, ge = torch.randn(a.T, generator=rng), torch.randn(a.T, generator=rng)
    zd, yd = z0.double().numpy(), y.numpy()
    rl, rh = reference.logprob_entropy(zd, yd)
    n = a.check_rows
    rg = reference.logprob_entropy_grad(zd[:n], yd[:n], gl[:n].double().numpy(), ge[:n].double().numpy())
    z0, y, gl, ge = z0.to(dev), y.to(dev), gl.to(dev), ge.to(dev)
    default = kernels.FLOAT64_SUMS_DEVICES
    print(f"device {dev}, T={a.T}, V_local={a.V}, float32, {a.impl}, log-prob + entropy with gradient")
    for acc in (torch.float32, torch.float64):
        kernels.FLOAT64_SUMS_DEVICES = default | {dev.type} if acc == torch.float64 else default - {dev.type}
        try:
            ts = []
            for _ in range(a.reps + 1):
                z = z0.detach().requires_grad_(True)
                sync()
                t = time.perf_counter()
                lp, h = logprob_entropy(z, y, impl=a.impl, validate=False)
                ((lp * gl).sum() + (h * ge).sum()).backward()
                sync()
                ts.append(time.perf_counter() - t)
        finally:
            kernels.FLOAT64_SUMS_DEVICES = default
        err = {k: float(np.max(np.abs(got.detach().double().cpu().numpy() - ref)))
               for k, got, ref in (("logprob", lp, rl), ("entropy", h, rh), ("grad", z.grad[:n], rg))}
        print(f"row sums in {str(acc).replace('torch.', ''):8s}: {statistics.median(ts[1:]) * 1e3:8.2f} ms   "
              + "   ".join(f"{k} err {v:.1e}" for k, v in err.items()), flush=True)


if __name__ == "__main__":
    main()
