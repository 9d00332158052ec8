"""The torch ops under activation checkpointing (``torch.utils.checkpoint``), as training stacks wrap their layers.

The checkpointed function (the LM head's matmul and the op, on plain or DTensor logits, or a drop-in of
``compat``; or the fused op) runs again in the backward;
its values and gradients must be bit for bit those of the same function without checkpointing, on one
process and on 2 gloo ranks, where the recomputation runs the op's collectives (the validation
agreement and the statistics' all-gather) again on every rank.
"""

import pytest

torch = pytest.importorskip("torch")

from torch.utils.checkpoint import checkpoint  # noqa: E402

from dualvp_torch import compat, linear_logprob_entropy, logprob_entropy  # noqa: E402
from dualvp_torch.testing import run_ranks  # noqa: E402

T, H, V_LOCAL = 12, 8, 40


def _inputs(rank: int, world: int):
    """Hidden states (shared), this rank's weight rows, global targets, this rank's keep columns, cotangents."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(T, H, generator=gen)
    w = torch.randn(world * V_LOCAL, H, generator=gen)
    y = torch.randint(0, world * V_LOCAL, (T,), generator=gen)
    keep = torch.rand(T, world * V_LOCAL, generator=gen) < 0.5
    gl, ge = torch.randn(T, generator=gen), torch.randn(T, generator=gen)
    cols = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
    return h, w[cols].contiguous(), y, keep[:, cols].contiguous(), gl, ge


def _step(op, ckpt, h0, w0, y, keep, gl, ge, group=None, impl="eager", inplace=False):
    """One forward + backward; ``(logprob, entropy, dh, dw, forward calls)``.

    ``group``: the process group, or for ``op="dtensor"`` the device mesh.
    """
    calls = []

    def head(h, w):
        calls.append(1)
        if op == "linear":
            return linear_logprob_entropy(h, w, y, group=group, keep_mask=keep, temperature=0.7, impl=impl)
        if op == "slime":  # slime's [T, 1] log-prob
            lp, ent = compat.calculate_log_probs_and_entropy(h @ w.T, y, group, with_entropy=True,
                                                             log_prob_keep_mask=keep)
            return lp[:, 0], ent
        if op == "dtensor":  # the local logits as a DTensor over a 1-D "tp" mesh (torch's own TP)
            from torch.distributed.tensor import DTensor, Shard

            mesh = group
            dz = DTensor.from_local(h @ w.T, mesh, [Shard(-1)])
            dk = DTensor.from_local(keep, mesh, [Shard(-1)])
            lp, ent = logprob_entropy(dz, y, keep_mask=dk, temperature=0.7, impl=impl)
            return lp.to_local(), ent.to_local()
        if op == "megatron":  # megatron-core's per-token loss, label-smoothed (no entropy: its loss twice)
            loss = compat.vocab_parallel_cross_entropy(h @ w.T, y, 0.1, tp_group=group)
            return loss, loss
        return logprob_entropy(h @ w.T, y, group=group, keep_mask=keep, temperature=0.7, inplace_grad=inplace,
                               impl=impl)

    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    if ckpt is None:
        lp, ent = head(h, w)
    else:
        lp, ent = checkpoint(head, h, w, use_reentrant=ckpt == "reentrant")
    ((gl * lp).sum() + (ge * ent).sum()).backward()
    return lp.detach(), ent.detach(), h.grad, w.grad, len(calls)


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a[:4], b[:4]))


@pytest.mark.parametrize("ckpt", ["non_reentrant", "reentrant"])
@pytest.mark.parametrize(
    "op, impl, inplace",
    [("logits", "eager", False), ("logits", "eager", True),
     pytest.param("logits", "compiled", False, marks=pytest.mark.slow),
     pytest.param("logits", "compiled", True, marks=pytest.mark.slow), ("linear", "eager", False),
     pytest.param("linear", "compiled", False, marks=pytest.mark.slow), ("slime", None, False),
     ("megatron", None, False)],
)
def test_under_activation_checkpointing(op, impl, inplace, ckpt, monkeypatch):
    if impl is None:  # the drop-ins take no impl: on their default (compiled) engine they would compile
        # here the op that ("logits", "compiled") holds under checkpointing in the slow tier
        monkeypatch.setenv("DUALVP_COMPILE", "0")
    args = _inputs(0, 1)
    plain = _step(op, None, *args, impl=impl, inplace=inplace)
    redone = _step(op, ckpt, *args, impl=impl, inplace=inplace)
    assert plain[4] == 1 and redone[4] == 2  # the checkpointed forward ran again in the backward
    assert _same(plain, redone)


RANK_OPS = ("logits", "linear", "slime", "megatron", "dtensor")


def _ranks_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    args = _inputs(rank, world_size)
    out = {}
    for op in RANK_OPS:
        if op == "dtensor":  # the DTensor op takes its group from the mesh
            group = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
        else:
            group = torch.distributed.group.WORLD
        plain = _step(op, None, *args, group=group)
        redone = _step(op, "non_reentrant", *args, group=group)
        out[op] = (plain[4], redone[4], _same(plain, redone))
    return out


@pytest.mark.slow
def test_under_activation_checkpointing_on_two_ranks():
    # the drop-ins on the eager engine, as at W = 1 above (on the compiled one each rank would compile
    # their kernels; the compiled engine's collectives at W = 2: tests/cross/test_cross_backends.py)
    for result in run_ranks(_ranks_body, 2, timeout=300, env={"DUALVP_COMPILE": "0"}):
        assert result == {op: (1, 2, True) for op in RANK_OPS}, result
