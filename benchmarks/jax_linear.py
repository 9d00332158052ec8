"""JAX fused LM head vs unfused, side by side in one process (unsharded, one device).

Implementations, each timed as ``jax.jit(jax.value_and_grad(loss, (0, 1)))``
with ``loss = sum(gL * logprob + gH * entropy)`` (random upstream gradients):

  fused            dualvp_jax.linear_logprob_entropy(h, W, y)
  unfused          logits = h @ W.T (in the input dtype), then dualvp_jax.logprob_entropy
  unfused-f32      (bfloat16 only) the logits as float32 from the bf16 operands
                   (preferred_element_type=float32), then dualvp_jax.logprob_entropy

Memory: XLA's ``memory_analysis().temp_size_in_bytes`` of the compiled
forward + backward (scratch beyond the arguments and the returned
gradients), in units of ``B = T * V * itemsize`` (the logits the unfused
path holds, in the input dtype).

Timing: ``--rounds`` rounds; in each round every implementation runs
``--reps`` times back to back (interleaved round by round); the figure is
the best over rounds of the per-round median. The CPU load (``uptime``) is
recorded before and after: the numbers are only comparable within one run.

Errors: the same compiled function with the upstream gradients zeroed
outside the first ``--check-rows`` rows, against a float64 formulation
(``z = h W^T`` in float64 from the rounded inputs, ``dualvp.reference``,
``dh = G W``, ``dW = G^T h``); max absolute error of log-prob, entropy, dh, dW
(dh and dW relative to the max |reference|).

Usage::

    python benchmarks/jax_linear.py --T 2048 --H 1024 --V 32000 --dtypes float32,bfloat16 \\
        --out benchmarks/result_jax_linear_cpu_T2048_H1024_V32000.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import dualvp_jax  # noqa: E402
from dualvp import reference  # noqa: E402
from dualvp.testing import cases, metrics  # noqa: E402

_JNP = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception:  # noqa: BLE001 - informational only
        return "?"


def _fused(y, kw):
    def fused(h, w, gl, ge):
        lp, ent = dualvp_jax.linear_logprob_entropy(h, w, y, **kw)
        return jnp.sum(gl * lp) + jnp.sum(ge * ent)

    return fused


def _impls(dtype: str, y, kw: dict, budgets):

    def unfused(h, w, gl, ge):
        lp, ent = dualvp_jax.logprob_entropy(h @ w.T, y)
        return jnp.sum(gl * lp) + jnp.sum(ge * ent)

    def unfused_f32(h, w, gl, ge):
        z = jax.lax.dot_general(h, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        lp, ent = dualvp_jax.logprob_entropy(z, y)
        return jnp.sum(gl * lp) + jnp.sum(ge * ent)

    out = {"fused": _fused(y, kw)}
    for mib in budgets:
        out[f"fused@{mib}MiB"] = _fused(y, dict(kw, memory_budget=int(mib * 2**20)))
    out["unfused"] = unfused
    if dtype != "float32":
        out["unfused-f32"] = unfused_f32
    return {k: jax.jit(jax.value_and_grad(f, argnums=(0, 1))) for k, f in out.items()}


def _errors(fn, h, w, y, gl, ge, rows: int):
    """Max errors of the compiled ``fn`` against float64, upstream gradients only on the first ``rows`` rows."""
    mask = np.arange(h.shape[0]) < rows
    gl0 = jnp.asarray(np.where(mask, np.asarray(gl), 0.0), jnp.float32)
    ge0 = jnp.asarray(np.where(mask, np.asarray(ge), 0.0), jnp.float32)
    # log-prob / entropy: read back through the vjp of the outputs is not available from
    # value_and_grad, so compute them with a second, forward-only jit of the same op.
    h64 = np.asarray(jnp.asarray(h, jnp.float32), np.float64)
    w64 = np.asarray(jnp.asarray(w, jnp.float32), np.float64)
    yr = np.asarray(y)[:rows]
    z64 = h64[:rows] @ w64.T
    rlp, rent = reference.logprob_entropy(z64, yr)
    g = reference.logprob_entropy_grad(z64, yr, np.asarray(gl0, np.float64)[:rows], np.asarray(ge0, np.float64)[:rows])
    rdh, rdw = g @ w64, g.T @ h64[:rows]
    _, (dh, dw) = fn(h, w, gl0, ge0)
    dh = np.asarray(jnp.asarray(dh, jnp.float32), np.float64)
    dw = np.asarray(jnp.asarray(dw, jnp.float32), np.float64)
    return rlp, rent, {
        "dh_rel": float(np.abs(dh[:rows] - rdh).max() / np.abs(rdh).max()),
        "dh_outside_rows_max": float(np.abs(dh[rows:]).max()) if rows < h.shape[0] else 0.0,
        "dW_rel": float(np.abs(dw - rdw).max() / np.abs(rdw).max()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--H", type=int, default=1024)
    ap.add_argument("--V", type=int, default=32000)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--check-rows", type=int, default=256)
    ap.add_argument("--memory-budget", type=int, default=None, help="bytes of one float32 logits block")
    ap.add_argument("--budgets", default="", help="extra fused rows at these memory budgets (MiB, comma list)")
    ap.add_argument("--vocab-block", type=int, default=None)
    ap.add_argument("--token-block", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    T, H, V = args.T, args.H, args.V
    kw = {k: v for k, v in (("memory_budget", args.memory_budget), ("vocab_block", args.vocab_block),
                            ("token_block", args.token_block)) if v is not None}
    result = {"T": T, "H": H, "V_local": V, "device": jax.default_backend(), "devices": len(jax.devices()),
              "cpu_count": os.cpu_count(), "jax": jax.__version__, "op_kwargs": kw, "uptime_before": _uptime(),
              "rows": []}
    rng = np.random.default_rng(0)
    for dtype in args.dtypes.split(","):
        h64 = cases.round_to_dtype(rng.normal(size=(T, H)), dtype)
        # logits of std ~2.5 with a few confident rows, like an LM head
        w64 = cases.round_to_dtype(rng.normal(scale=2.5 / np.sqrt(H), size=(V, H)), dtype)
        h = jnp.asarray(h64, jnp.float32).astype(_JNP[dtype])
        w = jnp.asarray(w64, jnp.float32).astype(_JNP[dtype])
        y = jnp.asarray(rng.integers(0, V, size=T))
        gl = jnp.asarray(rng.normal(size=T), jnp.float32)
        ge = jnp.asarray(rng.normal(size=T), jnp.float32)
        B = T * V * jnp.dtype(_JNP[dtype]).itemsize
        budgets = [float(b) for b in args.budgets.split(",") if b]
        fns = _impls(dtype, y, kw, budgets)
        rows = {}
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(h, w, gl, ge))
            first = time.perf_counter() - t0
            mem = fn.lower(h, w, gl, ge).compile().memory_analysis()
            rows[name] = {"dtype": dtype, "impl": name, "first_call_s": first, "rounds": [],
                          "temp_bytes": int(mem.temp_size_in_bytes), "temp_B": mem.temp_size_in_bytes / B,
                          "output_bytes": int(mem.output_size_in_bytes)}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                ts = []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(h, w, gl, ge))
                    ts.append(time.perf_counter() - t0)
                rows[name]["rounds"].append(statistics.median(ts))
        # forward values for the error check: a forward-only jit of each implementation
        fwd = {
            "fused": jax.jit(lambda h, w: dualvp_jax.linear_logprob_entropy(h[: args.check_rows], w,
                                                                            y[: args.check_rows], **kw)),
            "unfused": jax.jit(lambda h, w: dualvp_jax.logprob_entropy(h[: args.check_rows] @ w.T, y[: args.check_rows])),
            "unfused-f32": jax.jit(lambda h, w: dualvp_jax.logprob_entropy(
                jax.lax.dot_general(h[: args.check_rows], w, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32), y[: args.check_rows])),
        }
        for name, fn in fns.items():
            rlp, rent, errs = _errors(fn, h, w, y, gl, ge, args.check_rows)
            lp, ent = fwd[name.split("@")[0]](h, w)
            errs["logprob_abs"] = float(np.abs(np.asarray(lp, np.float64) - rlp).max())
            errs["entropy_abs"] = float(np.abs(np.asarray(ent, np.float64) - rent).max())
            r = rows[name]
            r["time_s"] = min(r["rounds"])
            r["errors"] = errs
            r["vs_unfused_time"] = None
        for name in rows:
            rows[name]["vs_unfused_time"] = rows[name]["time_s"] / rows["unfused"]["time_s"]
            result["rows"].append(rows[name])
            r = rows[name]
            print(f"{dtype:9s} {name:14s} time {r['time_s']:.3f}s ({r['vs_unfused_time']:.2f}x unfused) "
                  f"temp {r['temp_B']:.3f} B  first {r['first_call_s']:.1f}s  errors "
                  + " ".join(f"{k} {v:.2e}" for k, v in r["errors"].items()), flush=True)
    result["uptime_after"] = _uptime()
    print(result["uptime_before"], "|", result["uptime_after"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
