"""dualvp_jax's two forwards on one device: the whole shard vs row chunks.

``dualvp_jax`` picks its forward by platform (``lax.platform_dependent``):
row chunks on CPU, where XLA materialises a float32 ``[T, V_local]`` input
per row reduction, and the whole shard elsewhere, where XLA is expected to
fuse the reductions itself (not measured on a GPU yet). This script measures
both paths on the default JAX device (``JAX_PLATFORMS=cuda`` on a GPU
machine): for each dtype and mode, ``jax.jit(jax.value_and_grad(loss))`` with
``loss = sum(gl * logprob) + sum(gh * entropy)``, the median wall time of
``--reps`` calls (``block_until_ready``) and the compiled program's scratch
(``memory_analysis().temp_size_in_bytes``) as a multiple of B, the bytes of
the logits; the largest difference between the paths' outputs and gradients.
Modes: ``lp``, ``ent`` (log-prob and entropy), ``keep`` (``ent`` under a 50 %
keep mask).

Usage: python benchmarks/jax_paths.py [--T 4096 --V 32000 --dtypes float32,bfloat16 --modes lp,ent,keep]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import dualvp_jax
from dualvp_jax import function as _function

MODES = {"lp": (False, False), "ent": (True, False), "keep": (True, True)}


def _program(with_entropy: bool):
    def loss(z, y, gl, gh, keep):
        lp, h = dualvp_jax.logprob_entropy(z, y, keep_mask=keep, with_entropy=with_entropy)
        return jnp.sum(gl * lp) + (jnp.sum(gh * h) if with_entropy else 0.0), (lp, h)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--V", type=int, default=32000)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--modes", default="lp,ent,keep")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args(argv)
    print(f"device: {jax.devices()[0]}; T={a.T} V_local={a.V}; time per value_and_grad call, scratch / B")
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    for dname in a.dtypes.split(","):
        z = (jax.random.normal(k[0], (a.T, a.V)) * 3 + 10).astype(dname)
        y = jax.random.randint(k[1], (a.T,), 0, a.V)
        gl, gh = jax.random.normal(k[2], (a.T,)), jax.random.normal(k[3], (a.T,))
        keep = jax.random.uniform(k[4], (a.T, a.V)) < 0.5
        B = z.size * z.dtype.itemsize
        for mode in a.modes.split(","):
            with_entropy, masked = MODES[mode]
            args = (z, y, gl, gh, keep if masked else None)
            res = {}
            for path in ("whole", "chunked"):
                _function._FORCE_PATH = path
                jax.clear_caches()  # the path is read at trace time: no program traced for the other path
                try:
                    f = _program(with_entropy)
                    compiled = f.lower(*args).compile()
                    out = jax.block_until_ready(compiled(*args))
                    ts = []
                    for _ in range(a.reps):
                        t = time.perf_counter()
                        jax.block_until_ready(compiled(*args))
                        ts.append(time.perf_counter() - t)
                    temp = compiled.memory_analysis().temp_size_in_bytes / B
                finally:
                    _function._FORCE_PATH = ""
                    jax.clear_caches()
                res[path] = (statistics.median(ts), temp, out)
            (tw, mw, ow), (tc, mc, oc) = res["whole"], res["chunked"]
            diff = max(float(jnp.max(jnp.abs(jnp.asarray(u, jnp.float32) - jnp.asarray(v, jnp.float32))))
                       for u, v in zip(jax.tree.leaves(ow), jax.tree.leaves(oc)))
            print(f"{dname:9s} {mode:5s} whole {tw * 1e3:8.2f} ms ({mw:.2f} B)   chunked {tc * 1e3:8.2f} ms ({mc:.2f} B)"
                  f"   chunked/whole {tc / tw:.2f}   max diff {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
