"""The floor of a JAX ``jit(value_and_grad)`` over logits on this machine.

Reads the shard once (a float32 row sum) and writes a fresh gradient of the
logits' shape and dtype: what any forward + backward of a log-prob/entropy op
must at least do. README ("JAX memory") compares dualvp_jax's times with it.

Usage::

    python benchmarks/jax_floor.py 32000 152064      # V_local values; T = 2048
"""

import statistics
import sys
import time

import jax
import jax.numpy as jnp

T = 2048


def main(widths):
    for V in widths:
        for dt in (jnp.float32, jnp.bfloat16):
            z = jax.random.normal(jax.random.PRNGKey(0), (T, V), jnp.float32).astype(dt)
            w = jnp.linspace(0, 1, T, dtype=jnp.float32)
            f = jax.jit(jax.value_and_grad(lambda z: jnp.sum(jnp.sum(z.astype(jnp.float32), axis=-1) * w)))
            jax.block_until_ready(f(z))
            ts = []
            for _ in range(7):
                t0 = time.perf_counter()
                jax.block_until_ready(f(z))
                ts.append(time.perf_counter() - t0)
            print(f"V_local={V} {jnp.dtype(dt).name:9s} read once + fresh gradient: "
                  f"median {statistics.median(ts):.3f} s, min {min(ts):.3f} s")


if __name__ == "__main__":
    main([int(v) for v in sys.argv[1:]] or [32000])
