"""``dualvp verify --op kl``: the KL divergence op, torch and JAX against the float64 oracle and each other.

One random :class:`dualvp.testing.kl.KLProblem` (``T = --tokens`` rows,
``V = --vocab``, ``--dtype``, ``--temperature``, ``--direction``; ref logits =
logits + N(0, 1) noise; about 30 % of the columns banned (``-inf``) in both;
every third row outside ``row_mask``, holding a NaN), then

* the float64 oracle (:mod:`dualvp.kl_reference`) on the full logits,
* :mod:`dualvp.kl_spec` over ``W`` simulated shards in float32 (float64 for float64),
* ``dualvp_torch.kl_divergence`` on ``W`` gloo ranks (its default engine;
  ``--no-compile``: the eager one),
* ``dualvp_jax.sharded_kl_divergence`` on ``W`` host devices (a child process),

and prints the max abs / rel error of the KL and of both gradients (to
``logits`` and ``ref_logits``), PASS/FAIL against
:data:`dualvp.testing.metrics.TOLERANCES` (``"kl"``, ``"grad"``; torch vs JAX:
twice those). Exit status 1 on any FAIL, 2 on bad options.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile

import numpy as np

from dualvp.testing.kl import KLCase, kl_errors, make_kl, run_spec
from dualvp.testing.metrics import max_errors, pair_tolerance, within_tolerance

from ._proc import child_env, finish_jax, start_python

__all__ = ["run_kl"]

_QUANTITIES = (("kl", "kl"), ("d_logits", "grad"), ("d_ref", "grad"))


def _torch_rank(rank: int, world: int, problem, impl=None):
    import torch

    from dualvp_torch import kl_divergence

    dt = getattr(torch, problem.case.dtype)
    v = problem.logits.shape[-1] // world
    z = torch.tensor(problem.logits[..., rank * v:(rank + 1) * v], dtype=dt, requires_grad=True)
    r = torch.tensor(problem.ref_logits[..., rank * v:(rank + 1) * v], dtype=dt, requires_grad=True)
    m = None if problem.row_mask is None else torch.tensor(problem.row_mask)
    kl = kl_divergence(z, r, group=torch.distributed.group.WORLD if world > 1 else None, row_mask=m,
                       temperature=problem.case.temperature, direction=problem.case.direction, impl=impl)
    (kl * torch.tensor(problem.grad, dtype=kl.dtype)).sum().backward()
    return kl.detach().double().numpy(), z.grad.double().numpy(), r.grad.double().numpy()


def _run_torch(problem, world: int, timeout: float, impl=None):
    from dualvp_torch.testing import run_ranks

    parts = run_ranks(_torch_rank, world, problem, impl, timeout=timeout)
    return parts[0][0], np.concatenate([p[1] for p in parts], -1), np.concatenate([p[2] for p in parts], -1)


def _jax_child() -> None:
    # `python -c "from dualvp.tools.verify_kl import _jax_child; _jax_child()" IN OUT WORLD`
    import jax
    import jax.numpy as jnp

    import dualvp_jax

    src, dst, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(src, "rb") as f:
        p = pickle.load(f)
    c = p.case
    if c.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16, "float64": jnp.float64}[c.dtype]
    mesh = jax.make_mesh((world,), ("tp",), devices=jax.devices()[:world])
    cdt = jnp.float64 if c.dtype == "float64" else jnp.float32
    z = jnp.asarray(p.logits.astype(np.float64 if c.dtype == "float64" else np.float32)).astype(dt)
    r = jnp.asarray(p.ref_logits.astype(np.float64 if c.dtype == "float64" else np.float32)).astype(dt)
    m = None if p.row_mask is None else jnp.asarray(p.row_mask)
    g = jnp.asarray(p.grad, cdt)

    def f(z, r):
        kl = dualvp_jax.sharded_kl_divergence(z, r, mesh, "tp", row_mask=m, temperature=c.temperature,
                                              direction=c.direction)
        return jnp.sum(g * kl), kl

    with jax.set_mesh(mesh):
        (_, kl), (dz, dr) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(z, r)
    out = tuple(np.asarray(x.astype(cdt), dtype=np.float64) for x in (kl, dz, dr))
    with open(dst, "wb") as f:
        pickle.dump(out, f)


def _start_jax(problem, world: int, tmp: str):
    src, dst = os.path.join(tmp, "problem.pkl"), os.path.join(tmp, "jax.pkl")
    with open(src, "wb") as f:
        pickle.dump(problem, f)
    env = child_env(world, {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")})
    code = "from dualvp.tools.verify_kl import _jax_child; _jax_child()"
    return start_python(["-c", code, src, dst, str(world)], env, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE), dst


def run_kl(args) -> int:
    """``dualvp verify --op kl``; returns the exit status."""
    world = args.tp or 2
    tokens = args.tokens or 256
    dtype = args.dtype or "float32"
    if getattr(args, "input", None):
        print("dualvp verify: --input holds one logits tensor; --op kl builds its own problem", file=sys.stderr)
        return 2
    if args.vocab % world:
        print(f"dualvp verify: --vocab {args.vocab} is not divisible by --tp {world}", file=sys.stderr)
        return 2
    case = KLCase("verify-kl", rows=(tokens,), vocab=args.vocab, dtype=dtype, temperature=args.temperature,
                  direction=args.direction, scale=3.0, banned="both", masked=True, seed=args.seed)
    problem = make_kl(case)
    backends = [b for b in args.backends.split(",") if b]
    results = {"spec": run_spec(problem, world, np.float64 if dtype == "float64" else np.float32)}
    with tempfile.TemporaryDirectory(prefix="dualvp-verify-kl-") as tmp:
        jax_started = _start_jax(problem, world, tmp) if "jax" in backends else None
        for b in backends:
            try:
                results[b] = _run_torch(problem, world, args.timeout, None if args.compile else "eager") \
                    if b == "torch" else finish_jax(jax_started, args.timeout)
            except Exception as exc:  # report, and fail the run, instead of a traceback
                print(f"dualvp verify: {b} backend failed: {exc}", file=sys.stderr)
                results[b] = None
    print(f"dualvp verify --op kl: W={world} T={tokens} V={args.vocab} dtype={dtype} temperature={args.temperature} "
          f"direction={args.direction} seed={args.seed} (banned columns, masked rows)")
    head = f"{'check':<18} {'quantity':<9} {'max abs err':>12} {'max rel err':>12}  result"
    print(head)
    print("-" * len(head))
    bad = [b for b, r in results.items() if r is None]
    for b, r in results.items():
        if r is None:
            continue
        for q, (a, rel, ok) in kl_errors(problem, r).items():
            print(f"{b + ' vs oracle':<18} {q:<9} {a:>12.3e} {rel:>12.3e}  {'PASS' if ok else 'FAIL'}")
            bad += [] if ok else [f"{b} {q}"]
    if results.get("torch") is not None and results.get("jax") is not None:
        for i, (q, kind) in enumerate(_QUANTITIES):
            x, ref = results["torch"][i], results["jax"][i]
            a, rel = max_errors(x, ref)
            ok = within_tolerance(x, ref, pair_tolerance(dtype, kind))
            print(f"{'torch vs jax':<18} {q:<9} {a:>12.3e} {rel:>12.3e}  {'PASS' if ok else 'FAIL'}")
            bad += [] if ok else [f"torch vs jax {q}"]
    if bad:
        print(f"FAIL: {', '.join(bad)}")
        return 1
    print("PASS")
    return 0
