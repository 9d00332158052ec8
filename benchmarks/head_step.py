"""The LM-head step as a training loop runs it, JAX against torch, alternating in one process.

``dualvp bench`` hands each op ready-made logits, so every JAX call writes its
gradient into a fresh XLA buffer (all its 4 KiB pages fault on first write);
``dualvp_torch`` advised its own gradient buffer as huge pages by default
when this script was written, and by median the JAX op was 1.0-2.8x the
torch op there (README "JAX memory"). In a
training step the logits are made inside the step, from the hidden states
and the output weight, and both frameworks allocate them afresh every step.
This script times that step: ``loss = sum(gl * logprob + gh * entropy)`` and
its gradient with respect to ``hidden [T, H]`` and ``weight [V, H]``.

- ``jax``: ``jax.jit(jax.value_and_grad(loss, (0, 1)))`` with ``z = h @ W.T``
  (input dtype) and ``dualvp_jax.logprob_entropy``; XLA may write the
  logits' gradient into the logits' own buffer.
- ``jax-fused``: the same with ``dualvp_jax.linear_logprob_entropy`` (no
  ``[T, V]`` buffer at all).
- ``torch-advised``, ``torch-4k``: ``z = h @ W.T``,
  ``dualvp_torch.logprob_entropy``, backward; the op's gradient buffer
  advised as huge pages (``kernels.HUGE_PAGE_DEVICES = {"cpu"}``) or not
  (empty), set for the call whatever the package's default.
- ``torch-fused``: ``dualvp_torch.linear_logprob_entropy``, backward.
- ``jax-matmuls``, ``torch-matmuls``: the step's three products alone,
  ``z = h @ W.T``, ``G @ W`` and ``G.T @ h`` with a fixed ``G [T, V]`` (the
  logits' gradient a step would have), no log-prob: what each framework's
  step costs without the op, so that the op's share of the step is the
  difference.

The chosen ones (``--impls``, default all) take turns call by call (``_alternating.times_ms``); each is
reported as median, mean and max (ms) and minor page faults per call.
Before timing, every implementation's loss and gradients are compared with
the ``jax`` step's (largest difference relative to the largest magnitude),
so a fast wrong step cannot pass unnoticed.

Usage: python benchmarks/head_step.py [--T 2048 --H 1024 --V 32000 --dtypes float32,bfloat16 --reps 7
                                       --impls jax,torch-advised,torch-4k]
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
from dualvp_torch import kernels


def _rel_diff(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _steps(h, w, y, gl, gh, dtype: str):
    """The steps, each returning ``(loss, dh, dW)`` (the ``*-matmuls`` ones: ``(z, G W, G^T h)``)."""
    jdt = jnp.dtype(dtype)
    jh, jw = jnp.asarray(h).astype(jdt), jnp.asarray(w).astype(jdt)
    jy, jgl, jgh = jnp.asarray(y, jnp.int32), jnp.asarray(gl), jnp.asarray(gh)
    tdt = getattr(torch, dtype)
    th = torch.from_numpy(np.array(jh.astype(jnp.float32))).to(tdt)
    tw = torch.from_numpy(np.array(jw.astype(jnp.float32))).to(tdt)
    ty, tgl, tgh = torch.from_numpy(y.astype(np.int64)), torch.from_numpy(gl), torch.from_numpy(gh)

    def jax_loss(h, w):
        lp, ent = dualvp_jax.logprob_entropy(h @ w.T, jy)
        return jnp.sum(jgl * lp) + jnp.sum(jgh * ent)

    def jax_fused_loss(h, w):
        lp, ent = dualvp_jax.linear_logprob_entropy(h, w, jy)
        return jnp.sum(jgl * lp) + jnp.sum(jgh * ent)

    def jax_step(loss):
        step = jax.jit(jax.value_and_grad(loss, (0, 1)))

        def run():
            v, (dh, dw) = jax.block_until_ready(step(jh, jw))
            return v, dh, dw
        return run

    def torch_step(fused: bool, huge_pages: frozenset = kernels.HUGE_PAGE_DEVICES):
        def run():
            saved, kernels.HUGE_PAGE_DEVICES = kernels.HUGE_PAGE_DEVICES, huge_pages
            try:
                h, w = th.detach().requires_grad_(True), tw.detach().requires_grad_(True)
                if fused:
                    lp, ent = dualvp_torch.linear_logprob_entropy(h, w, ty)
                else:
                    lp, ent = dualvp_torch.logprob_entropy(h @ w.T, ty)
                loss = torch.sum(tgl * lp) + torch.sum(tgh * ent)
                loss.backward()
                return loss.detach(), h.grad, w.grad
            finally:
                kernels.HUGE_PAGE_DEVICES = saved
        return run

    jg = jax.random.normal(jax.random.PRNGKey(2), (jh.shape[0], jw.shape[0]), jnp.float32).astype(jdt)
    tg = torch.from_numpy(np.array(jg.astype(jnp.float32))).to(tdt)
    jax_products = jax.jit(lambda h, w, g: (h @ w.T, g @ w, g.T @ h))

    def jax_matmuls():
        return jax.block_until_ready(jax_products(jh, jw, jg))

    def torch_matmuls():
        return th @ tw.T, tg @ tw, tg.T @ th

    return {"jax": jax_step(jax_loss), "jax-fused": jax_step(jax_fused_loss),
            "torch-advised": torch_step(False, frozenset({"cpu"})), "torch-4k": torch_step(False, frozenset()),
            "torch-fused": torch_step(True),
            "jax-matmuls": jax_matmuls, "torch-matmuls": torch_matmuls}


def _as_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().float().numpy()
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


def main() -> None:
    ap = size_parser(__doc__, "float32,bfloat16", reps=7)
    ap.add_argument("--H", type=int, default=1024)
    ap.add_argument("--impls", default="", help="comma list of the implementations above (default: all)")
    a = ap.parse_args()
    for v in widths(a):
        for dtype in a.dtypes.split(","):
            rng = np.random.default_rng(0)
            h = rng.standard_normal((a.T, a.H), dtype=np.float32)
            w = rng.standard_normal((v, a.H), dtype=np.float32) * (2.0 / np.sqrt(a.H))
            y = rng.integers(0, v, a.T)
            gl, gh = rng.standard_normal(a.T).astype(np.float32), rng.standard_normal(a.T).astype(np.float32)
            steps = _steps(h, w, y, gl, gh, dtype)
            if a.impls:
                unknown = set(a.impls.split(",")) - set(steps)
                if unknown:
                    raise SystemExit(f"--impls: unknown {sorted(unknown)}; choose from {sorted(steps)}")
                steps = {k: f for k, f in steps.items() if k in a.impls.split(",") or k == "jax"}
            want = [_as_numpy(x) for x in steps["jax"]()]
            print(f"T={a.T} H={a.H} V={v} {dtype}", flush=True)
            for k, f in steps.items():
                if k.endswith("-matmuls"):
                    continue
                got = [_as_numpy(x) for x in f()]
                diffs = ", ".join(f"{n} {_rel_diff(g, r):.1e}" for n, g, r in zip(("loss", "dh", "dW"), got, want))
                print(f"    {k:13s} against jax: {diffs}", flush=True)
            ts, faults = times_and_faults(steps, a.reps, warm=1)
            for k, t in ts.items():
                print(f"    {k:13s} {spread(t)}, faults {statistics.median(faults[k]):.0f}", flush=True)


if __name__ == "__main__":
    main()
