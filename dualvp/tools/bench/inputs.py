"""The bench's inputs and the float64 oracle it compares every implementation with.

Inputs: confident-LM logits (N(10, 3) with +25 spikes, :func:`dualvp.testing.cases.confident_lm_logits`),
targets sampled from the softmax, a top-``TOPK`` keep mask and N(0, 1) upstream
gradients. Errors: max abs error against :mod:`dualvp.reference` on the
dtype-rounded logits, non-finite entries matched by :func:`dualvp.testing.max_errors`.
"""

from __future__ import annotations

import numpy as np

from dualvp import reference
from dualvp.testing import cases

from .implementations import MODES

__all__ = ["TOPK", "make_inputs", "round_logits", "Oracle", "errors"]

TOPK = 64
FORWARD_ROWS = 1024


def make_inputs(T: int, V: int, seed: int, chunk: int = 64) -> dict:
    """Confident-LM logits (float64 in chunks -> float32), sampled targets,
    top-k keep mask and upstream gradients; deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    z = np.empty((T, V), dtype=np.float32)
    target = np.empty(T, dtype=np.int64)
    keep = np.zeros((T, V), dtype=bool)
    k = min(TOPK, V)
    for a in range(0, T, chunk):
        b = min(T, a + chunk)
        zc = cases.confident_lm_logits(rng, (b - a, V))
        z[a:b] = zc
        # the sampled token: Gumbel-max over softmax(z)
        g = rng.gumbel(size=(b - a, V))
        target[a:b] = np.argmax(zc + g, axis=-1)
        del g
        top = np.argpartition(-z[a:b], k - 1, axis=-1)[:, :k]
        np.put_along_axis(keep[a:b], top, True, axis=-1)
    gl = rng.normal(size=T).astype(np.float32)
    gh = rng.normal(size=T).astype(np.float32)
    return {"logits": z, "target": target, "keep": keep, "gl": gl, "gh": gh}


def round_logits(z32: np.ndarray, dtype: str, chunk: int = 256) -> np.ndarray:
    """``z32`` rounded to ``dtype`` (float32 storage), as :func:`dualvp.testing.cases.round_to_dtype`.

    bfloat16: the same round-to-nearest-even on the float32 bit pattern, done in uint32 (no float64
    or uint64 copies: ten times faster at the GPU sizes, where the bench waits for it); a finite
    pattern plus 0x8000 stays below 2**32, and non-finite entries are kept as they are.
    """
    if dtype == "float32":
        return z32
    out = np.empty_like(z32)
    for a in range(0, z32.shape[0], chunk):
        f = z32[a : a + chunk]
        if dtype == "bfloat16":
            bits = f.view(np.uint32)
            r = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
            out[a : a + chunk] = np.where(np.isfinite(f), r.view(np.float32), f)
        else:
            out[a : a + chunk] = cases.round_to_dtype(f, dtype)
    return out


class Oracle:
    """float64 reference outputs on the full (unsharded) logits.

    Log-prob and entropy over the first ``FORWARD_ROWS`` rows (or ``err_rows``
    if more), the gradient over the first ``err_rows`` rows (the rows are
    i.i.d.; the subsets keep the float64 work small at large T). Computed
    lazily per (mask, entropy-grad) and cached.
    """

    def __init__(self, inputs: dict, z: np.ndarray, err_rows: int, chunk: int = 64):
        self.inp, self.z, self.rows, self.chunk = inputs, z, min(err_rows, z.shape[0]), chunk
        self.fwd_rows = min(z.shape[0], max(err_rows, FORWARD_ROWS))
        self._fwd: dict = {}
        self._grad: dict = {}

    def forward(self, masked: bool):
        if masked not in self._fwd:
            T = self.fwd_rows
            lp, h = np.empty(T), np.empty(T)
            for a in range(0, T, self.chunk):
                sl = slice(a, a + self.chunk)
                km = self.inp["keep"][sl] if masked else None
                lp[sl], h[sl] = reference.logprob_entropy(self.z[sl], self.inp["target"][sl], keep_mask=km)
            self._fwd[masked] = (lp, h)
        return self._fwd[masked]

    def grad(self, masked: bool, ent_grad: bool):
        key = (masked, ent_grad)
        if key not in self._grad:
            g = np.empty((self.rows, self.z.shape[1]))
            for a in range(0, self.rows, self.chunk):
                sl = slice(a, min(self.rows, a + self.chunk))
                km = self.inp["keep"][sl] if masked else None
                g[sl] = reference.logprob_entropy_grad(
                    self.z[sl], self.inp["target"][sl], self.inp["gl"][sl].astype(np.float64),
                    self.inp["gh"][sl].astype(np.float64) if ent_grad else None, keep_mask=km,
                )
            self._grad[key] = g
        return self._grad[key]


def _maxabs(x, ref) -> float:
    return cases.max_errors(x, ref)[0]


def errors(oracle: Oracle, mode: str, lp, h, g) -> dict:
    """Max abs errors of one mode's outputs against the oracle (``None``: not computed)."""
    m = MODES[mode]
    rlp, rh = oracle.forward(m.masked)
    n = rlp.shape[0]
    out = {"logprob": _maxabs(lp[:n], rlp), "entropy": _maxabs(h[:n], rh) if m.with_entropy else None}
    rg = oracle.grad(m.masked, m.entropy_grad)
    out["grad"] = _maxabs(g[: rg.shape[0]], rg)
    out["grad_rows"] = int(rg.shape[0])
    return out
