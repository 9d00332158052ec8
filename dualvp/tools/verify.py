"""``dualvp verify``: torch and JAX on the same problem, against the oracle and each other.

Builds one random problem (confident-LM logits, upstream gradients for
log-prob and entropy, an optional keep mask), or, with ``--input FILE``, takes
the logits, targets and keep mask a user saved from their own run (see
:func:`load_input`) with seeded random upstream gradients; then computes

* the float64 oracle (:mod:`dualvp.reference`) on the full logits,
* the specification run over ``W`` simulated shards (:mod:`dualvp.simulate`),
* ``dualvp_torch`` on ``W`` real gloo ranks (one process each),
* ``dualvp_jax`` on a mesh of ``W`` host devices,

and prints the max abs / rel error of log-prob, entropy and the logits
gradient for each backend against the oracle and for torch against JAX, with
PASS/FAIL against :data:`dualvp.testing.metrics.TOLERANCES`. Exit status 1 on any FAIL.

``--op linear`` checks the fused LM head instead: a random
:class:`dualvp.testing.cases.LinearProblem` (hidden ``[T, H]`` with ``H =
--hidden``, weight ``[V, H]``, both rounded to the dtype), the float64 oracle
of ``hidden @ weight^T``, ``dualvp_torch.linear_logprob_entropy`` on ``W``
gloo ranks (each its weight rows, the same hidden, ``reduce_hidden_grad=True``)
and ``dualvp_jax.sharded_linear_logprob_entropy`` on ``W`` host devices; the
rows are log-prob, entropy, ``dh`` and ``dW``, the gradients judged with
:func:`dualvp.testing.metrics.tolerance` (the logits gradient's tolerance, its
absolute part scaled by the oracle's largest entry); 16-bit ``dh`` / ``dW`` by
issue 45's rule instead (:func:`dualvp.testing.metrics.within_rounding`: max
|error| <= 2x that of the float64 result rounded once), which the op's
default ``gradient_rounding="fixed"`` meets on CUDA. There is no ``spec`` row
(the specification has no fused form) and no ``--input``.

``--op extended`` runs the conformance table of K targets per row, a
per-row temperature tensor and ``sum_p2``
(:data:`dualvp.testing.extended.EXT_CASES`) on torch and JAX against the
oracle and each other (:mod:`dualvp.tools.verify_ext`); ``--op kl`` the KL
divergence op (:mod:`dualvp.tools.verify_kl`).

Started by a launcher (``torchrun ... -m dualvp verify``: ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set), it checks that job
instead: every worker joins the launcher's group, computes its shard of the
problem over its tensor-parallel group (``--tp`` consecutive ranks, default
all), compares it with the float64 oracle, and every rank prints the same
verdict (:func:`run_launched`; torch only).

``--device cuda`` runs the torch backend on the GPU: in this process for
``W = 1``, else on ``W`` NCCL ranks, one GPU each (``dualvp.testing.run``
with ``device="cuda"``); the spec and JAX stay on the host (JAX on its CPU
host devices). Without CUDA, or with fewer than ``W`` GPUs, it exits 2
before anything starts (:func:`dualvp.tools._proc.cuda_problem`).

Every backend runs through the shared adapters :func:`dualvp.testing.run`, and
the oracle and the comparison are :func:`dualvp.testing.oracle` and
:func:`dualvp.testing.compare`, as in the tests. The torch and JAX backends run
in child processes, at the same time: the gloo ranks, and one JAX process
(:func:`start_jax`) whose ``XLA_FLAGS`` asks for ``W`` host devices before JAX
is imported.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time
from typing import Mapping, Optional, Union

import numpy as np

from dualvp import testing
from dualvp.testing import cases
from dualvp.testing.metrics import (ROUNDING_FACTOR, Row, compare, max_errors, pair_tolerance, rounding_unit, tolerance,
                                    within_tolerance)

from ._proc import child_env, cuda_problem, finish_jax, start_python
from .verify_input import load_input

__all__ = ["run", "compare", "Row", "problem_for", "load_input", "uses_extended", "input_problem", "start_jax",
           "finish_jax"]


def problem_for(args) -> Union[cases.Problem, cases.LinearProblem]:
    """The verify problem: a :class:`dualvp.testing.cases.Case` built from the options.

    ``args.op == "linear"``: a :class:`~dualvp.testing.cases.LinearProblem`
    with ``args.hidden`` columns of hidden state; otherwise a logits
    :class:`~dualvp.testing.cases.Problem`.
    """
    linear = getattr(args, "op", "logits") == "linear"
    c = cases.Case(
        name="verify-linear" if linear else "verify",
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
    return cases.make_linear(c, args.hidden) if linear else cases.make(c)


def uses_extended(d: dict) -> bool:
    """Whether a :func:`load_input` result holds K targets per row or a temperature per row."""
    return d["target"].ndim == 2 or d["temperature"] is not None


def input_problem(args, loaded: Optional[dict] = None) -> cases.Problem:
    """The verify problem from ``args.input``: the user's arrays plus seeded random upstream gradients.

    ``args.dtype`` (if set) rounds the logits to that dtype; otherwise the
    file's dtype is used. ``args.mask`` other than ``none`` builds a keep mask
    on the user's logits when the file has none. ``loaded``: the file's
    :func:`load_input` result, when already read.
    """
    d = load_input(args.input, max_rows=args.tokens) if loaded is None else loaded
    t, v = d["logits"].shape
    if v % args.tp:
        raise ValueError(f"tp: the vocabulary V = {v} of {args.input!r} is not divisible by --tp {args.tp}")
    dtype = args.dtype or d["dtype"]
    own = "keep_mask" if d["keep_mask"] is not None else ("keep_ids" if d["keep_ids"] is not None else None)
    if own is not None and args.mask != "none":
        raise ValueError(f"mask: {args.input!r} has its own {own}; --mask {args.mask} cannot replace it")
    rng = np.random.default_rng(args.seed)
    z = cases.round_to_dtype(d["logits"], dtype)
    keep = d["keep_mask"]
    if keep is None and d["keep_ids"] is None:
        keep = cases.make_mask(rng, args.mask, z, d["target"], -100)
    case = cases.Case(name="verify-input", lead=(t,), vocab=v, worlds=(args.tp,), dtype=dtype,
                      temperature=args.temperature, seed=args.seed)
    gl, ge = rng.normal(size=t), rng.normal(size=t)
    return cases.Problem(case, z, d["target"], keep, gl, ge, extra={"keep_mask_from_file": own},
                         keep_ids=d["keep_ids"])


def _progress(step: int, total: int, text: str, t0: Optional[float] = None) -> float:
    now = time.perf_counter()
    if t0 is None:
        print(f"[{step}/{total}] {text} ...", file=sys.stderr, flush=True)
    else:
        print(f"[{step}/{total}] {text} done in {now - t0:.1f} s", file=sys.stderr, flush=True)
    return now


def _jax_child() -> None:
    # `python -c "from dualvp.tools.verify import _jax_child; _jax_child()" IN OUT WORLD`
    src, dst, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(src, "rb") as f:
        prob = pickle.load(f)
    with open(dst, "wb") as f:
        pickle.dump(testing.run("jax", prob, world), f)


def start_jax(prob: Union[cases.Problem, cases.LinearProblem], world: int, tmp: str,
              set_vars: Optional[Mapping[str, Optional[str]]] = None):
    """Start a child process that runs ``prob`` on the JAX backend with ``world`` host devices.

    JAX reads ``XLA_FLAGS`` once, at import: hence a fresh process. ``tmp``: a
    directory for the problem and the result files; ``set_vars``: environment
    changes of the child (``None`` removes a variable). :func:`finish_jax`
    collects the :class:`dualvp.testing.Outputs`.
    """
    src, dst = os.path.join(tmp, "problem.pkl"), os.path.join(tmp, "jax.pkl")
    with open(src, "wb") as f:
        pickle.dump(prob, f)
    env = child_env(world, {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), **(set_vars or {})})
    code = "from dualvp.tools.verify import _jax_child; _jax_child()"
    proc = start_python(["-c", code, src, dst, str(world)], env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return proc, dst


def _print_table(rows: list, args, prob: Union[cases.Problem, cases.LinearProblem]) -> None:
    c = prob.case
    if isinstance(prob, cases.LinearProblem):
        print(f"dualvp verify --op linear: W={args.tp} T={c.lead[0]} H={prob.hidden.shape[-1]} V={c.vocab} "
              f"dtype={c.dtype} temperature={args.temperature} mask={args.mask} seed={args.seed}")
    elif getattr(args, "input", None):
        own = prob.extra.get("keep_mask_from_file")
        mask = {"keep_mask": "from file", "keep_ids": "keep_ids from file"}.get(own, args.mask)
        print(f"dualvp verify: input={args.input} W={args.tp} T={c.lead[0]} V={c.vocab} dtype={c.dtype} "
              f"temperature={args.temperature} mask={mask} seed={args.seed}")
    else:
        print(f"dualvp verify: W={args.tp} T={c.lead[0]} V={c.vocab} dtype={c.dtype} "
              f"temperature={args.temperature} mask={args.mask} seed={args.seed}")
    if getattr(args, "device", "cpu") == "cuda":
        print(f"device: torch on CUDA ({'1 GPU, in this process' if args.tp == 1 else f'{args.tp} NCCL ranks'}); "
              "everything else on the CPU (JAX on host devices)")
    head = (f"{'check':<18} {'quantity':<9} {'max abs err':>12} {'max rel err':>12}  "
            f"{'tolerance (abs + rel*|ref|)':<28} result")
    print(head)
    print("-" * len(head))
    for r in rows:
        t = r.tol
        if t is None:
            t = pair_tolerance(c.dtype, r.quantity) if r.check == "torch vs jax" else tolerance(c.dtype, r.quantity)
        print(f"{r.check:<18} {r.quantity:<9} {r.abs_err:>12.3e} {r.rel_err:>12.3e}  "
              f"{f'{t.atol:.0e} + {t.rtol:.0e}':<28} {'PASS' if r.ok else 'FAIL'}")


def run(args) -> int:
    """Entry point of ``dualvp verify``; returns the exit status.

    Started by a launcher (:func:`launched`: ``torchrun`` sets ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), it checks that job's
    ranks instead (:func:`run_launched`: torch only).
    """
    if getattr(args, "op", "logits") == "kl" and not launched():
        from .verify_kl import run_kl

        return run_kl(args)
    if getattr(args, "op", "logits") == "extended" and not launched():
        from .verify_ext import run_ext

        return run_ext(args)
    if launched():
        return run_launched(args)
    if args.tp is None:
        args.tp = 2
    backends = [b for b in args.backends.split(",") if b]
    linear = getattr(args, "op", "logits") == "linear"
    total = 3 + len(backends)
    if linear and getattr(args, "input", None):
        print("dualvp verify: --input holds logits; it cannot be used with --op linear", file=sys.stderr)
        return 2
    if linear and args.hidden < 1:
        print(f"dualvp verify: --hidden must be a positive size, got {args.hidden}", file=sys.stderr)
        return 2
    device = getattr(args, "device", "cpu")
    if device == "cuda":
        # before reading, building or starting anything: a missing GPU is the first thing to know
        why = cuda_problem(args.tp) if "torch" in backends else \
            f"--device cuda runs the torch backend on the GPU; --backends {args.backends} has no torch"
        if why:
            print(f"dualvp verify: {why}", file=sys.stderr)
            return 2
    if getattr(args, "input", None):
        t = _progress(1, total, f"reading {args.input}")
        try:
            loaded = load_input(args.input, max_rows=args.tokens)
            if uses_extended(loaded):
                # K targets per row or a temperature per row: the extended op's check (verify_ext)
                from .verify_ext import run_ext

                return run_ext(args, loaded)
            prob = input_problem(args, loaded)
        except ValueError as exc:
            print(f"dualvp verify: {exc}", file=sys.stderr)
            return 2
    else:
        if args.tokens is None:
            args.tokens = 256
        args.dtype = args.dtype or "float32"
        if args.vocab % args.tp:
            print(f"dualvp verify: --vocab {args.vocab} is not divisible by --tp {args.tp}", file=sys.stderr)
            return 2
        size = f"T={args.tokens}, H={args.hidden}, V={args.vocab}" if linear else f"T={args.tokens}, V={args.vocab}"
        t = _progress(1, total, f"building the {'fused LM-head ' if linear else ''}problem ({size})")
        prob = problem_for(args)
    _progress(1, total, "problem", t)
    dtype = prob.case.dtype

    t = _progress(2, total, "float64 oracle" + ("" if linear else " and the spec over simulated shards"))
    oracle = testing.oracle(prob)
    # the spec has no fused form: the linear op is judged by the oracle and torch vs JAX
    results = {} if linear else {"spec": testing.run("spec", prob, args.tp)}
    _progress(2, total, "oracle", t)

    with tempfile.TemporaryDirectory(prefix="dualvp-verify-") as tmp:
        # JAX runs in its own process while the torch ranks run: the two
        # start-ups (imports, compilation) overlap.
        jax_started = start_jax(prob, args.tp, tmp) if "jax" in backends else None
        step = 3
        for b in backends:
            if b != "torch":
                where = f"{args.tp} host device(s)" + (" (CPU)" if device == "cuda" else "")
            elif device == "cuda":
                where = "1 GPU (in this process)" if args.tp == 1 else f"{args.tp} NCCL rank(s), one GPU each"
            else:
                where = f"{args.tp} gloo rank(s)"
            t = _progress(step, total, f"{b} on {where}")
            try:
                if b == "torch":
                    results[b] = testing.run("torch", prob, args.tp, impl=None if args.compile else "eager",
                                             timeout=args.timeout, device=device)
                else:
                    results[b] = finish_jax(jax_started, args.timeout)
            except Exception as exc:  # report, and fail the run, instead of a traceback
                print(f"dualvp verify: {b} backend failed: {exc}", file=sys.stderr)
                results[b] = None
            _progress(step, total, b, t)
            step += 1

    t = _progress(total, total, "comparing")
    failed_backends = [b for b, r in results.items() if r is None]
    # the fused op's 16-bit dh / dW by issue 45's rule, as its default G rounding ("fixed") meets them
    rows = compare({b: r for b, r in results.items() if r is not None}, oracle, dtype, rounding_rule=linear)
    _print_table(rows, args, prob)
    bad = [r for r in rows if not r.ok]
    if failed_backends or bad:
        what = ", ".join([f"{b} did not run" for b in failed_backends] + [f"{r.check} {r.quantity}" for r in bad])
        print(f"FAIL: {what}")
        return 1
    print(f"PASS: {len(rows)} checks within tolerance")
    return 0


# --- under a launcher (torchrun, SLURM + env://) ------------------------------------------------

#: The environment a launcher sets for every worker (torchrun, or SLURM scripts that export them):
#: with all four present, ``dualvp verify`` joins that job instead of starting its own ranks.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

__all__ += ["LAUNCHER_VARS", "launched", "run_launched"]


def launched(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process is a worker of a launcher (every name of :data:`LAUNCHER_VARS` is set)."""
    env = os.environ if environ is None else environ
    return all(env.get(k) for k in LAUNCHER_VARS)


def _launched_outputs(prob, group, shard: int, width: int, impl, dev):
    """This rank's outputs of ``prob`` over ``group`` (its shard ``shard`` of ``width``), float64 NumPy."""
    import torch

    from dualvp.testing import backends
    from dualvp.testing.oracle import Outputs

    def put(a, dtype=None):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=dev, dtype=dtype)

    if isinstance(prob, cases.LinearProblem):
        return backends._torch_linear(prob, shard, width, group, impl, put)
    from dualvp_torch import logprob_entropy

    c = prob.case
    zs, ks = prob.shard(shard, width)
    z = put(zs, getattr(torch, c.dtype)).requires_grad_(True)
    lp, h = logprob_entropy(z, put(prob.target), group=group, keep_mask=None if ks is None else put(ks),
                            keep_ids=None if prob.keep_ids is None else put(prob.keep_ids),
                            temperature=c.temperature, ignore_index=c.ignore_index, impl=impl)
    torch.autograd.backward([lp, h], [put(prob.grad_logprob, lp.dtype), put(prob.grad_entropy, h.dtype)])
    return Outputs(*(x.detach().double().cpu().numpy() for x in (lp, h, z.grad)))


def _shard_rows(prob, oracle, outs, shard: int, width: int) -> list:
    """``(quantity, abs err, rel err, ok)`` of this rank's outputs against its part of the oracle.

    The sharded quantities (``grad`` columns, ``dW`` rows) are compared on
    this rank's part; tolerances scale with the whole oracle (as in
    :func:`dualvp.testing.metrics.compare`), so every rank judges alike;
    16-bit ``dh`` / ``dW`` by issue 45's rule (2x the rounding unit of the
    whole oracle's result).
    """
    rows = []
    for q in oracle._fields:
        ref_full = getattr(oracle, q)
        ref = ref_full
        if q == "grad":
            v = ref_full.shape[-1] // width
            ref = ref_full[..., shard * v:(shard + 1) * v]
        elif q == "dW":
            v = ref_full.shape[0] // width
            ref = ref_full[shard * v:(shard + 1) * v]
        x = getattr(outs, q)
        a, e = max_errors(x, ref)
        if q in ("dh", "dW") and prob.case.dtype in ("bfloat16", "float16"):  # issue 45's rule, the whole unit
            ok = a <= ROUNDING_FACTOR * rounding_unit(ref_full, prob.case.dtype)
        else:
            ok = within_tolerance(x, ref, tolerance(prob.case.dtype, q, ref_full))
        rows.append((q, a, e, ok))
    return rows


def run_launched(args) -> int:
    """``dualvp verify`` as one worker of a launcher's job (see :func:`launched`); the exit status.

    Joins the launcher's group (env://; NCCL with ``--device cuda``, one GPU
    per worker at ``LOCAL_RANK``, else gloo), with ``--timeout`` as the
    process-group timeout. ``--tp`` (default: the whole job) ranks of
    consecutive global rank form a tensor-parallel group, and the job is
    ``WORLD_SIZE / tp`` data-parallel replicas; replica ``d`` checks the
    problem of seed ``--seed + d``. Every rank builds its replica's problem
    and float64 oracle, computes its shard over its group and compares it
    with the oracle; then one ``all_gather_object`` of every rank's errors
    (and a digest of the log-prob, entropy and ``dh``, which every rank of a
    group must hold bit for bit) gives every rank the same table and verdict (printed by each, ``[rank
    r/W]``; the table by rank 0). A rank whose setup fails (bad ``--input``
    on one node) reports it in a first ``all_gather_object``, so that no rank
    enters the op while another cannot.
    """
    import datetime

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = getattr(args, "device", "cpu")
    tp = world if args.tp is None else args.tp
    linear = getattr(args, "op", "logits") == "linear"
    # every rank sees the same arguments and WORLD_SIZE: these checks agree without a collective
    why = None
    if tp < 1 or world % tp:
        why = f"--tp {tp} must divide the launcher's WORLD_SIZE {world}"
    elif linear and getattr(args, "input", None):
        why = "--input holds logits; it cannot be used with --op linear"
    elif getattr(args, "input", None) is None and args.vocab % tp:
        why = f"--vocab {args.vocab} is not divisible by --tp {tp}"
    elif device == "cuda" and (not torch.cuda.is_available() or local_rank >= torch.cuda.device_count()):
        why = f"--device cuda: LOCAL_RANK {local_rank} has no GPU (torch sees {torch.cuda.device_count()})"
    if why:
        print(f"dualvp verify [rank {rank}/{world}]: {why}", file=sys.stderr)
        return 2
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    dist.init_process_group("nccl" if device == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        dp = world // tp
        groups = [dist.new_group(list(range(d * tp, (d + 1) * tp))) for d in range(dp)] if dp > 1 else None
        replica, shard = rank // tp, rank % tp
        group = dist.group.WORLD if groups is None else groups[replica]
        args.tp = tp
        setup_error = None
        try:
            if getattr(args, "input", None):
                prob = input_problem(args)
            else:
                args.tokens = 256 if args.tokens is None else args.tokens
                args.dtype = args.dtype or "float32"
                prob = problem_for(_with_seed(args, args.seed + replica))
            oracle = testing.oracle(prob)
        except Exception as exc:  # noqa: BLE001 - reported by every rank below
            setup_error = f"{type(exc).__name__}: {exc}"
        setups = [None] * world
        dist.all_gather_object(setups, setup_error)
        failed = [(r, e) for r, e in enumerate(setups) if e]
        if failed:
            rows, run_error, digest = None, "setup failed on " + "; ".join(f"rank {r}: {e}" for r, e in failed), ""
        else:
            try:
                impl = None if args.compile else "eager"
                outs = _launched_outputs(prob, group, shard, tp, impl, dev)
                rows, run_error, digest = _shard_rows(prob, oracle, outs, shard, tp), None, _replicated_digest(outs)
            except Exception as exc:  # noqa: BLE001 - every rank gathers every rank's outcome
                rows, run_error, digest = None, f"{type(exc).__name__}: {exc}", ""
        table = [None] * world
        dist.all_gather_object(table, (rows, run_error, digest))
        # No rank tears its group down while a peer may still be inside the gather: gloo's worker
        # threads of a torn-down pair can abort the process at exit (CI saw one SIGABRT, "terminate
        # called without an active exception", after every rank had printed PASS).
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return _launched_verdict(table, rank, world, tp, args, prob if not failed else None)


def _with_seed(args, seed: int):
    import copy

    a = copy.copy(args)
    a.seed = seed
    return a


def _replicated_digest(outs) -> str:
    """A digest of what every rank of a tensor-parallel group must hold bit for bit: log-prob, entropy (, dh)."""
    import hashlib

    parts = [outs.logprob, outs.entropy] + ([outs.dh] if hasattr(outs, "dh") else [])
    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in parts)).hexdigest()


def _launched_verdict(table: list, rank: int, world: int, tp: int, args, prob) -> int:
    """Print the verdict (the same on every rank: it is computed from the gathered ``table``).

    ``table``: per rank ``(rows of _shard_rows or None, error or None, digest
    of _replicated_digest)``.
    """
    tag = f"dualvp verify [rank {rank}/{world}]"
    errors = [(r, e) for r, (rows, e, _) in enumerate(table) if e]
    if errors:
        shown = errors[0][1] if errors[0][1].startswith("setup failed") else \
            "; ".join(f"rank {r}: {e}" for r, e in errors)
        print(f"{tag}: FAIL: {shown}"[:4000], flush=True)
        return 1
    split = [d for d in range(world // tp) if len({table[r][2] for r in range(d * tp, (d + 1) * tp)}) > 1]
    if split:
        print(f"{tag}: FAIL: the ranks of TP group(s) {split} hold different log-prob / entropy / dh (every rank "
              "of a group must hold the same merged values, bit for bit)", flush=True)
        return 1
    quantities = [q for q, *_ in table[0][0]]
    worst = {q: (max(rows[i][1] for rows, _, _ in table), max(rows[i][2] for rows, _, _ in table),
                 all(rows[i][3] for rows, _, _ in table)) for i, q in enumerate(quantities)}
    if rank == 0:
        c = prob.case
        print(f"dualvp verify under a launcher: {world} ranks = TP {tp} x DP {world // tp}, T={c.lead[0]} "
              f"V={c.vocab} dtype={c.dtype} temperature={c.temperature} mask={args.mask} seed={args.seed} "
              f"(+ replica index)")
        print(f"{'quantity':<9} {'max abs err':>12} {'max rel err':>12}  result (worst rank)")
        for q, (a, e, ok) in worst.items():
            print(f"{q:<9} {a:>12.3e} {e:>12.3e}  {'PASS' if ok else 'FAIL'}")
    bad = [q for q, (_, _, ok) in worst.items() if not ok]
    if bad:
        print(f"{tag}: FAIL: {', '.join(bad)} outside tolerance on some rank", flush=True)
        return 1
    print(f"{tag}: PASS: {len(quantities)} quantities within tolerance on all {world} ranks "
          f"(TP {tp} x DP {world // tp})", flush=True)
    return 0
