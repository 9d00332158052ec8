"""The Triton logits kernels against the float64 oracle at the sizes the GPU check times next.

    python scripts/triton_check.py [--device cuda] [--sizes 16384x19008,4096x75968]
        [--dtypes float32,bfloat16] [--modes lp+ent+grad,lp+ent+grad.keep] [--results CSV]

For each (size, dtype, mode): ``dualvp_torch.logprob_entropy(..., impl="triton")``
forward and backward of ``sum(gl * logprob) + sum(gh * entropy)`` (the
entropy term when the mode differentiates it) on confident-LM-like logits
made on the device (N(10, 3), one +25 spike per row, the target on the
spike half of the time; rounded to the dtype), then the log-prob, entropy and logits gradient of a sample of rows (the
first and last 32 and 64 spread between: every program's position in the
grid, since a row's result depends on its own row only) against
:mod:`dualvp.reference` in float64 on the same rounded logits, within
:data:`dualvp.testing.metrics.TOLERANCES`. One line per case; with
``--results`` a row per case (``impl`` ``dualvp-torch-triton``, the
``err_*`` columns, ``note`` ``triton_check``, or the error). Exit status 1
when a case fails or exceeds its tolerance. On a CPU the kernels run under
``TRITON_INTERPRET=1`` (the GPU check's rehearsal).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


def _sample_rows(T: int) -> np.ndarray:
    rows = set(range(min(T, 32))) | set(range(max(0, T - 32), T))
    rows |= set(np.linspace(0, T - 1, num=min(T, 64)).astype(int).tolist())
    return np.array(sorted(rows))


def _case(torch, dev, T: int, V: int, dtype: str, mode_name: str, seed: int) -> dict:
    """Max abs errors of one case, and whether each is within tolerance."""
    from dualvp import reference
    from dualvp.testing import metrics
    from dualvp.testing.modes import MODES
    from dualvp_torch import logprob_entropy

    mode = MODES[mode_name]
    g = torch.Generator(device=dev).manual_seed(seed)
    # made on the device: the bench's CPU generator takes tens of seconds at these sizes
    z = torch.randn(T, V, device=dev, generator=g) * 3 + 10
    spike = torch.randint(0, V, (T,), device=dev, generator=g)
    z[torch.arange(T, device=dev), spike] += 25
    z = z.to(getattr(torch, dtype))
    y = torch.where(torch.rand(T, device=dev, generator=g) < 0.5, spike,
                    torch.randint(0, V, (T,), device=dev, generator=g))
    keep = (torch.rand(T, V, device=dev, generator=g) < 0.5) if mode.masked else None
    gl = torch.randn(T, device=dev, generator=g)
    gh = torch.randn(T, device=dev, generator=g)
    zz = z.detach().clone().requires_grad_(True)
    lp, h = logprob_entropy(zz, y, keep_mask=keep, impl="triton", **mode.options())
    loss = (lp * gl).sum() + ((h * gh).sum() if mode.entropy_grad else 0)
    loss.backward()
    rows = _sample_rows(T)
    idx = torch.from_numpy(rows).to(dev)
    z64 = z.detach()[idx].double().cpu().numpy()  # the rounded logits, exactly
    y_s = y[idx].cpu().numpy()
    km = keep[idx].cpu().numpy() if keep is not None else None
    rlp, rh = reference.logprob_entropy(z64, y_s, keep_mask=km)
    rg = reference.logprob_entropy_grad(z64, y_s, gl[idx].double().cpu().numpy(),
                                        gh[idx].double().cpu().numpy() if mode.entropy_grad else None, keep_mask=km)
    got = {"logprob": (lp.detach()[idx].double().cpu().numpy(), rlp),
           "grad": (zz.grad[idx].double().cpu().numpy(), rg)}
    if mode.with_entropy:
        got["entropy"] = (h.detach()[idx].double().cpu().numpy(), rh)
    out = {}
    for q, (x, ref) in got.items():
        out[q] = (metrics.max_errors(x, ref)[0], metrics.within_tolerance(x, ref, metrics.tolerance(dtype, q)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--sizes", default="16384x19008,4096x75968")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--modes", default="lp+ent+grad,lp+ent+grad.keep")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", default=None, metavar="CSV", help="append a row per case here")
    a = ap.parse_args()
    if a.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--device cpu runs the Triton kernels only under TRITON_INTERPRET=1")
    import torch

    from dualvp.tools.bench import results

    dev = torch.device(a.device)
    env = results.environment(a.device) if a.results else {}
    bad = 0
    for size in a.sizes.split(","):
        T, V = (int(x) for x in size.lower().split("x"))
        for dtype in a.dtypes.split(","):
            for mode in a.modes.split(","):
                row = dict(env, impl="dualvp-torch-triton", op="logits", dtype=dtype, mode=mode, T=T, V_local=V, W=1)
                t0 = time.monotonic()
                try:
                    errs = _case(torch, dev, T, V, dtype, mode, a.seed)
                except Exception as e:  # a line and a row with the error; the next case runs
                    msg = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
                    print(f"{dtype:9s} {mode:17s} {T}x{V}: FAILED {msg}", flush=True)
                    row["note"] = f"error: {msg}"[:300]
                    bad += 1
                else:
                    ok = all(within for _, within in errs.values())
                    bad += not ok
                    print(f"{dtype:9s} {mode:17s} {T}x{V}: {'ok  ' if ok else 'OVER'} "
                          + "  ".join(f"{q} {e:.1e}{'' if w else ' (over)'}" for q, (e, w) in errs.items())
                          + f"  ({time.monotonic() - t0:.1f} s)", flush=True)
                    row.update({f"err_{q}": e for q, (e, _) in errs.items()},
                               note="triton_check" if ok else "triton_check: over tolerance")
                if a.device == "cuda":
                    torch.cuda.empty_cache()
                if a.results:
                    results.append(a.results, [row])
    print(f"triton_check: {bad} case(s) failed or over tolerance" if bad else
          "triton_check: all cases within tolerance")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
