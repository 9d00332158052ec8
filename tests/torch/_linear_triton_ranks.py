"""Rank body of the fused op's Triton multi-rank test (tests/torch/test_linear_triton.py).

The problem and its float64 oracle are those of ``_linear_ranks.py``; each
rank runs ``impl="triton"`` (under ``TRITON_INTERPRET=1`` on CPU tensors) with
``dh`` reduced over the group, left partial, and sequence parallel.
"""

from __future__ import annotations

import numpy as np
import torch

from dualvp_torch import linear_logprob_entropy

from ._linear_ranks import TAU, V_LOCAL, T, problem


def _run(p, rank, world, group, dtype, **kw):
    sl = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
    sp = kw.get("sequence_parallel", False)
    rows = slice(rank * (T // world), (rank + 1) * (T // world)) if sp else slice(None)
    dt = getattr(torch, dtype)
    h = torch.tensor(p["hidden"][rows]).to(dt).requires_grad_(True)
    w = torch.tensor(p["weight"][sl]).to(dt).requires_grad_(True)
    keep = torch.tensor(p["keep"][:, sl])
    lp, en = linear_logprob_entropy(
        h, w, torch.tensor(p["target"]), group=group, keep_mask=keep, temperature=TAU, impl="triton", **kw
    )
    (lp * torch.tensor(p["gl"], dtype=torch.float32) + en * torch.tensor(p["ge"], dtype=torch.float32)).sum().backward()
    return {"lp": lp.detach().double().numpy(), "en": en.detach().double().numpy(),
            "dh": h.grad.double().numpy(), "dw": w.grad.double().numpy()}


def rank_suite(rank: int, world: int, dtype: str = "float32") -> dict:
    group = torch.distributed.group.WORLD
    p = problem(world)
    if dtype != "float32":  # the same problem, rounded to the dtype (the parent rounds its oracle's inputs alike)
        from dualvp.testing.cases import round_to_dtype

        p = dict(p, hidden=round_to_dtype(p["hidden"], dtype), weight=round_to_dtype(p["weight"], dtype))
    return {
        "plain": _run(p, rank, world, group, dtype),
        "partial": _run(p, rank, world, group, dtype, reduce_hidden_grad=False),
        "sp": _run(p, rank, world, group, dtype, sequence_parallel=True),
        "finite": bool(np.isfinite(p["hidden"]).all()),
    }


def rank_suites(rank: int, world: int, suites: tuple) -> dict:
    """:func:`rank_suite` for each ``(dtype, gradient_rounding)`` of ``suites`` in one spawn of the ranks.

    One start-up for all; ``gradient_rounding`` ``None``: the default.
    """
    from dualvp_torch import tuning

    out = {}
    for dt, rounding in suites:
        setting = tuning.current() if rounding is None else tuning.Tuning(gradient_rounding=rounding)
        with tuning.using(setting):
            out[dt, rounding] = rank_suite(rank, world, dt)
    return out


# --- one-rank runs under the interpreter (tests/torch/test_linear_triton.py) --------------


def make_problem(case_kw: dict, hidden: int, logit_scale: float = 3.0, nan_at=None):
    """The :func:`dualvp.testing.cases.make_linear` problem of ``case("basic", **case_kw)`` (deterministic)."""
    from dualvp.testing import cases

    P = cases.make_linear(cases.case("basic", **case_kw), hidden, logit_scale=logit_scale)
    if nan_at is not None:
        P.hidden[nan_at] = np.nan
    return P


def run_case(rank: int, world: int, case_kw: dict, hidden: int, run_kw: dict, logit_scale: float = 3.0,
             nan_at=None) -> tuple:
    """``(logprob, entropy, dh, dW)`` (NumPy float64, ``None`` where absent) of one forward + backward.

    Run in a child whose ``TRITON_INTERPRET=1`` was set before Triton was
    imported (Triton defines its own library functions as interpreted or
    compiled at import).
    """
    import sys

    from dualvp_torch import linear_logprob_entropy, triton_kernels

    if not triton_kernels.interpreting():
        raise RuntimeError("TRITON_INTERPRET is not 1 in the child")
    P = make_problem(case_kw, hidden, logit_scale, nan_at)
    from dualvp_torch import tuning

    run_kw = dict(run_kw)
    hidden_grad, weight_grad = run_kw.pop("hidden_grad", True), run_kw.pop("weight_grad", True)
    rounding = run_kw.pop("gradient_rounding", tuning.current().gradient_rounding)
    backward = run_kw.pop("triton_linear_backward", tuning.current().triton_linear_backward)
    dt = getattr(torch, P.case.dtype)
    h = torch.tensor(P.hidden).to(dt).requires_grad_(hidden_grad)
    w = torch.tensor(P.weight).to(dt).requires_grad_(weight_grad)
    keep = None if P.keep_mask is None else torch.tensor(P.keep_mask)
    with tuning.using(tuning.Tuning(gradient_rounding=rounding, triton_linear_backward=backward)):
        lp, en = linear_logprob_entropy(h, w, torch.tensor(P.target), keep_mask=keep,
                                        temperature=P.case.temperature, ignore_index=P.case.ignore_index, **run_kw)
        loss = (lp * torch.tensor(P.grad_logprob, dtype=lp.dtype)).sum()
        if en is not None and en.requires_grad:
            loss = loss + (en * torch.tensor(P.grad_entropy, dtype=en.dtype)).sum()
        loss.backward()
    assert "triton" in sys.modules or run_kw.get("impl") != "triton"
    out = []
    for x, want_dtype in ((lp, None), (en, None), (h.grad, dt), (w.grad, dt)):
        if x is not None and want_dtype is not None and x.dtype != want_dtype:
            raise AssertionError(f"gradient dtype {x.dtype}, expected {want_dtype}")
        out.append(None if x is None else x.detach().double().numpy())
    return tuple(out)


def run_roundings(rank: int, world: int, case_kw: dict, hidden: int, roundings: tuple) -> dict:
    """``{gradient_rounding: (dh, dW)}`` (NumPy float64) of one forward and one backward per rounding.

    The forward does not read ``gradient_rounding`` (the backward does, when it runs): the runs of
    :func:`run_case` with each rounding would repeat the same forward. Each backward takes the
    gradients of the same loss (``torch.autograd.grad``, the graph kept for the next).
    """
    from dualvp_torch import triton_kernels, tuning

    if not triton_kernels.interpreting():
        raise RuntimeError("TRITON_INTERPRET is not 1 in the child")
    P = make_problem(case_kw, hidden)
    dt = getattr(torch, P.case.dtype)
    h = torch.tensor(P.hidden).to(dt).requires_grad_(True)
    w = torch.tensor(P.weight).to(dt).requires_grad_(True)
    keep = None if P.keep_mask is None else torch.tensor(P.keep_mask)
    lp, en = linear_logprob_entropy(h, w, torch.tensor(P.target), keep_mask=keep, temperature=P.case.temperature,
                                    ignore_index=P.case.ignore_index, impl="triton")
    loss = (lp * torch.tensor(P.grad_logprob, dtype=lp.dtype)).sum() + \
        (en * torch.tensor(P.grad_entropy, dtype=en.dtype)).sum()
    out = {}
    for i, rounding in enumerate(roundings):
        with tuning.using(tuning.Tuning(gradient_rounding=rounding)):
            dh, dw = torch.autograd.grad(loss, [h, w], retain_graph=i + 1 < len(roundings))
        if dh.dtype != dt or dw.dtype != dt:
            raise AssertionError(f"gradient dtypes {dh.dtype}, {dw.dtype}, expected {dt}")
        out[rounding] = (dh.double().numpy(), dw.double().numpy())
    return out
