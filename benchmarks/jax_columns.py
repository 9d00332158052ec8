"""dualvp_jax's CPU forward with rows reduced whole or in column blocks of several widths, side by side.

XLA:CPU's reduction library (YNNPACK fusions in jax 0.10) runs a row
reduction over at most 2**15 columns on all cores, a wider one on about one
(``dualvp_jax.chunks.COLUMN_BLOCK``). For each (dtype, mode) this compiles the
op's forward (``jit`` of ``sum(logprob) + sum(entropy)``, unsharded) once per
``--blocks`` entry (a column-block width, ``none``: whole rows) and
``--chunk-bytes`` entry (``dualvp_jax.chunks.CHUNK_BYTES``, the row budget)
and times the programs in alternating rounds (``benchmarks/_alternating.py``): median and
range, milliseconds. ``--grad`` times ``jit(grad)`` instead (forward and
backward, a fresh gradient per call). ``temp`` is the program's scratch
(``memory_analysis``) in B = bytes of the float32 logits.

Usage::

    python benchmarks/jax_columns.py --V 152064 --blocks 32768,16384,none
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--V", type=int, default=152064)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--modes", default="lp,ent,keep")
    ap.add_argument("--blocks", default="32768,none", help="column-block widths; 'none' for whole rows")
    ap.add_argument("--chunk-bytes", default=None,
                    help="comma list of row-chunk budgets in bytes (default: chunks.CHUNK_BYTES)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--grad", action="store_true", help="time jit(grad) instead of the forward")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import numpy as np
    import jax
    import jax.numpy as jnp

    import dualvp_jax
    from dualvp_jax import chunks
    from _alternating import times_ms

    budgets = [int(x) for x in a.chunk_bytes.split(",")] if a.chunk_bytes else [chunks.CHUNK_BYTES]
    variants = [(b, c) for b in a.blocks.split(",") for c in budgets]
    rows = []
    rng = np.random.default_rng(0)
    for dname in a.dtypes.split(","):
        z = jnp.asarray(rng.standard_normal((a.T, a.V), dtype=np.float32) * 3.0).astype(dname)
        y = jnp.asarray(rng.integers(0, a.V, a.T), dtype=jnp.int32)
        keep = jnp.asarray(rng.random((a.T, a.V), dtype=np.float32) < 0.5)
        for mode in a.modes.split(","):
            with_ent, k = mode != "lp", (keep if mode == "keep" else None)
            fns, temps = {}, {}
            for b, c in variants:
                # read at trace time; clear_caches so that the op's inner jit traces again
                chunks.COLUMN_BLOCK = 1 << 62 if b == "none" else int(b)
                chunks.CHUNK_BYTES = c
                jax.clear_caches()
                if len(budgets) > 1:
                    b = f"{b}/{c >> 10}K"

                def loss(z, k):
                    lp, h = dualvp_jax.logprob_entropy(z, y, keep_mask=k, with_entropy=with_ent)
                    return jnp.sum(lp) + (jnp.sum(h) if with_ent else 0.0)

                f = jax.jit(jax.grad(loss) if a.grad else loss).lower(z, k).compile()
                temps[b] = f.memory_analysis().temp_size_in_bytes / (a.T * a.V * 4)
                fns[b] = lambda f=f: jax.block_until_ready(f(z, k))
            times = times_ms(fns, a.reps, warm=1)
            row = {"dtype": dname, "mode": mode, "times_ms": times, "temp_B": temps,
                   "median_ms": {b: statistics.median(t) for b, t in times.items()}}
            rows.append(row)
            print(f"{a.T}x{a.V} {dname:8s} {mode:4s} {'grad' if a.grad else 'fwd'}: " + " | ".join(
                f"{b}: {row['median_ms'][b]:.1f} ms [{min(t):.0f}-{max(t):.0f}] temp {temps[b]:.3f} B"
                for b, t in times.items()), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": {"T": a.T, "V": a.V, "blocks": a.blocks, "chunk_bytes": budgets, "grad": a.grad, "reps": a.reps,
                                "jax": jax.__version__, "cpus": os.cpu_count()}, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
