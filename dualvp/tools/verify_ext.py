"""``dualvp verify --op extended``: K targets, a per-row temperature and ``sum p^2``, torch and JAX.

Runs the conformance table of the extended options
(:data:`dualvp.testing.extended.EXT_CASES`: K targets per row, a per-row
temperature tensor, ``with_sum_p2``, alone and together over the base cases
that stress them: masks that drop a target, ignored rows, banned and extreme
logits, 16-bit and float64 inputs) at ``W = --tp`` shards (the cases whose
vocabulary ``W`` divides), each through

* the float64 oracle (:func:`dualvp.testing.extended.oracle_ext`),
* ``dualvp_torch.logprob_entropy(..., multi_target=, with_sum_p2=)`` on ``W``
  gloo ranks (one launch for every case; ``--no-compile``: the eager engine),
* ``dualvp_jax.sharded_logprob_entropy`` on a mesh of ``W`` host devices (one
  child process for every case),

and prints, per case, the worst of log-prob, entropy, the logits gradient and
``sum_p2`` against the oracle (:data:`dualvp.testing.TOLERANCES`; ``sum_p2``
with the entropy's row) and torch against JAX (twice those). Exit status 1
on any FAIL, 2 on bad options.

``--input FILE`` whose ``target`` is ``[..., K]`` or that holds a
``temperature [...]`` per row (:func:`dualvp.tools.verify_input.load_input`) runs
that one problem through the same check instead (``dualvp verify --input``
sends such a file here), with ``with_sum_p2`` on and seeded random upstream
gradients.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile

from typing import Optional

import numpy as np

from dualvp.testing import extended as ext
from dualvp.testing.metrics import max_errors, pair_tolerance, tolerance, within_tolerance

from ._proc import child_env, finish_jax, start_python
from .verify_input import load_input

__all__ = ["run_ext", "cases_for", "input_ext_problem"]

#: ``(field of ExtOutputs, TOLERANCES row)``.
_QUANTITIES = (("logprob", "logprob"), ("entropy", "entropy"), ("grad", "grad"), ("sum_p2", "entropy"))


def cases_for(world: int) -> list:
    """The extended cases that run at ``world`` shards (their vocabulary divisible by it)."""
    return [c for c in ext.EXT_CASES if c.base.vocab % world == 0]


def _torch_rank(rank: int, world: int, problems: list, impl):
    import torch

    from dualvp_torch import logprob_entropy

    dts = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
    group = torch.distributed.group.WORLD if world > 1 else None
    outs = []
    for prob in problems:
        c = prob.case
        z, keep = prob.shard(rank, world)
        cdt = torch.float64 if c.dtype == "float64" else torch.float32
        x = torch.tensor(z, dtype=torch.float64).to(dts[c.dtype]).requires_grad_(True)
        tau = torch.tensor(prob.temperature, dtype=cdt) if c.row_temperature else prob.temperature
        out = logprob_entropy(x, torch.tensor(prob.target), group=group,
                              keep_mask=None if keep is None else torch.tensor(keep), temperature=tau,
                              ignore_index=c.ignore_index, multi_target=c.targets > 0, with_sum_p2=c.sum_p2,
                              impl=impl)
        lp, h = out[0], out[1]
        loss = ((lp * torch.tensor(prob.grad_logprob, dtype=cdt)).sum()
                + (h * torch.tensor(prob.grad_entropy, dtype=cdt)).sum())
        if c.sum_p2:
            loss = loss + (out[2] * torch.tensor(prob.grad_sum_p2, dtype=cdt)).sum()
        loss.backward()
        f = lambda a: a.detach().to(torch.float64).numpy()  # noqa: E731
        outs.append((f(lp), f(h), f(x.grad), f(out[2]) if c.sum_p2 else None))
    return outs


def _run_torch(problems: list, world: int, impl, timeout: float) -> list:
    from dualvp_torch.testing import run_ranks

    parts = run_ranks(_torch_rank, world, problems, impl, timeout=timeout)
    return [ext.ExtOutputs(parts[0][i][0], parts[0][i][1], np.concatenate([p[i][2] for p in parts], -1),
                           parts[0][i][3]) for i in range(len(problems))]


def _jax_one(prob, mesh):
    import jax
    import jax.numpy as jnp

    import dualvp_jax

    c = prob.case
    dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16, "float64": jnp.float64}[c.dtype]
    cdt = jnp.float64 if c.dtype == "float64" else jnp.float32
    z = jnp.asarray(prob.logits if c.dtype == "float64" else prob.logits.astype(np.float32)).astype(dt)
    keep = None if prob.keep_mask is None else jnp.asarray(prob.keep_mask)
    tau = jnp.asarray(prob.temperature, cdt) if c.row_temperature else prob.temperature
    y = jnp.asarray(prob.target)

    def f(z):
        out = dualvp_jax.sharded_logprob_entropy(z, y, mesh, "tp", keep_mask=keep, temperature=tau,
                                                 ignore_index=c.ignore_index, multi_target=c.targets > 0,
                                                 with_sum_p2=c.sum_p2)
        return out if c.sum_p2 else out + (jnp.zeros_like(out[1]),)

    @jax.jit
    def run(z, gl, ge, gs):
        (lp, h, p2), vjp = jax.vjp(f, z)
        (g,) = vjp((gl, ge, gs))
        return lp, h, g, p2

    gs = prob.grad_sum_p2 if c.sum_p2 else np.zeros(prob.grad_entropy.shape)
    with jax.set_mesh(mesh):
        lp, h, g, p2 = run(z, jnp.asarray(prob.grad_logprob, cdt), jnp.asarray(prob.grad_entropy, cdt),
                           jnp.asarray(gs, cdt))
    f64 = lambda a: np.asarray(a.astype(cdt), dtype=np.float64)  # noqa: E731
    return ext.ExtOutputs(f64(lp), f64(h), f64(g), f64(p2) if c.sum_p2 else None)


def _jax_child() -> None:
    # `python -c "from dualvp.tools.verify_ext import _jax_child; _jax_child()" IN OUT WORLD`
    import jax

    src, dst, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(src, "rb") as f:
        problems = pickle.load(f)
    jax.config.update("jax_enable_x64", True)  # float64 cases; the others pass 32/16-bit arrays explicitly
    mesh = jax.make_mesh((world,), ("tp",), devices=jax.devices()[:world])
    outs = [_jax_one(p, mesh) for p in problems]
    with open(dst, "wb") as f:
        pickle.dump(outs, f)


def _start_jax(problems: list, world: int, tmp: str):
    src, dst = os.path.join(tmp, "problems.pkl"), os.path.join(tmp, "jax.pkl")
    with open(src, "wb") as f:
        pickle.dump(problems, f)
    env = child_env(world, {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")})
    code = "from dualvp.tools.verify_ext import _jax_child; _jax_child()"
    return start_python(["-c", code, src, dst, str(world)], env, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE), dst


def _worst(pairs, tol_of) -> tuple:
    """``(max abs, max rel, ok)`` over ``[(x, ref, quantity), ...]``: the worst error, ok if every pair is within."""
    a_max = r_max = 0.0
    ok = True
    for x, ref, quantity in pairs:
        x = np.asarray(x, dtype=np.float64)
        if x.shape != ref.shape:
            return float("inf"), float("inf"), False
        if not within_tolerance(x, ref, tol_of(quantity)):
            ok = False
        a, r = max_errors(x, ref)
        a_max, r_max = max(a_max, a), max(r_max, r)
    return a_max, r_max, ok


def _rows(name: str, x: ext.ExtOutputs, ref: ext.ExtOutputs, tol_of) -> list:
    rows = []
    for field, quantity in _QUANTITIES:
        r = getattr(ref, field)
        if r is None:
            continue
        v = getattr(x, field)
        rows.append((field,) + ((float("inf"), float("inf"), False) if v is None
                                else _worst([(v, r, quantity)], tol_of)))
    return rows


def input_ext_problem(args, d: dict) -> ext.ExtProblem:
    """The extended problem of a user's file (:func:`dualvp.tools.verify_input.load_input` result ``d``).

    Its K targets (or one per row), its per-row temperature (or
    ``--temperature``), its keep mask (or ``--mask`` built on its logits),
    ``with_sum_p2`` on, and seeded random upstream gradients. The
    temperatures are rounded to float32 unless the run is float64 (the
    backends take them in the compute dtype). ``ValueError`` naming what is
    wrong.
    """
    from dualvp.testing import cases

    world = args.tp or 2
    t, v = d["logits"].shape
    if v % world:
        raise ValueError(f"tp: the vocabulary V = {v} of {args.input!r} is not divisible by --tp {world}")
    if d["keep_ids"] is not None:
        raise ValueError("keep_ids: expected a keep_mask (or none) beside K targets per row or a per-row "
                         "temperature (the extended options take the mask form), got keep_ids")
    dtype = args.dtype or d["dtype"]
    if d["keep_mask"] is not None and args.mask != "none":
        raise ValueError(f"mask: {args.input!r} has its own keep_mask; --mask {args.mask} cannot replace it")
    rng = np.random.default_rng(args.seed)
    z = cases.round_to_dtype(d["logits"], dtype)
    y = d["target"]
    keep = d["keep_mask"]
    if keep is None:
        keep = cases.make_mask(rng, args.mask, z, y[:, 0] if y.ndim == 2 else y, -100)
    tau = args.temperature
    if d["temperature"] is not None:
        tau = d["temperature"] if dtype == "float64" else d["temperature"].astype(np.float32).astype(np.float64)
    base = cases.Case(name="verify-input", lead=(t,), vocab=v, worlds=(world,), dtype=dtype,
                      temperature=args.temperature, seed=args.seed)
    case = ext.ExtCase("verify-input", base, targets=y.shape[1] if y.ndim == 2 else 0,
                       row_temperature=d["temperature"] is not None, sum_p2=True)
    return ext.ExtProblem(case, z, y, keep, tau, rng.normal(size=y.shape), rng.normal(size=t), rng.normal(size=t))


def run_ext(args, loaded: Optional[dict] = None) -> int:
    """``dualvp verify --op extended`` (or ``--input`` with K targets or a per-row temperature); the exit status.

    ``loaded``: the ``--input`` file's :func:`dualvp.tools.verify_input.load_input`
    result, when the caller has read it.
    """
    world = args.tp or 2
    if getattr(args, "device", "cpu") != "cpu":
        print("dualvp verify: the extended check runs torch on gloo CPU ranks; --device cuda is not supported "
              "with K targets, a per-row temperature or --op extended", file=sys.stderr)
        return 2
    if world < 1:
        print(f"dualvp verify: --tp must be >= 1, got {world}", file=sys.stderr)
        return 2
    if getattr(args, "input", None):
        try:
            d = load_input(args.input, max_rows=args.tokens) if loaded is None else loaded
            problems = [input_ext_problem(args, d)]
        except ValueError as exc:
            print(f"dualvp verify: {exc}", file=sys.stderr)
            return 2
        c = problems[0].case
        what = (f"input={args.input} W={world} T={problems[0].logits.shape[0]} V={problems[0].logits.shape[1]} "
                f"dtype={c.dtype} targets per row={max(c.targets, 1)} temperature="
                f"{'per row (from file)' if c.row_temperature else args.temperature} "
                f"mask={'from file' if d['keep_mask'] is not None else args.mask} sum_p2")
    else:
        chosen = cases_for(world)
        if not chosen:
            print(f"dualvp verify: no extended case has a vocabulary divisible by --tp {world}", file=sys.stderr)
            return 2
        problems = [ext.make_ext(c) for c in chosen]
        what = (f"W={world}, {len(problems)} cases of dualvp.testing.extended.EXT_CASES "
                "(K targets, per-row temperature, sum_p2)")
    oracles = [ext.oracle_ext(p) for p in problems]
    backends = [b for b in args.backends.split(",") if b]
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="dualvp-verify-ext-") as tmp:
        jax_started = _start_jax(problems, world, tmp) if "jax" in backends else None
        for b in backends:
            try:
                results[b] = _run_torch(problems, world, None if args.compile else "eager", args.timeout) \
                    if b == "torch" else finish_jax(jax_started, args.timeout)
            except Exception as exc:  # report, and fail the run, instead of a traceback
                print(f"dualvp verify: {b} backend failed: {exc}", file=sys.stderr)
                results[b] = None
    print(f"dualvp verify --op extended: {what}")
    head = f"{'case':<22} {'check':<16} {'quantity':<8} {'max abs err':>12} {'max rel err':>12}  result"
    print(head)
    print("-" * len(head))
    bad = [f"{b} did not run" for b, r in results.items() if r is None]
    n_checks = 0
    for i, prob in enumerate(problems):
        dtype = prob.case.dtype
        checks = [(f"{b} vs oracle", r[i], oracles[i], lambda q, d=dtype: tolerance(d, q))
                  for b, r in results.items() if r is not None]
        if results.get("torch") is not None and results.get("jax") is not None:
            checks.append(("torch vs jax", results["torch"][i], results["jax"][i],
                           lambda q, d=dtype: pair_tolerance(d, q)))
        for check, x, ref, tol_of in checks:
            for field, a, rel, ok in _rows(prob.case.name, x, ref, tol_of):
                verdict = "PASS" if ok else "FAIL"
                print(f"{prob.case.name:<22} {check:<16} {field:<8} {a:>12.3e} {rel:>12.3e}  {verdict}")
                n_checks += 1
                bad += [] if ok else [f"{prob.case.name} {check} {field}"]
    if bad:
        print(f"FAIL: {', '.join(bad[:20])}" + (f" (+{len(bad) - 20} more)" if len(bad) > 20 else ""))
        return 1
    print(f"PASS: {n_checks} checks within tolerance ({len(problems)} case(s))")
    return 0
