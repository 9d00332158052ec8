"""Scenario sweep of dualvp_torch against the float64 oracle, run inside one rank.

``sweep(rank, world)`` runs every case of :data:`dualvp.testing.cases.CASES` that
lists ``world`` in its ``worlds``, in every loss mode of :data:`LOSS_MODES`, on
this rank's shard (``group=None`` when ``world == 1``), and returns a list of
failure descriptions (empty when everything is within the shared tolerances).
It is used in-process for W = 1 and through ``dualvp_torch.testing.run_ranks``
for W = 2 and 4, so that one spawn per W covers the whole table.
"""

from __future__ import annotations

import os

import torch

from dualvp import reference, testing
from dualvp.testing import cases
from dualvp_torch import logprob_entropy

from . import _disagree

# (name, with_entropy, entropy_grad, terms of the loss: L log-prob, H entropy, inplace_grad)
LOSS_MODES = (
    ("both", True, True, "LH", False),
    ("logprob_loss_only", True, True, "L", False),
    ("entropy_loss_only", True, True, "H", False),
    ("no_entropy_grad", True, False, "L", False),
    ("no_entropy", False, True, "L", False),
    ("inplace_both", True, True, "LH", True),
)

_TORCH_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def _np(t):
    return t.detach().to(torch.float64).cpu().numpy()


def _bits(t):
    t = t.contiguous()
    return t.view(torch.uint8) if t.is_floating_point() and t.numel() else t


def run_case(case, rank: int, world: int, group, mode, failures: list) -> None:
    name, with_entropy, entropy_grad, terms, inplace = mode
    tag = f"W={world} rank={rank} case={case.name} mode={name}"
    P = cases.make(case)
    zs, ks = P.shard(rank, world)
    dt = _TORCH_DTYPES[case.dtype]
    leaf = torch.tensor(zs).to(dt).requires_grad_(True)
    target = torch.tensor(P.target)
    keep = None if ks is None else torch.tensor(ks)
    before = [leaf.detach().clone(), target.clone(), None if keep is None else keep.clone()]
    z = leaf * 1 if inplace else leaf  # in-place mode needs a non-leaf
    lp, h = logprob_entropy(
        z,
        target,
        group=group,
        keep_mask=keep,
        temperature=case.temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        ignore_index=case.ignore_index,
        inplace_grad=inplace,
    )
    rl, rh, rg = testing.oracle(P, logprob_grad="L" in terms, entropy_grad="H" in terms)
    if lp.dtype != (torch.float64 if dt == torch.float64 else torch.float32) or tuple(lp.shape) != P.target.shape:
        failures.append(f"{tag}: logprob dtype/shape {lp.dtype} {tuple(lp.shape)}")
    if not cases.within_tolerance(_np(lp), rl, cases.tolerance(case.dtype, "logprob")):
        failures.append(f"{tag}: logprob errors {cases.max_errors(_np(lp), rl)}")
    if with_entropy:
        if h is None or not cases.within_tolerance(_np(h), rh, cases.tolerance(case.dtype, "entropy")):
            failures.append(f"{tag}: entropy errors {None if h is None else cases.max_errors(_np(h), rh)}")
        if h is not None and h.requires_grad != entropy_grad:
            failures.append(f"{tag}: entropy.requires_grad={h.requires_grad}, entropy_grad={entropy_grad}")
    elif h is not None:
        failures.append(f"{tag}: entropy returned with with_entropy=False")
    gl = torch.tensor(P.grad_logprob, dtype=lp.dtype)
    ge = torch.tensor(P.grad_entropy, dtype=lp.dtype)
    loss = lp.new_zeros(())
    if "L" in terms:
        loss = loss + (lp * gl).sum()
    if "H" in terms:
        loss = loss + (h * ge).sum()
    loss.backward()
    v = zs.shape[-1]
    rg = rg[..., rank * v : (rank + 1) * v]
    if leaf.grad is None or leaf.grad.dtype != dt:
        failures.append(f"{tag}: grad missing or wrong dtype {None if leaf.grad is None else leaf.grad.dtype}")
    elif not cases.within_tolerance(_np(leaf.grad), rg, cases.tolerance(case.dtype, "grad")):
        failures.append(f"{tag}: grad errors {cases.max_errors(_np(leaf.grad), rg)}")
    after = [leaf.detach(), target, keep]
    for label, b, a in zip(("logits", "target", "keep_mask"), before, after):
        if b is not None and not torch.equal(_bits(b), _bits(a)):
            failures.append(f"{tag}: input {label} modified")


def sweep(rank: int, world: int, modes=None, case_names=None, compiled_dtypes=None, dtype_modes=None) -> list:
    """Run the table; ``compiled_dtypes`` (a set of dtype names, or ``None`` for
    "leave DUALVP_COMPILE as it is") selects the cases run on the compiled path,
    the others run eagerly (``DUALVP_COMPILE`` is read at each call).
    ``dtype_modes`` maps a dtype name to the modes its cases run instead of ``modes``."""
    import torch.distributed as dist

    modes = LOSS_MODES if modes is None else modes
    group = dist.group.WORLD if world > 1 else None
    failures: list = []
    for case in cases.CASES:
        if world not in case.worlds or (case_names is not None and case.name not in case_names):
            continue
        if compiled_dtypes is not None:
            os.environ["DUALVP_COMPILE"] = "1" if case.dtype in compiled_dtypes else "0"
        for mode in (dtype_modes or {}).get(case.dtype, modes):
            try:
                run_case(case, rank, world, group, mode, failures)
            except Exception as exc:  # report, keep going (all ranks raise alike)
                failures.append(f"W={world} rank={rank} case={case.name} mode={mode[0]}: {type(exc).__name__}: {exc}")
    return failures


# --- everything a spawned rank runs, in one spawn per W -----------------------------


def _raises(fn):
    """``(exception type name, message)`` of ``fn()``, or ``None`` if it returned."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)
    return None


def compat_checks(rank: int, world: int) -> dict:
    """slime with tp_group=None (-> world group, as slime) and Megatron with the world group passed explicitly."""
    from dualvp_torch import compat

    torch.manual_seed(1)
    full = torch.randn(5, 8 * world, dtype=torch.float64)
    y = torch.randint(0, 8 * world, (5,))
    shard = full[:, rank * 8 : (rank + 1) * 8]
    lp, h = compat.calculate_log_probs_and_entropy(shard, y, None, with_entropy=True, chunk_size=2)
    loss = compat.vocab_parallel_cross_entropy(shard, y, tp_group=torch.distributed.group.WORLD)
    rl, rh = reference.logprob_entropy(full.numpy(), y.numpy())
    return {
        "lp_shape": tuple(lp.shape),
        "h_shape": tuple(h.shape),
        "lp_ok": cases.within_tolerance(_np(lp[:, 0]), rl, cases.tolerance("float64", "logprob")),
        "h_ok": cases.within_tolerance(_np(h), rh, cases.tolerance("float64", "entropy")),
        "loss_ok": cases.within_tolerance(-_np(loss), rl, cases.tolerance("float64", "logprob")),
    }


def rank_suite(rank: int, world: int) -> dict:
    """One spawn per W: the whole table (eager kernels), the agreement checks and the compat layer."""
    return {
        "sweep_eager": sweep(rank, world, compiled_dtypes=set()),
        "agreement": _disagree.rank_checks(rank, world),
        "compat": compat_checks(rank, world),
    }


_SUITES: dict = {}


def suite(world: int) -> list:
    """:func:`rank_suite` on ``world`` gloo ranks, spawned once per test session.

    Eager kernels only (``DUALVP_COMPILE=0`` in the ranks, the agreement and compat checks
    included): every rank would compile its kernels, ~1.4 s of tracing per variant. The compiled
    kernels at W = 2 run every case of the table in tests/cross/test_cross_backends.py, and at
    W = 1 every loss mode in test_logits_conformance.py::test_table_compiled; the code W
    exercises (agreement, statistics all-gather, owning shard) is the same on both engines.
    """
    from dualvp_torch.testing import run_ranks

    if world not in _SUITES:
        _SUITES[world] = run_ranks(rank_suite, world, timeout=300, env={"DUALVP_COMPILE": "0"})
    return _SUITES[world]
