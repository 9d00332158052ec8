"""Rank bodies of the fused LM-head op's multi-rank tests (tests/torch/test_linear.py).

``rank_suite(rank, world)`` runs every scenario on one real gloo rank and
returns picklable NumPy results; the parent judges them against the float64
oracle. Every rank builds the same full problem from one seed and takes its
own weight rows (and, with sequence parallelism, its own hidden rows).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from dualvp_torch import engines, linear_logprob_entropy

T, H, V_LOCAL, TAU = 12, 8, 37, 0.8  # T divisible by 2 and 4; V_local not a multiple of the tile
# bytes: eager tiles (4 + engines.BLOCK_SCRATCH_BYTES per element) of 1 row x 20 columns
# -> 2 vocab blocks, 12 token chunks
BUDGET = (4 + engines.BLOCK_SCRATCH_BYTES) * 20


def problem(world: int, seed: int = 0) -> dict:
    """The full problem as float64 NumPy arrays (float32-representable)."""
    rng = np.random.default_rng(seed)
    v = world * V_LOCAL
    f32 = lambda a: a.astype(np.float32).astype(np.float64)  # noqa: E731
    target = rng.integers(0, v, size=T)
    target[[2, 7]] = -100
    return dict(
        hidden=f32(rng.normal(size=(T, H))),
        weight=f32(rng.normal(size=(v, H)) * 0.7),
        target=target,
        keep=rng.random((T, v)) < 0.6,
        gl=f32(rng.normal(size=T)),
        ge=f32(rng.normal(size=T)),
    )


def _run(p, rank, world, group, **kw):
    sl = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
    sp = kw.get("sequence_parallel", False)
    rows = slice(rank * (T // world), (rank + 1) * (T // world)) if sp else slice(None)
    h = torch.tensor(p["hidden"][rows], dtype=torch.float32, requires_grad=True)
    w = torch.tensor(p["weight"][sl], dtype=torch.float32, requires_grad=True)
    keep = torch.tensor(p["keep"][:, sl])
    lp, en = linear_logprob_entropy(
        h, w, torch.tensor(p["target"]), group=group, keep_mask=keep, temperature=TAU, memory_budget=BUDGET,
        impl="eager", **kw,
    )
    (lp * torch.tensor(p["gl"], dtype=torch.float32) + en * torch.tensor(p["ge"], dtype=torch.float32)).sum().backward()
    return dict(lp=lp.detach().double().numpy(), en=en.detach().double().numpy(),
                dh=h.grad.double().numpy(), dw=w.grad.double().numpy())


# --- disagreement / bad-input scenarios: (change on the odd rank or on all ranks, what every rank's error names)


def _base(rank):
    g = torch.Generator().manual_seed(rank)
    hidden = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))  # replicated: the same on every rank
    return dict(hidden=hidden, weight=torch.randn(5, 4, generator=g),
                target=torch.tensor([0, 3, 9, -100, 4, 1, 2, 7]), keep_mask=None, kw={})


def _odd(fn):
    return lambda rank, d: fn(d) if rank == 1 else None


def _all(fn):
    return lambda rank, d: fn(d)


def _set_kw(**kw):
    return lambda d: d["kw"].update(kw)


SCENARIOS = {
    "weight_rows": (_odd(lambda d: d.update(weight=torch.randn(6, 4))), "disagree on V_local"),
    "h_mismatch_one_rank": (_odd(lambda d: d.update(weight=torch.randn(5, 3))), "rank 1 (weight)"),
    "h_differs": (_odd(lambda d: d.update(hidden=torch.randn(8, 5), weight=torch.randn(5, 5))), "disagree on H"),
    "reduce_hidden_grad": (_odd(_set_kw(reduce_hidden_grad=False)), "disagree on reduce_hidden_grad"),
    "sequence_parallel": (_odd(_set_kw(sequence_parallel=True)), "rank 1 (hidden)"),
    "hidden_requires_grad": (_odd(lambda d: d.update(frozen_hidden=True)), "disagree on hidden requires grad"),
    "keep_mask_shape": (_odd(lambda d: d.update(keep_mask=torch.ones(8, 4, dtype=torch.bool))), "rank 1 (keep_mask)"),
    "sp_rows_not_dividing": (
        _all(lambda d: d.update(hidden=d["hidden"][:3], target=torch.tensor([0, 1, 2, 3, 4]),
                                kw={"sequence_parallel": True})),
        "sequence_parallel: expected the W",
    ),
    "temperature": (_odd(_set_kw(temperature=0.5)), "disagree on temperature"),
}


def _call(d, group):
    h = d["hidden"]
    if not d.get("frozen_hidden"):
        h = h.clone().requires_grad_(True)
    w = d["weight"].clone().requires_grad_(True)
    lp, en = linear_logprob_entropy(h, w, d["target"], group=group, keep_mask=d["keep_mask"], impl="eager", **d["kw"])
    (lp.sum() + en.sum()).backward()


def rank_suite(rank: int, world: int) -> dict:
    group = torch.distributed.group.WORLD
    p = problem(world)
    out = {
        "plain": _run(p, rank, world, group),
        "partial": _run(p, rank, world, group, reduce_hidden_grad=False),
        "sp": _run(p, rank, world, group, sequence_parallel=True),
    }
    seen = {}
    for name, (change, _) in SCENARIOS.items():
        d = _base(rank)
        change(rank, d)
        t0 = time.perf_counter()
        try:
            _call(d, group)
            seen[name] = ("ok", "", time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - the parent inspects it
            seen[name] = (type(exc).__name__, str(exc), time.perf_counter() - t0)
    out["bad"] = seen
    _call(_base(rank), group)  # the group still works after all of that
    out["after_ok"] = True
    return out
