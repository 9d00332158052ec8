"""``dualvp verify``: torch and JAX on the same problem, against the oracle and each other.

Builds one random problem (confident-LM logits, upstream gradients for
log-prob and entropy, an optional keep mask), computes

* the float64 oracle (:mod:`dualvp.reference`) on the full logits,
* the specification run over ``W`` simulated shards (:mod:`dualvp.simulate`),
* ``dualvp_torch`` on ``W`` real gloo ranks (one process each),
* ``dualvp_jax`` on a mesh of ``W`` host devices,

and prints the max abs / rel error of log-prob, entropy and the logits
gradient for each backend against the oracle and for torch against JAX, with
PASS/FAIL against :data:`dualvp.cases.TOLERANCES`. Exit status 1 on any FAIL.

The backends run in child processes, at the same time: the gloo ranks, and one
JAX process whose ``XLA_FLAGS`` asks for ``W`` host devices before JAX is
imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple, Optional

import numpy as np

from dualvp import cases, reference, simulate

from ._proc import child_env, start_python

__all__ = ["run", "compare", "Row", "problem_for", "torch_outputs", "merge_ranks", "jax_outputs"]


class Row(NamedTuple):
    """One line of the report."""

    check: str
    quantity: str
    abs_err: float
    rel_err: float
    ok: bool


def problem_for(args) -> cases.Problem:
    """The verify problem: a :class:`dualvp.cases.Case` built from the options."""
    c = cases.Case(
        name="verify",
        lead=(args.tokens,),
        vocab=args.vocab,
        worlds=(args.tp,),
        dtype=args.dtype,
        temperature=args.temperature,
        mask=args.mask,
        logits="confident_lm",
        seed=args.seed,
        ignore_frac=0.05,
    )
    return cases.make(c)


def _tol_pair(dtype: str, quantity: str) -> cases.Tolerance:
    # Each backend is within `tol` of the oracle, so the two differ by at most 2 * tol.
    t = cases.tolerance(dtype, quantity)
    return cases.Tolerance(2 * t.atol, 2 * t.rtol)


def compare(results: dict, oracle: dict, dtype: str) -> list:
    """Rows for every backend vs the oracle and for each pair of backends.

    Args:
      results: backend name -> ``{"logprob", "entropy", "grad"}`` NumPy arrays.
      oracle: the same keys, float64.
    """
    rows = []
    quantities = ("logprob", "entropy", "grad")
    for name, res in results.items():
        for q in quantities:
            a, r = cases.max_errors(res[q], oracle[q])
            ok = cases.within_tolerance(res[q], oracle[q], cases.tolerance(dtype, q))
            rows.append(Row(f"{name} vs oracle", q, a, r, ok))
    if "torch" in results and "jax" in results:
        for q in quantities:
            x, y = results["torch"][q], results["jax"][q]
            a, r = cases.max_errors(x, y)
            ok = cases.within_tolerance(x, y, _tol_pair(dtype, q))
            rows.append(Row("torch vs jax", q, a, r, ok))
    return rows


def _progress(step: int, total: int, text: str, t0: Optional[float] = None) -> float:
    now = time.perf_counter()
    if t0 is None:
        print(f"[{step}/{total}] {text} ...", file=sys.stderr, flush=True)
    else:
        print(f"[{step}/{total}] {text} done in {now - t0:.1f} s", file=sys.stderr, flush=True)
    return now


def _item(prob: cases.Problem) -> dict:
    """A picklable description of one problem for a backend run."""
    c = prob.case
    return dict(name=c.name, logits=prob.logits, target=prob.target, keep=prob.keep_mask, dtype=c.dtype,
                temperature=c.temperature, ignore_index=c.ignore_index,
                grad_logprob=prob.grad_logprob, grad_entropy=prob.grad_entropy)


def torch_outputs(rank: int, world: int, items: list) -> list:
    """On one gloo rank: forward + backward of every item on this rank's shard.

    Returns, per item, ``{"logprob", "entropy", "grad"}`` as float64 NumPy
    arrays (``grad`` is this rank's ``[..., V/W]`` columns).
    """
    import torch

    from dualvp_torch import logprob_entropy

    group = torch.distributed.group.WORLD if world > 1 else None
    outs = []
    for it in items:
        v = it["logits"].shape[-1] // world
        sl = slice(rank * v, (rank + 1) * v)
        z = torch.from_numpy(np.ascontiguousarray(it["logits"][..., sl])).to(getattr(torch, it["dtype"]))
        z.requires_grad_(True)
        keep = None if it["keep"] is None else torch.from_numpy(np.ascontiguousarray(it["keep"][..., sl]))
        lp, h = logprob_entropy(z, torch.from_numpy(it["target"]), group=group, keep_mask=keep,
                                temperature=it["temperature"], ignore_index=it["ignore_index"])
        gl = torch.from_numpy(it["grad_logprob"]).to(lp.dtype)
        ge = torch.from_numpy(it["grad_entropy"]).to(h.dtype)
        torch.autograd.backward([lp, h], [gl, ge])
        outs.append(dict(logprob=lp.detach().double().numpy(), entropy=h.detach().double().numpy(),
                         grad=z.grad.double().numpy()))
    return outs


def merge_ranks(per_rank: list) -> list:
    """Join per-rank :func:`torch_outputs` into full-vocabulary results.

    Every rank holds the same combined statistics, so log-prob and entropy
    must agree bitwise across ranks; a difference raises.
    """
    merged = []
    for i, first in enumerate(per_rank[0]):
        for r, outs in enumerate(per_rank[1:], start=1):
            for q in ("logprob", "entropy"):
                if not np.array_equal(outs[i][q], first[q], equal_nan=True):
                    raise RuntimeError(f"torch rank {r} {q} differs from rank 0")
        merged.append(dict(logprob=first["logprob"], entropy=first["entropy"],
                           grad=np.concatenate([outs[i]["grad"] for outs in per_rank], axis=-1)))
    return merged


def jax_outputs(item: dict, world: int) -> dict:
    """``dualvp_jax`` on a mesh of the first ``world`` devices (in this process).

    Float64 items need ``jax_enable_x64``; they run under ``jax.enable_x64``.
    """
    import contextlib

    import jax
    import jax.numpy as jnp

    import dualvp_jax

    x64 = jax.enable_x64(True) if item["dtype"] == "float64" else contextlib.nullcontext()
    with x64:
        mesh = jax.make_mesh((world,), ("tp",), devices=jax.devices()[:world])
        z = jnp.asarray(item["logits"]).astype(getattr(jnp, item["dtype"]))
        y = jnp.asarray(item["target"])
        keep = None if item["keep"] is None else jnp.asarray(item["keep"])

        def f(z):
            return dualvp_jax.sharded_logprob_entropy(z, y, mesh, "tp", keep_mask=keep,
                                                      temperature=item["temperature"],
                                                      ignore_index=item["ignore_index"])

        (lp, h), vjp = jax.vjp(f, z)
        (g,) = vjp((jnp.asarray(item["grad_logprob"]).astype(lp.dtype),
                    jnp.asarray(item["grad_entropy"]).astype(h.dtype)))
        return dict(logprob=np.asarray(lp, np.float64), entropy=np.asarray(h, np.float64),
                    grad=np.asarray(g.astype(jnp.float64 if item["dtype"] == "float64" else jnp.float32),
                                    np.float64))


def _jax_child() -> None:
    # `python -c "from dualvp.tools.verify import _jax_child; _jax_child()" IN OUT WORLD`
    import pickle

    src, dst, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(src, "rb") as f:
        item = pickle.load(f)
    with open(dst, "wb") as f:
        pickle.dump(jax_outputs(item, world), f)


def _run_torch(item: dict, args) -> dict:
    from dualvp_torch.testing import run_ranks

    env = {} if args.compile else {"DUALVP_COMPILE": "0"}
    per_rank = run_ranks(torch_outputs, args.tp, [item], timeout=args.timeout, env=env)
    return merge_ranks(per_rank)[0]


def _start_jax(item: dict, args, tmp: str) -> tuple:
    """Start the JAX child process; :func:`_finish_jax` collects its result."""
    import pickle

    src, dst = os.path.join(tmp, "item.pkl"), os.path.join(tmp, "jax.pkl")
    with open(src, "wb") as f:
        pickle.dump(item, f)
    # JAX reads XLA_FLAGS once, at import: the child asks for W host devices.
    env = child_env(args.tp, {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")})
    code = "from dualvp.tools.verify import _jax_child; _jax_child()"
    proc = start_python(["-c", code, src, dst, str(args.tp)], env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return proc, dst


def _finish_jax(started: tuple, timeout: float) -> dict:
    import pickle

    proc, dst = started
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise RuntimeError(f"JAX backend did not finish within {timeout:.0f} s") from None
    if proc.returncode:
        raise RuntimeError(f"JAX backend failed:\n{err[-4000:]}")
    with open(dst, "rb") as f:
        return pickle.load(f)


def _print_table(rows: list, args) -> None:
    print(f"dualvp verify: W={args.tp} T={args.tokens} V={args.vocab} dtype={args.dtype} "
          f"temperature={args.temperature} mask={args.mask} seed={args.seed}")
    head = f"{'check':<18} {'quantity':<9} {'max abs err':>12} {'max rel err':>12}  {'tolerance (abs + rel*|ref|)':<28} result"
    print(head)
    print("-" * len(head))
    for r in rows:
        t = (_tol_pair(args.dtype, r.quantity) if r.check == "torch vs jax"
             else cases.tolerance(args.dtype, r.quantity))
        print(f"{r.check:<18} {r.quantity:<9} {r.abs_err:>12.3e} {r.rel_err:>12.3e}  "
              f"{f'{t.atol:.0e} + {t.rtol:.0e}':<28} {'PASS' if r.ok else 'FAIL'}")


def run(args) -> int:
    """Entry point of ``dualvp verify``; returns the exit status."""
    if args.vocab % args.tp:
        print(f"dualvp verify: --vocab {args.vocab} is not divisible by --tp {args.tp}", file=sys.stderr)
        return 2
    backends = [b for b in args.backends.split(",") if b]
    total = 3 + len(backends)
    t = _progress(1, total, f"building the problem (T={args.tokens}, V={args.vocab})")
    prob = problem_for(args)
    _progress(1, total, "problem", t)

    t = _progress(2, total, "float64 oracle and the spec over simulated shards")
    kw = dict(keep_mask=prob.keep_mask, temperature=args.temperature, ignore_index=-100)
    lp, h = reference.logprob_entropy(prob.logits, prob.target, **kw)
    g = reference.logprob_entropy_grad(prob.logits, prob.target, prob.grad_logprob, prob.grad_entropy, **kw)
    oracle = dict(logprob=lp, entropy=h, grad=g)
    sdt = np.float64 if args.dtype == "float64" else np.float32
    s_lp, s_h, s_g = simulate.logprob_entropy_sharded(
        prob.logits, prob.target, args.tp, grad_logprob=prob.grad_logprob, grad_entropy=prob.grad_entropy,
        dtype=sdt, **kw)
    results = {"spec": dict(logprob=s_lp, entropy=s_h, grad=s_g)}
    _progress(2, total, "oracle", t)

    item = _item(prob)
    with tempfile.TemporaryDirectory(prefix="dualvp-verify-") as tmp:
        # JAX runs in its own process while the torch ranks run: the two
        # start-ups (imports, compilation) overlap.
        jax_started = None
        if "jax" in backends:
            jax_started = _start_jax(item, args, tmp)
        step = 3
        for b in backends:
            where = f"{args.tp} gloo rank(s)" if b == "torch" else f"{args.tp} host device(s)"
            t = _progress(step, total, f"{b} on {where}")
            try:
                if b == "torch":
                    results[b] = _run_torch(item, args)
                else:
                    results[b] = _finish_jax(jax_started, args.timeout)
            except Exception as exc:  # report, and fail the run, instead of a traceback
                print(f"dualvp verify: {b} backend failed: {exc}", file=sys.stderr)
                results[b] = None
            _progress(step, total, b, t)
            step += 1

    t = _progress(total, total, "comparing")
    failed_backends = [b for b, r in results.items() if r is None]
    rows = compare({b: r for b, r in results.items() if r is not None}, oracle, args.dtype)
    _print_table(rows, args)
    bad = [r for r in rows if not r.ok]
    if failed_backends or bad:
        what = ", ".join([f"{b} did not run" for b in failed_backends] + [f"{r.check} {r.quantity}" for r in bad])
        print(f"FAIL: {what}")
        return 1
    print(f"PASS: {len(rows)} checks within tolerance")
    return 0
