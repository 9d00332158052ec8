"""Typed backend adapters: ``run(backend, problem, world) -> Outputs``.

One function runs a :class:`~dualvp.testing.cases.Problem` (forward and
backward with the problem's upstream gradients) on ``world`` vocab shards of a
backend and returns :class:`~dualvp.testing.oracle.Outputs` over the full
vocabulary, for ``dualvp verify`` and the tests alike:

* ``"spec"``: :mod:`dualvp.spec` over simulated shards (:func:`dualvp.simulate.over_shards`),
  in float32 (float64 for float64 input), in this process;
* ``"torch"``: ``dualvp_torch.logprob_entropy`` in this process for
  ``world == 1`` (no group), else on ``world`` real gloo ranks
  (``dualvp_torch.testing.run_ranks``, one spawn for all problems); with
  ``device="cuda"`` the tensors live on the GPU (rank ``r`` on ``cuda:r``)
  and ``world > 1`` runs on NCCL, one GPU per rank;
* ``"jax"``: ``dualvp_jax.sharded_logprob_entropy`` on a mesh of the first
  ``world`` devices of this process (JAX must have been imported with enough
  host devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=W``).

A :class:`~dualvp.testing.cases.LinearProblem` (the fused LM head) runs the
same way and gives :class:`~dualvp.testing.oracle.LinearOutputs`: torch's
``dualvp_torch.linear_logprob_entropy`` with each rank's weight rows, the
hidden states identical on every rank and ``reduce_hidden_grad=True``; JAX's
``dualvp_jax.sharded_linear_logprob_entropy`` with the weight's rows split
over the mesh. The ``spec`` backend has no fused form and refuses it.

torch and JAX are imported only when their backend runs.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence, Union

import numpy as np

from .. import simulate
from .cases import LinearProblem, Problem
from .oracle import LinearOutputs, Outputs

__all__ = ["BACKENDS", "run", "run_all", "torch_rank_outputs", "merge_ranks"]

BACKENDS = ("spec", "torch", "jax")


def run(backend: str, problem: Union[Problem, LinearProblem], world: int, *, impl: Optional[str] = None,
        timeout: float = 600.0, env: Optional[dict] = None, device: str = "cpu") -> Union[Outputs, LinearOutputs]:
    """Forward + backward of ``problem`` on ``world`` shards of ``backend`` (see the module docstring).

    Args:
      impl: torch only: ``None`` (``DUALVP_COMPILE`` decides), ``"compiled"`` or ``"eager"``.
      timeout: torch with ``world > 1``: wall-clock limit of the gloo ranks, seconds.
      env: torch with ``world > 1``: extra environment variables of the ranks.
      device: torch only: ``"cpu"`` (gloo ranks) or ``"cuda"`` (NCCL ranks, one GPU each; the caller
        checks that ``world`` GPUs exist). The other backends run on the host.
    """
    return run_all(backend, [problem], world, impl=impl, timeout=timeout, env=env, device=device)[0]


def run_all(backend: str, problems: Sequence[Problem], world: int, *, impl: Optional[str] = None,
            timeout: float = 600.0, env: Optional[dict] = None, device: str = "cpu") -> list:
    """:func:`run` for several problems (one spawn of the torch ranks for all); a list of Outputs."""
    problems = list(problems)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    if device != "cpu" and backend != "torch":
        raise ValueError(f"device: only the torch backend runs on {device!r}; {backend!r} runs on the host")
    if backend == "spec":
        if any(isinstance(p, LinearProblem) for p in problems):
            raise ValueError("backend: 'spec' has no fused LM-head form; run a LinearProblem on 'torch' or 'jax'")
        return [_spec(p, world) for p in problems]
    if backend == "torch":
        if world == 1:
            return torch_rank_outputs(0, 1, problems, impl, device)
        from dualvp_torch.testing import run_ranks

        return merge_ranks(run_ranks(torch_rank_outputs, world, problems, impl, device, timeout=timeout, env=env,
                                     backend="nccl" if device == "cuda" else "gloo"))
    if backend == "jax":
        from . import faults

        faults.install_from_env()
        return [(_jax_linear if isinstance(p, LinearProblem) else _jax)(p, world) for p in problems]
    raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")


def _compute_dtype(dtype: str):
    return np.float64 if dtype == "float64" else np.float32


def _spec(p: Problem, world: int) -> Outputs:
    c = p.case
    lp, h, g = simulate.over_shards(
        p.logits, p.target, world, keep_mask=p.keep_mask, keep_ids=p.keep_ids, temperature=c.temperature,
        ignore_index=c.ignore_index, grad_logprob=p.grad_logprob, grad_entropy=p.grad_entropy,
        dtype=_compute_dtype(c.dtype))
    return Outputs(*(np.asarray(x, np.float64) for x in (lp, h, g)))


def torch_rank_outputs(rank: int, world: int, problems: Sequence[Problem], impl: Optional[str] = None,
                       device: str = "cpu") -> list:
    """On one rank (``group=None`` when ``world == 1``): Outputs of every problem, ``grad`` this rank's columns.

    ``device="cuda"``: the rank's tensors on ``cuda:rank`` (``world > 1``, NCCL) or the current
    CUDA device (``world == 1``); the outputs come back to the host as float64 NumPy.
    A :class:`LinearProblem` gives :class:`LinearOutputs` with ``dW`` this rank's weight rows.
    """
    import torch

    from dualvp_torch import logprob_entropy

    if device == "cuda" and world > 1:
        torch.cuda.set_device(rank)  # before the first NCCL collective: one GPU per rank
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")

    def put(a, dtype=None):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=dev, dtype=dtype)

    group = torch.distributed.group.WORLD if world > 1 else None
    outs = []
    for p in problems:
        if isinstance(p, LinearProblem):
            outs.append(_torch_linear(p, rank, world, group, impl, put))
            continue
        c = p.case
        zs, ks = p.shard(rank, world)
        z = put(zs, getattr(torch, c.dtype)).requires_grad_(True)
        keep = None if ks is None else put(ks)
        ids = None if p.keep_ids is None else put(p.keep_ids)  # global ids: the same on every rank
        lp, h = logprob_entropy(z, put(p.target), group=group, keep_mask=keep, keep_ids=ids,
                                temperature=c.temperature, ignore_index=c.ignore_index, impl=impl)
        torch.autograd.backward([lp, h], [put(p.grad_logprob, lp.dtype), put(p.grad_entropy, h.dtype)])
        outs.append(Outputs(*(x.detach().double().cpu().numpy() for x in (lp, h, z.grad))))
    return outs


def _torch_linear(p: LinearProblem, rank: int, world: int, group, impl: Optional[str], put) -> LinearOutputs:
    """One rank's fused forward + backward: this rank's weight rows, the whole hidden, ``dh`` all-reduced.

    ``put(array, dtype=None)``: the array as a tensor on the rank's device.
    """
    import torch

    from dualvp_torch import linear_logprob_entropy

    c = p.case
    dt = getattr(torch, c.dtype)
    ws, ks = p.shard(rank, world)
    h = put(p.hidden, dt).requires_grad_(True)
    w = put(ws, dt).requires_grad_(True)
    keep = None if ks is None else put(ks)
    ids = None if p.keep_ids is None else put(p.keep_ids)
    lp, en = linear_logprob_entropy(h, w, put(p.target), group=group, keep_mask=keep, keep_ids=ids,
                                    temperature=c.temperature, ignore_index=c.ignore_index,
                                    reduce_hidden_grad=True, impl=impl)
    torch.autograd.backward([lp, en], [put(p.grad_logprob, lp.dtype), put(p.grad_entropy, en.dtype)])
    return LinearOutputs(*(x.detach().double().cpu().numpy() for x in (lp, en, h.grad, w.grad)))


def merge_ranks(per_rank: Sequence[list]) -> list:
    """Join per-rank :func:`torch_rank_outputs` into full-vocabulary Outputs (or LinearOutputs).

    Every rank holds the same combined statistics, so log-prob and entropy
    must agree bitwise across ranks, and so must the all-reduced ``dh`` of a
    fused problem; a difference raises ``RuntimeError``. ``grad`` columns
    (``dW`` rows) are joined in rank order.
    """
    merged = []
    for i, first in enumerate(per_rank[0]):
        linear = isinstance(first, LinearOutputs)
        for r, outs in enumerate(per_rank[1:], start=1):
            for q in ("logprob", "entropy", "dh") if linear else ("logprob", "entropy"):
                if not np.array_equal(getattr(outs[i], q), getattr(first, q), equal_nan=True):
                    raise RuntimeError(f"torch rank {r} {q} differs from rank 0")
        if linear:
            merged.append(first._replace(dW=np.concatenate([o[i].dW for o in per_rank], axis=0)))
            continue
        merged.append(Outputs(first.logprob, first.entropy, np.concatenate([o[i].grad for o in per_rank], axis=-1)))
    return merged


@contextlib.contextmanager
def _jax_mesh(dtype: str, world: int):
    """A ``("tp",)`` mesh of the first ``world`` devices, with jax_enable_x64 scoped to float64 problems."""
    import jax

    devices = jax.devices()
    if len(devices) < world:
        raise RuntimeError(f"world: JAX has {len(devices)} device(s), {world} needed; set XLA_FLAGS="
                           f"--xla_force_host_platform_device_count={world} before JAX is imported")
    with jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext():
        yield jax.make_mesh((world,), ("tp",), devices=devices[:world])


def _jax(p: Problem, world: int) -> Outputs:
    import jax
    import jax.numpy as jnp

    import dualvp_jax

    c = p.case
    with _jax_mesh(c.dtype, world) as mesh:
        z = jnp.asarray(p.logits).astype(getattr(jnp, c.dtype))
        y = jnp.asarray(p.target)
        keep = None if p.keep_mask is None else jnp.asarray(p.keep_mask)
        ids = None if p.keep_ids is None else jnp.asarray(p.keep_ids)

        def f(z):
            return dualvp_jax.sharded_logprob_entropy(z, y, mesh, "tp", keep_mask=keep, keep_ids=ids,
                                                      temperature=c.temperature, ignore_index=c.ignore_index)

        (lp, h), vjp = jax.vjp(f, z)
        (g,) = vjp((jnp.asarray(p.grad_logprob).astype(lp.dtype), jnp.asarray(p.grad_entropy).astype(h.dtype)))
        g = g.astype(jnp.float64 if c.dtype == "float64" else jnp.float32)
        return Outputs(np.asarray(lp, np.float64), np.asarray(h, np.float64), np.asarray(g, np.float64))


def _jax_linear(p: LinearProblem, world: int) -> LinearOutputs:
    import jax
    import jax.numpy as jnp

    import dualvp_jax

    c = p.case
    with _jax_mesh(c.dtype, world) as mesh:
        dt = getattr(jnp, c.dtype)
        h, w = jnp.asarray(p.hidden).astype(dt), jnp.asarray(p.weight).astype(dt)
        y = jnp.asarray(p.target)
        keep = None if p.keep_mask is None else jnp.asarray(p.keep_mask)
        ids = None if p.keep_ids is None else jnp.asarray(p.keep_ids)

        def f(h, w):
            return dualvp_jax.sharded_linear_logprob_entropy(h, w, y, mesh, "tp", keep_mask=keep, keep_ids=ids,
                                                             temperature=c.temperature, ignore_index=c.ignore_index)

        (lp, en), vjp = jax.vjp(f, h, w)
        dh, dw = vjp((jnp.asarray(p.grad_logprob).astype(lp.dtype), jnp.asarray(p.grad_entropy).astype(en.dtype)))
        up = jnp.float64 if c.dtype == "float64" else jnp.float32  # bfloat16 -> float32 exactly, then to NumPy
        return LinearOutputs(*(np.asarray(jnp.asarray(x).astype(up), np.float64) for x in (lp, en, dh, dw)))
