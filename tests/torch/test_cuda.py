"""dualvp_torch on a CUDA device (skipped without one): the shared cases against the float64 oracle.

Run by ``scripts/gpu-check.sh`` on a GPU machine; CI has no GPU and skips
this module. The cases also run over a one-rank NCCL group (any GPU machine)
and over 2-4 NCCL ranks where that many GPUs exist.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from dualvp import reference  # noqa: E402
from dualvp.testing import cases, metrics  # noqa: E402
from dualvp_torch import logprob_entropy  # noqa: E402

pytestmark = pytest.mark.cuda

_DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _np(t):
    return t.detach().double().cpu().numpy()


def _check(case, impl="compiled", inplace=False, rank=0, world=1, group=None, device="cuda") -> list:
    """Failures of one case on this rank's shard (``[]`` when within the shared tolerances)."""
    P = cases.make(case)
    zs, ks = P.shard(rank, world)
    leaf = torch.tensor(zs, device=device).to(_DT[case.dtype]).requires_grad_(True)
    y = torch.tensor(P.target, device=device)
    keep = None if ks is None else torch.tensor(ks, device=device)
    z = leaf * 1 if inplace else leaf
    lp, h = logprob_entropy(z, y, group=group, keep_mask=keep, temperature=case.temperature,
                            ignore_index=case.ignore_index, inplace_grad=inplace, impl=impl)
    gl = torch.tensor(P.grad_logprob, device=device, dtype=lp.dtype)
    ge = torch.tensor(P.grad_entropy, device=device, dtype=lp.dtype)
    ((lp * gl).sum() + (h * ge).sum()).backward()
    kw = dict(keep_mask=P.keep_mask, temperature=case.temperature, ignore_index=case.ignore_index)
    rl, rh = reference.logprob_entropy(P.logits, P.target, **kw)
    rg = reference.logprob_entropy_grad(P.logits, P.target, P.grad_logprob, P.grad_entropy, **kw)
    v = zs.shape[-1]
    rg = rg[..., rank * v : (rank + 1) * v]
    out = []
    for name, got, ref in (("logprob", lp, rl), ("entropy", h, rh), ("grad", leaf.grad, rg)):
        if not metrics.within_tolerance(_np(got), ref, metrics.tolerance(case.dtype, name)):
            out.append(f"{case.name} W={world} rank={rank} {impl} inplace={inplace} {name}: "
                       f"{metrics.max_errors(_np(got), ref)}")
    return out


@pytest.mark.parametrize("impl", ["compiled", "eager"])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("case", [c for c in cases.CASES if 1 in c.worlds], ids=lambda c: c.name)
def test_case_on_cuda(case, impl, inplace):
    assert not _check(case, impl, inplace)


def _nccl_job(rank: int, world: int) -> list:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    failures = []
    for case in cases.CASES:
        if world in case.worlds:
            failures += _check(case, rank=rank, world=world, group=dist.group.WORLD, device=f"cuda:{rank}")
    return failures


def test_cases_over_nccl_one_rank():
    # A one-rank NCCL group still runs every collective of the op (the statistics' and the
    # agreement record's all-gathers, on CUDA tensors): the NCCL path on a one-GPU machine.
    from dualvp_torch.testing import run_ranks

    failures = sum(run_ranks(_nccl_job, 1, backend="nccl", timeout=300), [])
    assert not failures, "\n".join(failures[:30])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_cases_over_nccl():
    from dualvp_torch.testing import run_ranks

    world = 4 if torch.cuda.device_count() >= 4 else 2
    failures = sum(run_ranks(_nccl_job, world, backend="nccl", timeout=600), [])
    assert not failures, "\n".join(failures[:30])


def test_no_host_sync_without_validation():
    # validate=False must not synchronise: the call returns while a long kernel still runs
    z = torch.randn(4096, 32000, device="cuda", requires_grad=True)
    y = torch.randint(0, 32000, (4096,), device="cuda")
    logprob_entropy(z, y, validate=False)  # warm-up / compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lp, h = logprob_entropy(z, y, validate=False)
        (lp.sum() + h.sum()).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert np.isfinite(_np(lp)).all()
