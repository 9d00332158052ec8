"""dualvp_jax against dualvp_torch, unsharded, in one process with calls alternating.

``dualvp bench`` runs each implementation in its own process, 3 (2) calls per
case, one case after another, which cannot resolve differences of 10-30 % on
a VM whose speed drifts between runs. Here both ops run in one process on the
bench's own inputs (:func:`dualvp.tools.bench.inputs.make_inputs`:
confident-LM logits, sampled targets, a top-64 keep mask, N(0, 1) upstream
gradients), for each dtype and mode of :data:`dualvp.testing.modes.MODES`:

- ``torch fwd``: ``dualvp_torch.logprob_entropy`` with autograd recording
  (what a training step runs), ``torch f+b``: that and ``backward()`` of
  ``sum(gl * logprob) + sum(gh * entropy)`` (the entropy term only when the
  mode asks for its gradient), the bench's loss;
- ``jax fwd``: ``jit`` of ``dualvp_jax.logprob_entropy``, ``jax f+b``:
  ``jit(value_and_grad)`` of the same loss (how JAX code trains).

Calls alternate (``benchmarks/_alternating.py``) with a pause of ``--pause``
seconds before each, so that the idle threads of one framework's pool have
stopped spinning when the other's call starts. It prints each median, mean
and max, and the ratios jax/torch of the medians. It checks that the two ops'
log-probs agree to 1e-4 (they compute the same float32 math).

Usage::

    python benchmarks/jax_vs_torch.py --T 2048 --V 32000,152064 --reps 7
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np
import torch
from _alternating import size_parser, spread, times_ms, widths

import dualvp_jax
import dualvp_torch
from dualvp.testing.modes import MODES
from dualvp.tools.bench.inputs import make_inputs, round_logits


def _torch_calls(d: dict, dtype: str, mode):
    z = torch.from_numpy(d["logits"]).to(getattr(torch, dtype)).requires_grad_(True)
    y = torch.from_numpy(d["target"])
    keep = torch.from_numpy(d["keep"]) if mode.masked else None
    gl, gh = torch.from_numpy(d["gl"]), torch.from_numpy(d["gh"])

    def fwd():
        return dualvp_torch.logprob_entropy(z, y, keep_mask=keep, **mode.options())

    def fb():
        lp, h = fwd()
        loss = (gl * lp).sum() + ((gh * h).sum() if mode.entropy_grad else 0.0)
        loss.backward()
        z.grad = None
        return lp

    return fwd, fb


def _jax_calls(d: dict, dtype: str, mode):
    z = jnp.asarray(d["logits"]).astype(dtype)
    y = jnp.asarray(d["target"].astype(np.int32))
    keep = jnp.asarray(d["keep"]) if mode.masked else None
    gl, gh = jnp.asarray(d["gl"]), jnp.asarray(d["gh"])

    def op(z, y, keep):
        return dualvp_jax.logprob_entropy(z, y, keep_mask=keep, **mode.options())

    def loss(z, y, keep, gl, gh):
        lp, h = op(z, y, keep)
        return jnp.sum(gl * lp) + (jnp.sum(gh * h) if mode.entropy_grad else 0.0), lp

    f = jax.jit(op).lower(z, y, keep).compile()
    vg = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(z, y, keep, gl, gh).compile()
    return (lambda: jax.block_until_ready(f(z, y, keep))), (lambda: jax.block_until_ready(vg(z, y, keep, gl, gh)))


def main() -> None:
    ap = size_parser(__doc__, "float32,bfloat16", V="32000,152064", reps=7)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--pause", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), jax {jax.__version__}; "
          f"T={a.T}, reps {a.reps}, pause {a.pause} s", flush=True)
    summary = []
    for v in widths(a):
        d = make_inputs(a.T, v, a.seed)
        for dtype in a.dtypes.split(","):
            dd = dict(d, logits=round_logits(d["logits"], dtype))  # from the float32 logits for every dtype
            for name in a.modes.split(","):
                mode = MODES[name]
                tf, tfb = _torch_calls(dd, dtype, mode)
                jf, jfb = _jax_calls(dd, dtype, mode)
                lt = tf()[0].detach().float().numpy()
                lj = np.asarray(jf()[0], np.float32)
                np.testing.assert_allclose(lj, lt, atol=1e-4, rtol=0)
                fns = {"torch fwd": tf, "jax fwd": jf, "torch f+b": tfb, "jax f+b": jfb}
                times = times_ms(fns, a.reps, warm=2, pause=a.pause)
                med = {k: statistics.median(t) for k, t in times.items()}
                rf, rfb = med["jax fwd"] / med["torch fwd"], med["jax f+b"] / med["torch f+b"]
                summary.append((v, dtype, name, rf, rfb))
                print(f"{a.T}x{v} {dtype} {name}: jax/torch forward {rf:.2f}, forward+backward {rfb:.2f}")
                for k in fns:
                    print(f"  {k:10s} {spread(times[k])}", flush=True)
                del fns, tf, tfb, jf, jfb
    print("\nsummary, jax/torch of the medians:")
    for v, dtype, name, rf, rfb in summary:
        print(f"  {v:6d} {dtype:8s} {name:17s} forward {rf:.2f}  forward+backward {rfb:.2f}")
    fb = [s[4] for s in summary]
    print(f"forward+backward: median {statistics.median(fb):.2f}, {sum(r <= 1.0 for r in fb)}/{len(fb)} cases "
          f"no slower, worst {max(fb):.2f}")


if __name__ == "__main__":
    main()
