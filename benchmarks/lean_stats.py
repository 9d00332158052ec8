"""The log-prob-only forward with and without the entropy's statistic, compiled, on the CPU.

``dualvp_torch.kernels.FULL_STATS_CPU_DTYPES`` names the input dtypes whose
compiled CPU statistics include the entropy's ``t`` even when the caller asked
for the log-prob alone. This script measures that choice: for each dtype, the
forward of ``logprob_entropy(z, y, with_entropy=False)`` under ``no_grad``
with the lean statistics (``t`` skipped) and the full ones, the forward with
entropy for scale, calls alternating between the variants (each compiled once,
before the timing) so that they see the same machine load; median of
``--reps`` calls, milliseconds.

Usage::

    python benchmarks/lean_stats.py --T 2048 --V 32000 --reps 9
"""

from __future__ import annotations

import torch
from _alternating import medians_ms, size_args

from dualvp_torch import kernels, logprob_entropy


def main() -> None:
    a = size_args(__doc__, "bfloat16,float32,float16")
    g = torch.Generator().manual_seed(0)
    default = kernels.FULL_STATS_CPU_DTYPES
    for name in a.dtypes.split(","):
        dt = getattr(torch, name)
        z = (torch.randn(a.T, a.V, generator=g) * 3).to(dt)
        y = torch.randint(0, a.V, (a.T,), generator=g)

        def call(full: bool, with_entropy: bool = False):
            kernels.FULL_STATS_CPU_DTYPES = frozenset({dt}) if full else frozenset()
            with torch.no_grad():
                return logprob_entropy(z, y, with_entropy=with_entropy, impl="compiled")[0]

        variants = {"lean": (False, False), "full": (True, False), "with entropy": (False, True)}
        outs = {k: call(*v) for k, v in variants.items()}  # compile each
        ms = medians_ms({k: (lambda v=v: call(*v)) for k, v in variants.items()}, a.reps, warm=0)
        kernels.FULL_STATS_CPU_DTYPES = default
        same = torch.equal(outs["lean"], outs["full"])
        print(f"{name:9s} T={a.T} V={a.V}: log-prob-only forward, lean {ms['lean']:.1f} ms, "
              f"full {ms['full']:.1f} ms; forward with entropy {ms['with entropy']:.1f} ms; "
              f"log-probs identical: {same}; default: {'full' if dt in default else 'lean'}")

if __name__ == "__main__":
    main()
