"""The forward with entropy under both of ``spec.block_stats``'s ``entropy_terms``, JAX and torch eager, side by side.

``entropy_terms`` says how the entropy's terms ``e^d d`` avoid ``0 * -inf``
on banned columns: ``"clamp"`` (``d`` clamped before ``e^d`` and the
product) or ``"select"`` (``0`` where ``e^d = 0``). For each dtype this
times, calls alternating (``benchmarks/_alternating.py``), the forward of
``logprob_entropy(z, y)`` unsharded: dualvp_jax under ``jit``, traced once per
choice (``dualvp_jax.function._ENTROPY_TERMS``), and dualvp_torch's eager
kernels (``DUALVP_COMPILE=0``, which run the spec at each call) with either
choice, with the compiled torch forward for scale (it traces the spec's
default, ``"clamp"``; ``"select"`` compiled took the same time, measured with
the default changed). It checks that both choices give the same outputs.
Median, mean, max in milliseconds.

Usage::

    python benchmarks/entropy_terms.py --T 2048 --V 152064 --reps 9
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import torch
from _alternating import size_args, spread, times_ms

import dualvp_jax
import dualvp_torch
from dualvp import spec
from dualvp_jax import function as jax_function

CHOICES = ("clamp", "select")


def _jax_forward(z, y, how):
    jax_function._ENTROPY_TERMS = how
    jax.clear_caches()  # the op's inner jit traces again, with this choice
    f = jax.jit(lambda z: dualvp_jax.logprob_entropy(z, y)).lower(z).compile()
    return lambda: jax.block_until_ready(f(z))


def _torch_forward(z, y, how=None):
    block_stats = spec.block_stats

    def run():
        compile_env = os.environ.get("DUALVP_COMPILE")
        if how is not None:
            spec.block_stats = functools.partial(block_stats, entropy_terms=how)
            os.environ["DUALVP_COMPILE"] = "0"
        try:
            with torch.no_grad():
                return dualvp_torch.logprob_entropy(z, y)
        finally:
            spec.block_stats = block_stats
            if compile_env is None:
                os.environ.pop("DUALVP_COMPILE", None)
            else:
                os.environ["DUALVP_COMPILE"] = compile_env

    return run


def _np(x) -> np.ndarray:
    return x.float().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, np.float32)


def main() -> None:
    a = size_args(__doc__, "float32,bfloat16")
    rng = np.random.default_rng(0)
    default = jax_function._ENTROPY_TERMS
    try:
        for name in a.dtypes.split(","):
            z32 = rng.standard_normal((a.T, a.V), dtype=np.float32) * 3.0
            z32[:, :: 7] = -np.inf  # banned columns: the terms' 0 * -inf case
            yy = rng.integers(0, a.V, a.T)
            yy = np.where(np.arange(a.V)[yy] % 7 == 0, yy + 1, yy) % a.V
            zj, yj = jnp.asarray(z32).astype(name), jnp.asarray(yy, dtype=jnp.int32)
            zt, yt = torch.from_numpy(z32.copy()).to(getattr(torch, name)), torch.from_numpy(yy)
            fns = {f"jax {how}": _jax_forward(zj, yj, how) for how in CHOICES}
            fns.update({f"torch-eager {how}": _torch_forward(zt, yt, how) for how in CHOICES})
            fns["torch compiled"] = _torch_forward(zt, yt)
            outs = {k: [_np(x) for x in f()] for k, f in fns.items()}
            ref = outs["jax clamp"]
            for k, o in outs.items():
                for x, r in zip(o, ref):
                    np.testing.assert_allclose(x, r, rtol=1e-5, atol=1e-5, err_msg=k)
            times = times_ms(fns, a.reps)
            print(f"{a.T}x{a.V} {name} forward with entropy:")
            for k, t in times.items():
                print(f"  {k:16s} {spread(t)}")
    finally:
        jax_function._ENTROPY_TERMS = default


if __name__ == "__main__":
    main()
