"""dh/dW error of the fused op's 16-bit backward products, by how G enters them (NumPy, no kernels).

An independent formulation of what the kernels do with the gradient tile
``G``: the float64 oracle's ``G`` (``dualvp.reference``) through float32,
then, per variant:

- ``once``: rounded once to the input dtype (``gradient_rounding="once"``);
- ``split``: ``G_hi + G_lo``, each rounded (the hi/lo split, 12 T H V FLOP);
- ``target``: rounded once, and the target column's rounding error
  ``G[t, y_t] - rnd(G[t, y_t])`` (float32) added back as a rank-1 term per row
  (``dh_t += d_t W[y_t]``, ``dW[y_t] += d_t h_t``: 4 T H FLOP beside 8 T H V);
- ``top1``: the same correction at the row's largest logit instead (the
  column whose ``|G|`` is the largest in a peaked row);
- ``tgt+p>1/2``: both corrections where a kernel can place them without
  coordination: the target column (one per row) and the column with
  ``p_v > 1/2`` (at most one per row): ``gradient_rounding="fixed"`` until
  it took the next one;
- ``fixed``: the same with every column of ``p_v > 1/3`` (at most two per
  row, the target among them or not; the kernel's slots 1 and 2 take the
  row's lowest and highest such column, an atomic min and max over its
  tiles): ``gradient_rounding="fixed"``;
- ``scaled`` (float16 only): rounded once after a power-of-two scale of the
  whole tile (``max |G|`` to ``[2^14, 2^15)``, undone on the float32 results):
  keeps small upstream gradients out of float16's subnormals.

Products in float64 (exact for the rounded values; the GPU accumulates in
float32), ``dh``/``dW`` rounded once to the dtype as the op returns them
(the reference, float64 ``G W`` / ``G^T h``, is rounded the same way: every
implementation returns 16-bit gradients). Printed: max |error| / max
|float64 result rounded once - float64 result| (the precision goal is <= 2),
and how many cases fail the fused tests' elementwise tolerance
(``dualvp.testing.metrics.tolerance``, ``dh``/``dW``: ``atol = atol_grad *
max(1, max |ref|)``, ``rtol``), which the split meets.
Cases: bfloat16/float16 x masks none/nucleus/random x two shapes x 2 seeds,
bfloat16 unmasked x 20 seeds at two shapes, bfloat16/float16 with every
column but the target masked (a top-1 keep mask: greedy replay; rows whose
second column has ``1/3 < p <= 1/2``) at T 20, V 150, H 48, 20 % ignored
rows x 6 seeds (seed 3 in float16: the fused tests' case that ``tgt+p>1/2``
failed) and at the first shape x 2 seeds, and float16 with upstream
gradients of 1e-4 (a loss averaged over ~10^4 tokens).
Run: ``python benchmarks/g_rounding.py`` (docs/decisions.md, "Fused op:
batch invariance and G rounding").
"""

import itertools

import numpy as np

from dualvp import reference
from dualvp.testing import cases
from dualvp.testing.cases import round_to_dtype
from dualvp.testing.metrics import tolerance, within_tolerance

VARIANTS = ("once", "split", "target", "top1", "tgt+p>1/2", "fixed", "scaled")


def ratios(dtype, mask, T, V, H, seed, temperature=0.7, grad_scale=1.0, ignore_frac=None):
    kw = {} if ignore_frac is None else {"ignore_frac": ignore_frac}
    c = cases.case("basic", lead=(T,), vocab=V, worlds=(1,), dtype=dtype, mask=mask, temperature=temperature,
                   seed=seed, **kw)
    P = cases.make_linear(c, H)
    gl, ge = P.grad_logprob * grad_scale, P.grad_entropy * grad_scale
    g64 = reference.logprob_entropy_grad(P.hidden @ P.weight.T, P.target, gl, ge, keep_mask=P.keep_mask,
                                         temperature=P.case.temperature, ignore_index=P.case.ignore_index)
    ref_dh, ref_dw = g64 @ P.weight, g64.T @ P.hidden
    g = g64.astype(np.float32).astype(np.float64)
    hi = round_to_dtype(g, dtype)
    lo = round_to_dtype(g - hi, dtype)
    tgt = hi.copy()
    rows = np.nonzero((P.target >= 0) & (P.target < V))[0]
    tgt[rows, P.target[rows]] = g[rows, P.target[rows]]  # the rank-1 correction, exact in float32
    top = hi.copy()
    a = np.argmax(P.hidden @ P.weight.T, axis=1)
    top[np.arange(T), a] = g[np.arange(T), a]
    u = (P.hidden @ P.weight.T) / temperature
    p = np.exp(u - u.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    peak = np.where(p > 0.5, g, tgt)
    third = np.where(p > 1 / 3, g, tgt)
    gmax = np.abs(g).max()
    scale = 2.0 ** (14 - np.floor(np.log2(gmax))) if gmax > 0 else 1.0
    variants = {"once": (hi, 1.0), "split": (hi + lo, 1.0), "target": (tgt, 1.0), "top1": (top, 1.0),
                "tgt+p>1/2": (peak, 1.0), "fixed": (third, 1.0)}
    if dtype == "float16":
        variants["scaled"] = (round_to_dtype(g * scale, dtype), 1.0 / scale)
    out = {}
    for name, (gg, undo) in variants.items():
        dh = round_to_dtype((gg @ P.weight) * undo, dtype)
        dw = round_to_dtype((gg.T @ P.hidden) * undo, dtype)
        out[name] = [np.abs(x - r).max() / np.abs(round_to_dtype(r, dtype) - r).max()
                     for x, r in ((dh, ref_dh), (dw, ref_dw))]
        out[name].append(all(within_tolerance(x, r, tolerance(dtype, q, r))
                             for x, r, q in ((dh, ref_dh, "dh"), (dw, ref_dw, "dW"))))
    return out


def main():
    grid = [(d, m, s, seed, 1.0, None) for d, m, s, seed in itertools.product(
        ["bfloat16", "float16"], ["none", "nucleus", "random"], [(256, 2048, 128), (64, 8192, 256)], [0, 3])]
    grid += [("bfloat16", "none", s, seed, 1.0, None) for s in [(256, 2048, 128), (512, 4096, 512)]
             for seed in range(20) if not (s == (256, 2048, 128) and seed in (0, 3))]
    # a top-1 keep mask (tests/torch/test_linear_triton.py's _case: 20 % ignored rows)
    grid += [(d, "all_but_target", (20, 150, 48), seed, 1.0, 0.2) for d in ("bfloat16", "float16") for seed in range(6)]
    grid += [(d, "all_but_target", (256, 2048, 128), seed, 1.0, None) for d in ("bfloat16", "float16")
             for seed in (0, 3)]
    grid += [("float16", m, (256, 2048, 128), seed, 1e-4, None) for m in ("none", "nucleus") for seed in (0, 1, 2)]
    worst = {gs: {k: 0.0 for k in VARIANTS} for gs in (1.0, 1e-4)}  # by upstream gradient scale
    over = {gs: {k: 0 for k in VARIANTS} for gs in (1.0, 1e-4)}
    off_tol = {gs: {k: 0 for k in VARIANTS} for gs in (1.0, 1e-4)}  # cases outside the tests' tolerance
    for dtype, mask, (T, V, H), seed, gs, ign in grid:
        r = ratios(dtype, mask, T, V, H, seed, grad_scale=gs, ignore_frac=ign)
        for k, v in r.items():
            worst[gs][k] = max(worst[gs][k], *v[:2])
            over[gs][k] += max(v[:2]) > 2.0
            off_tol[gs][k] += not v[2]
        print(f"{dtype:8s} {mask:7s} T={T} V={V} H={H} seed={seed} grads x{gs:g}: "
              + " | ".join(f"{k} dh {v[0]:.2f} dW {v[1]:.2f}{'' if v[2] else ' (tol)'}" for k, v in r.items()),
            flush=True)
    for gs in (1.0, 1e-4):
        n = sum(g == gs for *_, g, _ in grid)
        print(f"grads x{gs:g}, {n} cases; worst: "
              + ", ".join(f"{k} {worst[gs][k]:.2f} ({over[gs][k]} > 2, {off_tol[gs][k]} off tol)" for k in VARIANTS
                        if worst[gs][k] or k != "scaled"))

if __name__ == "__main__":
    main()
