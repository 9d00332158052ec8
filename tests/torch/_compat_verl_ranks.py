"""Rank body of the verl drop-in's tensor-parallel test (tests/torch/test_compat_verl.py).

Every rank builds the same problem, takes its contiguous weight rows and calls
``linear_cross_entropy(..., dist_process_group=WORLD)`` as verl's
tensor-parallel test does; ``d_hidden`` comes back partial (the parent sums it
over the ranks, as verl's callers all-reduce it).
"""

from __future__ import annotations

import numpy as np
import torch

from dualvp_torch.compat import linear_cross_entropy

T, H, V_LOCAL, TAU = 10, 12, 23, 1.5


def problem(world: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    f32 = lambda a: a.astype(np.float32).astype(np.float64)  # noqa: E731
    return dict(
        hidden=f32(rng.uniform(-0.5, 0.5, size=(1, T, H)) * 4),
        weight=f32(rng.uniform(-0.5, 0.5, size=(world * V_LOCAL, H))),
        labels=rng.integers(0, world * V_LOCAL, size=(1, T)),
        g_logprobs=f32(rng.uniform(-1, 1, size=T)),
        g_entropy=f32(rng.uniform(-0.5, 0.5, size=T)),
    )


def rank_suite(rank: int, world: int, reduction: str) -> dict:
    group = torch.distributed.group.WORLD
    p = problem(world)
    h = torch.tensor(p["hidden"], dtype=torch.float32, requires_grad=True)
    w = torch.tensor(p["weight"][rank * V_LOCAL : (rank + 1) * V_LOCAL], dtype=torch.float32, requires_grad=True)
    lp, en = linear_cross_entropy(h, w, torch.tensor(p["labels"]), TAU, reduction, group, impl="eager")
    g_lp = torch.tensor(p["g_logprobs"], dtype=torch.float32)
    if reduction != "none":
        g_lp = g_lp[0]
    d_h, d_w = torch.autograd.grad((en, lp), (h, w), (torch.tensor(p["g_entropy"], dtype=torch.float32), g_lp))
    return {"lp": lp.detach().double().numpy(), "en": en.detach().double().numpy(),
            "dh": d_h.double().numpy(), "dw": d_w.double().numpy(), "dh_shape": tuple(d_h.shape)}


def rank_suites(rank: int, world: int, reductions: tuple) -> dict:
    """:func:`rank_suite` for each of ``reductions`` in one spawn of the ranks (one start-up for all)."""
    return {r: rank_suite(rank, world, r) for r in reductions}
