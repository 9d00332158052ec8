"""Where the JAX op's gradient goes, and what it costs on a CPU: fresh or recycled; the torch op beside it.

Three variants of one forward + backward (``value_and_grad`` of
``sum(gl * logprob) + sum(gh * entropy)``, or of the log-prob term alone),
alternating call by call in one process (``_alternating.times_ms``):

- ``jax-fresh``: ``jax.jit(jax.value_and_grad(loss))``; XLA writes the
  gradient into a fresh buffer, whose 4 KiB pages all fault on first write.
- ``jax-recycled``: the same step donating the previous call's gradient
  (``donate_argnums``, ``keep_unused=True``), which XLA then reuses for the
  new one (README "JAX"): the logits survive the step, one gradient's bytes
  stay held between steps.
- ``torch``: ``dualvp_torch.logprob_entropy`` forward + backward, its
  gradient buffer as ``kernels.HUGE_PAGE_DEVICES`` says (not advised by
  default since 2026-12-05; advised as huge pages before, when the figures in
  the README were taken).

Each is reported as median, mean and max (ms), calls over 2.5x the median,
and the process's minor page faults per call. The recycled gradient is
checked to equal the fresh one bit for bit first. (Donating the logits
themselves: the bench's ``dualvp-jax-donated``.)

Usage: python benchmarks/jax_recycled.py [--T 2048 --V 32000,152064 --dtypes float32,bfloat16 --reps 9]
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np
import torch
from _alternating import size_parser, spread, times_and_faults, widths

import dualvp_jax
import dualvp_torch


def main() -> None:
    ap = size_parser(__doc__, "float32,bfloat16", V="32000,152064")
    ap.add_argument("--modes", default="lp,lp+ent+grad")
    a = ap.parse_args()
    for v in widths(a):
        for name in a.dtypes.split(","):
            rng = np.random.default_rng(0)
            x = (rng.standard_normal((a.T, v), dtype=np.float32) * 2).astype(np.float32)
            yy = rng.integers(0, v, a.T).astype(np.int64)
            gl, gh = rng.standard_normal(a.T).astype(np.float32), rng.standard_normal(a.T).astype(np.float32)
            jdt = jnp.dtype(name)
            z, y, jgl, jgh = jnp.asarray(x).astype(jdt), jnp.asarray(yy, jnp.int32), jnp.asarray(gl), jnp.asarray(gh)
            tz = torch.from_numpy(np.array(z.astype(jnp.float32))).to(getattr(torch, name))
            ty, tgl, tgh = torch.from_numpy(yy), torch.from_numpy(gl), torch.from_numpy(gh)
            for mode in a.modes.split(","):
                ent = mode != "lp"

                def loss(z):
                    lp, h = dualvp_jax.logprob_entropy(z, y, with_entropy=ent)
                    return jnp.sum(jgl * lp) + (jnp.sum(jgh * h) if ent else 0.0)

                vg = jax.value_and_grad(loss)
                fresh = jax.jit(vg)
                recycled = jax.jit(lambda z, old: vg(z), donate_argnums=1, keep_unused=True)
                want = fresh(z)[1]
                state = {"g": jnp.copy(want)}

                def jax_fresh():
                    jax.block_until_ready(fresh(z))

                def jax_recycled():
                    state["g"] = jax.block_until_ready(recycled(z, state["g"]))[1]

                def torch_op():
                    q = tz.detach().requires_grad_(True)
                    lp, h = dualvp_torch.logprob_entropy(q, ty, with_entropy=ent)
                    torch.autograd.backward((lp, h) if ent else (lp,), (tgl, tgh) if ent else (tgl,))
                    return q.grad

                jax_recycled()
                assert np.array_equal(np.asarray(state["g"]), np.asarray(want))
                fns = {"jax-fresh": jax_fresh, "jax-recycled": jax_recycled, "torch": torch_op}
                ts, faults = times_and_faults(fns, a.reps, warm=2)
                print(f"{a.T}x{v} {name:9s} {mode}")
                for k, t in ts.items():
                    print(f"    {k:13s} {spread(t)}, faults {statistics.median(faults[k]):.0f}", flush=True)


if __name__ == "__main__":
    main()
