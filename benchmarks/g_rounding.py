"""dh/dW error of the fused op's 16-bit backward products, G rounded once vs split hi + lo (NumPy, no kernels).

An independent formulation of what the kernels do with ``G``: the float64
oracle's ``G`` (``dualvp.reference``) through float32, rounded once to the
input dtype (``split_gradient=False``) or split into ``G_hi + G_lo``; products
in float64 (exact for the rounded values; the GPU accumulates in float32),
``dh``/``dW`` rounded once to the dtype as the op returns them. Printed: max
|error| / max |float64 result rounded once - float64 result| (the precision
goal is <= 2). Run: ``python benchmarks/g_rounding.py`` (docs/decisions.md,
"Fused backward: G split hi + lo stays the default").
"""

import itertools

import numpy as np

from dualvp import reference
from dualvp.testing import cases, oracle_linear
from dualvp.testing.cases import round_to_dtype


def ratios(dtype, mask, T, V, H, seed, temperature=0.7):
    c = cases.case("basic", lead=(T,), vocab=V, worlds=(1,), dtype=dtype, mask=mask, temperature=temperature,
                   seed=seed)
    P = cases.make_linear(c, H)
    ref = oracle_linear(P)
    g = reference.logprob_entropy_grad(P.hidden @ P.weight.T, P.target, P.grad_logprob, P.grad_entropy,
                                       keep_mask=P.keep_mask, temperature=P.case.temperature,
                                       ignore_index=P.case.ignore_index).astype(np.float32)
    hi = round_to_dtype(g.astype(np.float64), dtype)
    lo = round_to_dtype(g.astype(np.float64) - hi, dtype)
    out = {}
    for name, gg in (("once", hi), ("split", hi + lo)):
        dh, dw = round_to_dtype(gg @ P.weight, dtype), round_to_dtype(gg.T @ P.hidden, dtype)
        out[name] = [np.abs(x - r).max() / np.abs(round_to_dtype(r, dtype) - r).max()
                     for x, r in ((dh, ref.dh), (dw, ref.dW))]
    return out


def main():
    grid = list(itertools.product(["bfloat16", "float16"], ["none", "nucleus", "random"],
                                  [(256, 2048, 128), (64, 8192, 256)], [0, 3]))
    grid += [("bfloat16", "none", s, seed) for s in [(256, 2048, 128), (512, 4096, 512)] for seed in range(10)
             if not (s == (256, 2048, 128) and seed in (0, 3))]
    worst = {"once": 0.0, "split": 0.0}
    for dtype, mask, (T, V, H), seed in grid:
        r = ratios(dtype, mask, T, V, H, seed)
        for k in worst:
            worst[k] = max(worst[k], *r[k])
        print(f"{dtype:8s} {mask:7s} T={T} V={V} H={H} seed={seed}: once dh {r['once'][0]:.2f} dW {r['once'][1]:.2f}"
              f" | split dh {r['split'][0]:.2f} dW {r['split'][1]:.2f}", flush=True)
    print(f"{len(grid)} cases; worst: once {worst['once']:.2f}, split {worst['split']:.2f}")


if __name__ == "__main__":
    main()
