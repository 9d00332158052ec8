"""dualvp_jax's gradient under both of ``spec.block_grad``'s ``indicator`` choices, side by side.

``indicator`` says how the gradient's element loop forms ``1[v = y]``:
``"compare"`` (a compare with the target's column, converted) or
``"arith"`` (``max(1 - |v - y|, 0)`` in integers, no compare). For each
dtype and mode (unmasked, keep mask) this times, calls alternating
(``benchmarks/_alternating.py``), dualvp_jax unsharded traced once per
choice (``dualvp_jax.function._INDICATOR``): the backward alone (the
``jax.vjp`` closure under ``jit``) and ``jit(value_and_grad)`` of
``sum(logprob) + 0.01 * sum(entropy)``. It checks that both choices give
bit-identical gradients. Median, mean, max in milliseconds.

Usage::

    python benchmarks/grad_indicator.py --T 2048 --V 32000 --reps 9
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from _alternating import size_args, spread, times_ms

import dualvp_jax
from dualvp_jax import function as jax_function

CHOICES = ("compare", "arith")


def _programs(z, y, keep, how):
    """``(backward alone, value_and_grad)``, each a no-argument call, traced with ``indicator=how``."""
    jax_function._INDICATOR = how
    jax.clear_caches()  # the op's inner jit traces again, with this choice
    # The target and the mask are arguments of the programs (data, as in
    # training): captured, they would be constants that XLA may fold into the
    # gradient's loop.
    ct = (jnp.ones(y.shape, jnp.float32), jnp.full(y.shape, 0.01, jnp.float32))
    _, vjp = jax.vjp(lambda z: dualvp_jax.logprob_entropy(z, y, keep_mask=keep), z)
    bwd = jax.jit(lambda f, ct: f(ct)[0]).lower(vjp, ct).compile()

    def loss(z, y, keep):
        lp, ent = dualvp_jax.logprob_entropy(z, y, keep_mask=keep)
        return jnp.sum(lp) + 0.01 * jnp.sum(ent)

    vg = jax.jit(jax.value_and_grad(loss)).lower(z, y, keep).compile()
    return (lambda: jax.block_until_ready(bwd(vjp, ct))), (lambda: jax.block_until_ready(vg(z, y, keep)))


def main() -> None:
    a = size_args(__doc__, "float32,bfloat16")
    rng = np.random.default_rng(0)
    default = jax_function._INDICATOR
    try:
        for name in a.dtypes.split(","):
            for masked in (False, True):
                z = jnp.asarray(rng.standard_normal((a.T, a.V), dtype=np.float32) * 3.0).astype(name)
                y = jnp.asarray(rng.integers(0, a.V, a.T), dtype=jnp.int32)
                keep = jnp.asarray(rng.random((a.T, a.V)) < 0.5) if masked else None
                fns = {}
                for how in CHOICES:
                    fns[f"backward {how}"], fns[f"value_and_grad {how}"] = _programs(z, y, keep, how)
                grads = [np.asarray(fns[f"value_and_grad {how}"]()[1], np.float32) for how in CHOICES]
                np.testing.assert_array_equal(grads[0], grads[1])
                del grads
                times = times_ms(fns, a.reps)
                print(f"{a.T}x{a.V} {name} {'keep mask' if masked else 'unmasked'}:")
                for k in sorted(times):
                    print(f"  {k:22s} {spread(times[k])}")
                del fns, times
    finally:
        jax_function._INDICATOR = default


if __name__ == "__main__":
    main()
