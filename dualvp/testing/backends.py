"""Typed backend adapters: ``run(backend, problem, world) -> Outputs``.

One function runs a :class:`~dualvp.testing.cases.Problem` (forward and
backward with the problem's upstream gradients) on ``world`` vocab shards of a
backend and returns :class:`~dualvp.testing.oracle.Outputs` over the full
vocabulary, for ``dualvp verify`` and the tests alike:

* ``"spec"``: :mod:`dualvp.spec` over simulated shards (:func:`dualvp.simulate.over_shards`),
  in float32 (float64 for float64 input), in this process;
* ``"torch"``: ``dualvp_torch.logprob_entropy`` in this process for
  ``world == 1`` (no group), else on ``world`` real gloo ranks
  (``dualvp_torch.testing.run_ranks``, one spawn for all problems);
* ``"jax"``: ``dualvp_jax.sharded_logprob_entropy`` on a mesh of the first
  ``world`` devices of this process (JAX must have been imported with enough
  host devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=W``).

torch and JAX are imported only when their backend runs.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import numpy as np

from .. import simulate
from .cases import Problem
from .oracle import Outputs

__all__ = ["BACKENDS", "run", "run_all", "torch_rank_outputs", "merge_ranks"]

BACKENDS = ("spec", "torch", "jax")


def run(backend: str, problem: Problem, world: int, *, impl: Optional[str] = None, timeout: float = 600.0,
        env: Optional[dict] = None) -> Outputs:
    """Forward + backward of ``problem`` on ``world`` shards of ``backend`` (see the module docstring).

    Args:
      impl: torch only: ``None`` (``DUALVP_COMPILE`` decides), ``"compiled"`` or ``"eager"``.
      timeout: torch with ``world > 1``: wall-clock limit of the gloo ranks, seconds.
      env: torch with ``world > 1``: extra environment variables of the ranks.
    """
    return run_all(backend, [problem], world, impl=impl, timeout=timeout, env=env)[0]


def run_all(backend: str, problems: Sequence[Problem], world: int, *, impl: Optional[str] = None,
            timeout: float = 600.0, env: Optional[dict] = None) -> list:
    """:func:`run` for several problems (one spawn of the torch ranks for all); a list of Outputs."""
    problems = list(problems)
    if backend == "spec":
        return [_spec(p, world) for p in problems]
    if backend == "torch":
        if world == 1:
            return torch_rank_outputs(0, 1, problems, impl)
        from dualvp_torch.testing import run_ranks

        return merge_ranks(run_ranks(torch_rank_outputs, world, problems, impl, timeout=timeout, env=env))
    if backend == "jax":
        from . import faults

        faults.install_from_env()
        return [_jax(p, world) for p in problems]
    raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")


def _compute_dtype(dtype: str):
    return np.float64 if dtype == "float64" else np.float32


def _spec(p: Problem, world: int) -> Outputs:
    c = p.case
    lp, h, g = simulate.over_shards(
        p.logits, p.target, world, keep_mask=p.keep_mask, temperature=c.temperature, ignore_index=c.ignore_index,
        grad_logprob=p.grad_logprob, grad_entropy=p.grad_entropy, dtype=_compute_dtype(c.dtype))
    return Outputs(*(np.asarray(x, np.float64) for x in (lp, h, g)))


def torch_rank_outputs(rank: int, world: int, problems: Sequence[Problem], impl: Optional[str] = None) -> list:
    """On one rank (``group=None`` when ``world == 1``): Outputs of every problem, ``grad`` this rank's columns."""
    import torch

    from dualvp_torch import logprob_entropy

    group = torch.distributed.group.WORLD if world > 1 else None
    outs = []
    for p in problems:
        c = p.case
        zs, ks = p.shard(rank, world)
        z = torch.from_numpy(np.ascontiguousarray(zs)).to(getattr(torch, c.dtype)).requires_grad_(True)
        keep = None if ks is None else torch.from_numpy(np.ascontiguousarray(ks))
        lp, h = logprob_entropy(z, torch.from_numpy(p.target), group=group, keep_mask=keep,
                                temperature=c.temperature, ignore_index=c.ignore_index, impl=impl)
        torch.autograd.backward([lp, h], [torch.from_numpy(p.grad_logprob).to(lp.dtype),
                                          torch.from_numpy(p.grad_entropy).to(h.dtype)])
        outs.append(Outputs(lp.detach().double().numpy(), h.detach().double().numpy(), z.grad.double().numpy()))
    return outs


def merge_ranks(per_rank: Sequence[list]) -> list:
    """Join per-rank :func:`torch_rank_outputs` into full-vocabulary Outputs.

    Every rank holds the same combined statistics, so log-prob and entropy
    must agree bitwise across ranks; a difference raises ``RuntimeError``.
    """
    merged = []
    for i, first in enumerate(per_rank[0]):
        for r, outs in enumerate(per_rank[1:], start=1):
            for q in ("logprob", "entropy"):
                if not np.array_equal(getattr(outs[i], q), getattr(first, q), equal_nan=True):
                    raise RuntimeError(f"torch rank {r} {q} differs from rank 0")
        merged.append(Outputs(first.logprob, first.entropy, np.concatenate([o[i].grad for o in per_rank], axis=-1)))
    return merged


def _jax(p: Problem, world: int) -> Outputs:
    import jax
    import jax.numpy as jnp

    import dualvp_jax

    c = p.case
    devices = jax.devices()
    if len(devices) < world:
        raise RuntimeError(f"world: JAX has {len(devices)} device(s), {world} needed; set XLA_FLAGS="
                           f"--xla_force_host_platform_device_count={world} before JAX is imported")
    # float64 input needs jax_enable_x64, scoped to this call
    x64 = jax.enable_x64(True) if c.dtype == "float64" else contextlib.nullcontext()
    with x64:
        mesh = jax.make_mesh((world,), ("tp",), devices=devices[:world])
        z = jnp.asarray(p.logits).astype(getattr(jnp, c.dtype))
        y = jnp.asarray(p.target)
        keep = None if p.keep_mask is None else jnp.asarray(p.keep_mask)

        def f(z):
            return dualvp_jax.sharded_logprob_entropy(z, y, mesh, "tp", keep_mask=keep, temperature=c.temperature,
                                                      ignore_index=c.ignore_index)

        (lp, h), vjp = jax.vjp(f, z)
        (g,) = vjp((jnp.asarray(p.grad_logprob).astype(lp.dtype), jnp.asarray(p.grad_entropy).astype(h.dtype)))
        g = g.astype(jnp.float64 if c.dtype == "float64" else jnp.float32)
        return Outputs(np.asarray(lp, np.float64), np.asarray(h, np.float64), np.asarray(g, np.float64))
