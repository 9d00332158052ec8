"""Rank bodies for the disagreement tests: each rank calls the op with its own arguments.

``run_all(rank, world, names)`` runs the scenarios of :data:`SCENARIOS` one
after the other on every rank and returns, per scenario, what this rank saw:
``(exception type name, message, seconds)`` or ``("ok", "", seconds)``. A
scenario the op fails to detect desynchronises the collectives of the ones
after it, so the test also fails in that case (or times out: the parent kills
the ranks).
"""

from __future__ import annotations

import time

import torch

from dualvp_torch import logprob_entropy

T, V = 5, 8


def _base(rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    return dict(
        logits=torch.randn(T, V, generator=g),
        target=torch.tensor([0, 3, 9, -100, 15]),
        keep_mask=None,
        temperature=1.0,
        with_entropy=True,
        entropy_grad=True,
        ignore_index=-100,
    )


def _odd(rank: int) -> bool:
    return rank == 1  # one rank differs from all the others


# name -> (change applied on the odd rank, what every rank's error must name)
SCENARIOS = {
    "with_entropy": (lambda kw: kw.update(with_entropy=False), "disagree on with_entropy"),
    "entropy_grad": (lambda kw: kw.update(entropy_grad=False), "disagree on entropy_grad"),
    "mask_present": (lambda kw: kw.update(keep_mask=torch.ones(T, V, dtype=torch.bool)),
                     "disagree on keep_mask present"),
    "temperature": (lambda kw: kw.update(temperature=0.7), "disagree on temperature"),
    "ignore_index": (lambda kw: kw.update(ignore_index=-1), "disagree on ignore_index"),
    "rows": (lambda kw: kw.update(logits=kw["logits"][:4], target=kw["target"][:4]), "disagree on T ("),
    "v_local": (lambda kw: kw.update(logits=torch.randn(T, V + 1)), "disagree on V_local"),
    "dtype": (lambda kw: kw.update(logits=kw["logits"].double()), "disagree on logits dtype"),
    "one_rank_invalid": (lambda kw: kw.update(temperature=-1.0), "rank 1 (temperature)"),
    "one_rank_bad_shape": (lambda kw: kw.update(target=kw["target"][:3]), "rank 1 (target)"),
    "one_rank_bad_dtype": (lambda kw: kw.update(target=kw["target"].float()), "rank 1 (target)"),
    "one_rank_not_a_tensor": (lambda kw: kw.update(logits=kw["logits"].tolist()), "rank 1 (logits)"),
}


def _call(kw, group):
    z = kw.pop("logits")
    if isinstance(z, torch.Tensor):
        z.requires_grad_(True)
    lp, h = logprob_entropy(z, kw.pop("target"), group=group, **kw)
    (lp.sum() + (h.sum() if h is not None else 0)).backward()


def run_all(rank: int, world: int, names) -> list:
    group = torch.distributed.group.WORLD
    seen = []
    for name in names:
        kw = _base(rank)
        if _odd(rank):
            SCENARIOS[name][0](kw)
        t0 = time.perf_counter()
        try:
            _call(kw, group)
            seen.append(("ok", "", time.perf_counter() - t0))
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            seen.append((type(exc).__name__, str(exc), time.perf_counter() - t0))
    # after all that, the group still works: a valid call on every rank
    _call(_base(rank), group)
    return seen


def out_of_range(rank: int, world: int) -> list:
    """Only rank 1 has an out-of-range target: every rank raises ValueError."""
    group = torch.distributed.group.WORLD
    kw = _base(rank)
    if _odd(rank):
        kw["target"] = torch.tensor([0, 3, world * V, -100, 1])
    try:
        _call(kw, group)
        return ["ok", ""]
    except Exception as exc:  # noqa: BLE001
        return [type(exc).__name__, str(exc)]


def all_invalid(rank: int, world: int) -> list:
    """Every rank passes the same bad temperature: each raises its own ValueError."""
    kw = _base(rank)
    kw["temperature"] = 0.0
    try:
        _call(kw, torch.distributed.group.WORLD)
        return ["ok", ""]
    except Exception as exc:  # noqa: BLE001
        return [type(exc).__name__, str(exc)]


def rank_checks(rank: int, world: int) -> dict:
    """Everything above, in one rank process, in a fixed order."""
    return dict(table=run_all(rank, world, list(SCENARIOS)), out_of_range=out_of_range(rank, world),
                all_invalid=all_invalid(rank, world))
