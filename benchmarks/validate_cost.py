"""What ``validate=True`` (one small all-gather with a group, one host sync) costs per call.

Times forward + backward of ``dualvp_torch.logprob_entropy`` with
``validate=True`` and ``validate=False`` side by side (interleaved rounds,
best of rounds of the per-round median), W = 1, on the given device, and
prints one JSON line per (T, V_local, dtype). On a GPU the difference is
the host sync of the target range check: the CPU waits for the queue to
drain before launching the op's kernels.

Usage: python benchmarks/validate_cost.py --device cuda [--T 4096 --V 32000,152064 --dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dualvp_torch import logprob_entropy


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--V", default="32000,152064")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    for v in map(int, a.V.split(",")):
        for dt in a.dtypes.split(","):
            z0 = torch.randn(a.T, v, device=a.device).to(getattr(torch, dt))
            y = torch.randint(0, v, (a.T,), device=a.device)
            best = {}
            for _ in range(a.rounds):
                for validate in (True, False):
                    ts = []
                    for _ in range(a.reps + 1):
                        z = z0.detach().requires_grad_(True)
                        _sync(a.device)
                        t = time.perf_counter()
                        lp, h = logprob_entropy(z, y, validate=validate)
                        (lp.sum() + h.sum()).backward()
                        _sync(a.device)
                        ts.append(time.perf_counter() - t)
                    med = statistics.median(ts[1:])
                    best[validate] = min(best.get(validate, med), med)
            print(json.dumps(dict(device=a.device, T=a.T, V_local=v, dtype=dt, validate_s=best[True],
                                  no_validate_s=best[False], overhead=best[True] / best[False] - 1)), flush=True)


if __name__ == "__main__":
    main()
