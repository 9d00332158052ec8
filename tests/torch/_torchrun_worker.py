"""Rank checks against the float64 oracle over any process group; the worker of the torchrun test.

Importable helpers (also used by ``test_agreement.py`` on ``run_ranks`` gloo
ranks): :func:`make_problem` builds a seeded full-vocabulary problem (every
rank builds the same one from the same seed), :func:`logits_failures` /
:func:`linear_failures` run the logits op / the fused op on this rank's
vocab shard over ``group`` and list what differs from
:mod:`dualvp.reference` beyond :func:`dualvp.testing.metrics.tolerance`,
and :func:`outcome` turns a call into ``("ok", failures)`` or ``(exception
type, message)``.

Run as a script by ``torchrun`` (``tests/torch/test_torchrun.py``:
2 agents x 2 processes, c10d rendezvous on 127.0.0.1)::

    python -m torch.distributed.run ... tests/torch/_torchrun_worker.py OUT_DIR

it first runs ``dualvp verify`` (:data:`VERIFY_ARGS`, through the command's
:func:`dualvp.tools.cli.main`: the command joins the launcher's group and
destroys it), then joins a group of its own (gloo, a short process-group
timeout), runs :func:`torchrun_cases` and writes ``OUT_DIR/rank<R>.json``
(the cases' outcomes, verify's exit status and output); then it
writes ``OUT_DIR/pid<R>`` and calls the op in a loop (at most
:data:`LOOP_SECONDS`) until the test kills one worker: a survivor writes
``OUT_DIR/fault<R>.json`` (exception, wall-clock time) and exits 1.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from dualvp import reference
from dualvp.testing.metrics import tolerance, within_tolerance

TEMPERATURE = 0.7
IGNORE = -100
#: Process-group timeout of the torchrun workers: a peer that hangs (instead of dying) makes the
#: others raise after this long instead of torch's default 30 minutes.
PG_TIMEOUT_S = 20.0
#: The kill phase's loop of calls ends after this long if no worker was killed (bounded either way).
LOOP_SECONDS = 60.0


def make_problem(seed: int, rows: int, vocab: int, hidden: Optional[int] = None) -> dict:
    """A seeded problem over the full vocabulary, float32-exact values in float64 arrays.

    ``logits [T, V]`` (``randn * 3``), ``target [T]`` with every 7th row
    ``ignore_index``, ``keep_mask [T, V]`` (60 % kept), upstream gradients
    ``gl``, ``ge [T]``; with ``hidden``: ``hidden [T, H]`` and ``weight [V, H]``
    instead of logits (the logits are then ``hidden @ weight.T``).
    """
    rng = np.random.default_rng(seed)
    f32 = lambda a: a.astype(np.float32).astype(np.float64)  # noqa: E731
    p = dict(target=rng.integers(0, vocab, rows), keep_mask=rng.random((rows, vocab)) < 0.6,
             gl=rng.standard_normal(rows), ge=rng.standard_normal(rows))
    p["target"][::7] = IGNORE
    if hidden is None:
        p["logits"] = f32(rng.standard_normal((rows, vocab)) * 3)
    else:
        p["hidden"] = f32(rng.standard_normal((rows, hidden)))
        p["weight"] = f32(rng.standard_normal((vocab, hidden)) * 0.3)
    return p


def _t(a, dtype=None) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)


def _check(name: str, got: torch.Tensor, ref: np.ndarray, quantity: str, failures: list) -> None:
    x = got.detach().double().numpy()
    tol = tolerance("float32", quantity, ref)
    if not within_tolerance(x, ref, tol):
        err = float(np.max(np.abs(x - ref))) if x.shape == ref.shape else float("nan")
        failures.append(f"{name}: max abs error {err:.3e} vs the float64 oracle (tolerance {tol})")


def logits_failures(p: dict, group, *, shard: Optional[int] = None, width: Optional[int] = None,
                    target: Optional[torch.Tensor] = None, impl: str = "eager") -> list:
    """``logprob_entropy`` on this rank's vocab shard over ``group``, forward + backward; failures vs the oracle.

    ``shard``/``width``: this rank's shard index and the number of shards
    (default: its rank and size in ``group``). ``target``: what this rank
    passes instead of the problem's (a mistake under test; the oracle keeps the
    problem's).
    """
    from dualvp_torch import logprob_entropy

    r = dist.get_rank(group) if shard is None else shard
    w = dist.get_world_size(group) if width is None else width
    v = p["logits"].shape[-1] // w
    cols = slice(r * v, (r + 1) * v)
    z = _t(p["logits"][:, cols], torch.float32).requires_grad_(True)
    y = _t(p["target"]) if target is None else target
    lp, h = logprob_entropy(z, y, group=group, keep_mask=_t(p["keep_mask"][:, cols]), temperature=TEMPERATURE,
                            ignore_index=IGNORE, impl=impl)
    torch.autograd.backward([lp, h], [_t(p["gl"], torch.float32), _t(p["ge"], torch.float32)])
    kw = dict(keep_mask=p["keep_mask"], temperature=TEMPERATURE, ignore_index=IGNORE)
    ref_lp, ref_h = reference.logprob_entropy(p["logits"], p["target"], **kw)
    ref_g = reference.logprob_entropy_grad(p["logits"], p["target"], p["gl"], p["ge"], **kw)[:, cols]
    failures: list = []
    _check("logprob", lp, ref_lp, "logprob", failures)
    _check("entropy", h, ref_h, "entropy", failures)
    _check("grad", z.grad, ref_g, "grad", failures)
    return failures


def linear_failures(p: dict, group, *, sequence_parallel: bool = False, target: Optional[torch.Tensor] = None,
                    hidden: Optional[np.ndarray] = None) -> list:
    """``linear_logprob_entropy`` with this rank's weight rows over ``group``; failures vs the oracle.

    ``sequence_parallel``: this rank passes its ``T/W`` hidden rows (and gets
    its rows of ``dh``). ``target``/``hidden``: what this rank passes instead
    of the problem's (mistakes under test).
    """
    from dualvp_torch import linear_logprob_entropy

    r, w = dist.get_rank(group), dist.get_world_size(group)
    t = p["hidden"].shape[0]
    v = p["weight"].shape[0] // w
    rows = slice(r * (t // w), (r + 1) * (t // w)) if sequence_parallel else slice(None)
    hid = (p["hidden"] if hidden is None else hidden)[rows]
    h = _t(hid, torch.float32).requires_grad_(True)
    wt = _t(p["weight"][r * v:(r + 1) * v], torch.float32).requires_grad_(True)
    y = _t(p["target"]) if target is None else target
    lp, en = linear_logprob_entropy(h, wt, y, group=group, keep_mask=_t(p["keep_mask"][:, r * v:(r + 1) * v]),
                                    temperature=TEMPERATURE, ignore_index=IGNORE, impl="eager",
                                    sequence_parallel=sequence_parallel)
    torch.autograd.backward([lp, en], [_t(p["gl"], torch.float32), _t(p["ge"], torch.float32)])
    kw = dict(keep_mask=p["keep_mask"], temperature=TEMPERATURE, ignore_index=IGNORE)
    ref_lp, ref_h = reference.linear_logprob_entropy(p["hidden"], p["weight"], p["target"], **kw)
    ref_dh, ref_dw = reference.linear_logprob_entropy_grad(p["hidden"], p["weight"], p["target"], p["gl"], p["ge"],
                                                           **kw)
    failures: list = []
    _check("logprob", lp, ref_lp, "logprob", failures)
    _check("entropy", en, ref_h, "entropy", failures)
    _check("dh", h.grad, ref_dh[rows], "dh", failures)
    _check("dW", wt.grad, ref_dw[r * v:(r + 1) * v], "dW", failures)
    return failures


def outcome(fn: Callable[[], list]) -> tuple:
    """``("ok", failures)`` when ``fn()`` returns, else ``(exception type name, message)``."""
    try:
        return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return (type(exc).__name__, str(exc))


# --- the torchrun launch --------------------------------------------------------------------------

T, V_LOCAL, H = 32, 64, 16


def _dtensor_failures(seed: int) -> list:
    """DTensor logits ``[2T, V]`` on a ``(dp, tp) = (2, 2)`` mesh, ``[Shard(0), Shard(-1)]``; no ``group``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from dualvp_torch import logprob_entropy

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    p = make_problem(seed, 2 * T, 2 * V_LOCAL)
    pl, row = [Shard(0), Shard(-1)], [Shard(0), Replicate()]
    z = distribute_tensor(_t(p["logits"], torch.float32), mesh, pl).requires_grad_(True)
    lp, h = logprob_entropy(z, distribute_tensor(_t(p["target"]), mesh, row),
                            keep_mask=distribute_tensor(_t(p["keep_mask"]), mesh, pl), temperature=TEMPERATURE,
                            ignore_index=IGNORE, impl="eager")
    loss = (lp * distribute_tensor(_t(p["gl"], torch.float32), mesh, row)).sum() + \
        (h * distribute_tensor(_t(p["ge"], torch.float32), mesh, row)).sum()
    loss.full_tensor().backward()
    kw = dict(keep_mask=p["keep_mask"], temperature=TEMPERATURE, ignore_index=IGNORE)
    ref_lp, ref_h = reference.logprob_entropy(p["logits"], p["target"], **kw)
    ref_g = reference.logprob_entropy_grad(p["logits"], p["target"], p["gl"], p["ge"], **kw)
    failures: list = []
    _check("logprob", lp.full_tensor(), ref_lp, "logprob", failures)
    _check("entropy", h.full_tensor(), ref_h, "entropy", failures)
    _check("grad", z.grad.full_tensor(), ref_g, "grad", failures)
    return failures


def torchrun_cases(rank: int) -> dict:
    """Every case of the launch on this rank (4 ranks): name -> :func:`outcome`.

    Subgroups are built from global ranks, never from ``--node-rank`` (which
    c10d rendezvous ignores): an agent's workers hold contiguous global ranks,
    so ``[0, 1]`` and ``[2, 3]`` are "within a node". Every rank calls every
    ``new_group``, members or not, in the same order.
    """
    world = dist.group.WORLD
    new4 = dist.new_group([0, 1, 2, 3])
    within = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    across = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_in, dp_across = within[rank // 2], across[rank % 2]  # TP within a node x DP across nodes
    tp_across = across[rank % 2]  # TP across nodes x DP within a node
    dp_of_in, dp_of_across = rank // 2, rank % 2  # the DP index (replica) of each layout: TP within, across
    c: dict = {}
    p4 = make_problem(1, T, 4 * V_LOCAL)
    c["tp4_world"] = outcome(lambda: logits_failures(p4, world))
    c["tp4_new_group"] = outcome(lambda: logits_failures(p4, new4))
    c["tp2_within_dp2_across"] = outcome(lambda: logits_failures(make_problem(10 + dp_of_in, T, 2 * V_LOCAL), tp_in))
    c["tp2_across_dp2_within"] = outcome(
        lambda: logits_failures(make_problem(20 + dp_of_across, T, 2 * V_LOCAL), tp_across))
    c["dtensor_dp2_tp2"] = outcome(lambda: _dtensor_failures(3))
    lin4 = make_problem(4, T, 4 * V_LOCAL, H)
    c["fused_w4"] = outcome(lambda: linear_failures(lin4, world))
    c["fused_w2_sequence_parallel"] = outcome(
        lambda: linear_failures(make_problem(30 + dp_of_in, T, 2 * V_LOCAL, H), tp_in, sequence_parallel=True))
    c["fused_w2"] = outcome(lambda: linear_failures(make_problem(30 + dp_of_in, T, 2 * V_LOCAL, H), tp_in))
    # the mistakes: each must raise on every rank (a missed one desynchronises the next collectives)
    rolled = torch.roll(_t(p4["target"]), 1) if rank == 3 else None
    c["target_differs"] = outcome(lambda: logits_failures(p4, world, target=rolled))
    c["target_differs_fused"] = outcome(lambda: linear_failures(lin4, world, target=rolled))
    # the DP group passed for the TP group: each DP replica's data, sharded as if the group were TP
    c["dp_group_for_tp"] = outcome(lambda: logits_failures(make_problem(10 + dp_of_in, T, 2 * V_LOCAL), dp_across))
    c["dp_group_for_tp_fused"] = outcome(
        lambda: linear_failures(make_problem(30 + dp_of_in, T, 2 * V_LOCAL, H), dp_across))
    short = p4 if rank != 3 else {k: a[:-1] for k, a in p4.items()}  # one row fewer on rank 3
    c["rows_differ"] = outcome(lambda: logits_failures(short, world))
    c["after_mistakes"] = outcome(lambda: logits_failures(p4, world))
    return c


def _write_json(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def _verify() -> tuple:
    """``dualvp verify`` as this worker of the launch (its own process group, env://, destroyed when it
    returns): ``(exit status, what it printed)``."""
    import contextlib
    import io

    from dualvp.tools import cli

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(list(VERIFY_ARGS))
    return rc, buf.getvalue()


#: The arguments of the ``dualvp verify`` run that opens each worker.
VERIFY_ARGS = ("verify", "--tokens", "32", "--vocab", "256")


def main() -> None:
    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    info = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "AGENT_TAG")}
    verify_rc, verify_out = _verify()
    # The cases' group: its keys under a prefix of their own in the launcher's store, so that none of the
    # verify group's keys (env://, "default_pg", the same group name after its destroy) is read again.
    store, _, world = next(dist.rendezvous("env://"))
    dist.init_process_group("gloo", store=dist.PrefixStore("dualvp_cases", store), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    t0 = time.perf_counter()
    cases = torchrun_cases(rank)
    _write_json(os.path.join(out, f"rank{rank}.json"),
                dict(info, pid=os.getpid(), seconds=time.perf_counter() - t0, cases=cases, verify_rc=verify_rc,
                     verify_out=verify_out))
    # kill phase: loop over calls until the test kills a worker (the survivors raise) or LOOP_SECONDS pass
    p = make_problem(5, 8, 4 * V_LOCAL)
    _write_json(os.path.join(out, f"pid{rank}"), os.getpid())
    deadline = time.monotonic() + LOOP_SECONDS
    calls = 0
    try:
        while time.monotonic() < deadline:
            logits_failures(p, dist.group.WORLD)
            calls += 1
    except Exception as exc:
        _write_json(os.path.join(out, f"fault{rank}.json"),
                    dict(type=type(exc).__name__, message=str(exc)[:500], time=time.time(), calls=calls))
        raise
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
