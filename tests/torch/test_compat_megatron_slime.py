"""The drop-ins of ``dualvp_torch.compat`` against the originals' documented semantics.

Each original's semantics is written out here independently (float64, dense,
full vocabulary) and never taken from the code under test:

* megatron-core ``vocab_parallel_cross_entropy(vocab_parallel_logits, target,
  label_smoothing=0.0, tp_group=None)``: the per-token cross-entropy against
  the target distribution with ``1 - a`` on the target and ``a / (V - 1)`` on
  every other id (``a = 0``: ``-log p_y``), float32 out; ``tp_group=None``
  is Megatron's tensor-parallel group.
* slime ``calculate_log_probs_and_entropy(logits, tokens, tp_group, ...)``:
  ``(log_prob [T, 1], entropy [T] or None)``, ``(0,)``-shaped results for an
  empty batch; the log-prob renormalised over the keep mask plus the target,
  the entropy unmasked; ``tp_group=None`` is the world group.

One 8-rank gloo job runs megatron-core's own function next to the compat
function under ``initialize_model_parallel(tensor_model_parallel_size=4,
pipeline_model_parallel_size=2)`` (and then TP = 1 for label smoothing).
"""

import inspect
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dualvp_torch import compat  # noqa: E402
from dualvp_torch.testing import run_ranks  # noqa: E402


def _megatron_core():
    """megatron-core's own function, or skip (megatron-core is optional)."""
    try:
        from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
    except Exception as exc:  # noqa: BLE001  (ImportError, or a broken install)
        pytest.skip(f"megatron-core not importable: {exc}")
    return vocab_parallel_cross_entropy


# ---------------------------------------------------------------- independent formulations


def _smoothed_ce(full: torch.Tensor, target: torch.Tensor, a: float) -> torch.Tensor:
    """``[...]`` cross-entropy of ``softmax(full [..., V])`` against ``(1 - a) on y, a / (V - 1) elsewhere``."""
    logp = torch.log_softmax(full, dim=-1)
    vocab = full.shape[-1]
    q = torch.full_like(logp, a / (vocab - 1) if vocab > 1 else 0.0)
    q.scatter_(-1, target[..., None], 1.0 - a)
    return -(q * logp).sum(-1)


def _slime_semantics(z: torch.Tensor, y: torch.Tensor, keep):
    """``(log_prob [T, 1], entropy [T])``: log-prob over ``keep`` plus the target, entropy of ``softmax(z)``."""
    logp = torch.log_softmax(z, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    if keep is not None:
        keep = keep.clone()
        keep[torch.arange(z.shape[0]), y] = True  # the target is always kept
        logp = torch.log_softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
    return logp.gather(-1, y[:, None]), entropy


def _close(a, b, rtol, atol):
    np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), rtol=rtol, atol=atol)


@pytest.fixture(autouse=True)
def _eager(monkeypatch):
    monkeypatch.setenv("DUALVP_COMPILE", "0")  # tiny shapes: compile time would dominate


# ---------------------------------------------------------------- Megatron, one process


def test_megatron_signature():
    params = inspect.signature(compat.vocab_parallel_cross_entropy).parameters
    assert [(p.name, p.default) for p in params.values()] == [
        ("vocab_parallel_logits", inspect.Parameter.empty),
        ("target", inspect.Parameter.empty),
        ("label_smoothing", 0.0),
        ("tp_group", None),
    ]
    try:
        from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy as original
    except Exception:  # noqa: BLE001
        return
    # the installed megatron-core's parameters are a prefix of ours (0.16 has no tp_group yet; main has)
    theirs = [(p.name, p.default) for p in inspect.signature(original).parameters.values()]
    ours = [(p.name, p.default) for p in params.values()]
    assert ours[: len(theirs)] == theirs


@pytest.mark.parametrize("a", [0.0, 0.1, 0.6])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_megatron_unsharded_against_semantics(a, dtype):
    g = torch.Generator().manual_seed(3)
    full = (torch.randn(4, 3, 50, generator=g, dtype=torch.float64) * 4).to(dtype)
    y = torch.randint(0, 50, (4, 3), generator=g)
    up = torch.randn(4, 3, generator=g, dtype=torch.float64)
    x = full.clone().requires_grad_(True)
    loss = compat.vocab_parallel_cross_entropy(x, y, a)
    assert loss.shape == (4, 3)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)  # Megatron: float32
    (loss * up.to(loss.dtype)).sum().backward()
    assert torch.equal(x.detach(), full)  # never modifies the input (Megatron's does)
    ref_in = full.double().requires_grad_(True)
    ref = _smoothed_ce(ref_in, y, a)
    (ref * up).sum().backward()
    tol = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-5}[dtype]  # vs the rounded inputs
    _close(loss.detach(), ref.detach(), tol, tol)
    gtol = {torch.float64: 1e-10, torch.float32: 1e-6, torch.bfloat16: 2e-2}[dtype]  # bf16 gradient storage
    _close(x.grad.double(), ref_in.grad, gtol, gtol)


def test_megatron_ignore_index_and_no_grad():
    g = torch.Generator().manual_seed(4)
    z = torch.randn(6, 10, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (6,), generator=g)
    y[2] = -100  # deliberate difference from Megatron: ignored (loss 0, no gradient), documented
    for a in (0.0, 0.2):
        x = z.clone().requires_grad_(True)
        loss = compat.vocab_parallel_cross_entropy(x, y, label_smoothing=a)
        loss.sum().backward()
        keep = y != -100
        ref = _smoothed_ce(z[keep], y[keep], a)
        _close(loss.detach()[keep], ref, 1e-10, 1e-10)
        assert loss[2].item() == 0.0 and torch.all(x.grad[2] == 0)
        with torch.no_grad():
            assert not compat.vocab_parallel_cross_entropy(z.clone().requires_grad_(True), y, a).requires_grad


def test_megatron_errors():
    z = torch.randn(3, 8)
    y = torch.randint(0, 8, (3,))
    for bad, exc in ((-0.1, ValueError), (1.0, ValueError), (float("nan"), ValueError), ("0.1", TypeError),
                     (True, TypeError), (object(), TypeError)):
        with pytest.raises(exc, match="^label_smoothing"):
            compat.vocab_parallel_cross_entropy(z, y, bad)
    with pytest.raises(TypeError, match="^tp_group"):
        compat.vocab_parallel_cross_entropy(z, y, 0.0, "world")
    with pytest.raises(ValueError, match="^target"):
        compat.vocab_parallel_cross_entropy(z, torch.tensor([0, 8, 1]))
    with pytest.raises((TypeError, ValueError), match="^vocab_parallel_logits"):
        compat.vocab_parallel_cross_entropy(z.numpy(), y)
    with pytest.raises(ValueError, match="^label_smoothing"):  # V = 1 has no "other" ids to smooth onto
        compat.vocab_parallel_cross_entropy(torch.randn(3, 1), torch.zeros(3, dtype=torch.int64), 0.1)


# ---------------------------------------------------------------- slime, one process


def test_slime_signature():
    params = inspect.signature(compat.calculate_log_probs_and_entropy).parameters
    assert [(p.name, p.default) for p in params.values()] == [
        ("logits", inspect.Parameter.empty),
        ("tokens", inspect.Parameter.empty),
        ("tp_group", inspect.Parameter.empty),
        ("with_entropy", False),
        ("chunk_size", -1),
        ("log_prob_keep_mask", None),
        ("with_entropy_grad", True),
    ]


@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("chunk_size", [-1, 1, 4, 100])
def test_slime_against_semantics(with_mask, chunk_size):
    g = torch.Generator().manual_seed(5)
    T, V = 7, 16
    z = torch.randn(T, V, generator=g, dtype=torch.float64) * 3
    y = torch.randint(0, V, (T,), generator=g)
    keep = (torch.rand(T, V, generator=g) < 0.4) if with_mask else None
    up_lp, up_h = torch.randn(T, 1, generator=g, dtype=torch.float64), torch.randn(T, generator=g, dtype=torch.float64)

    ref_in = z.clone().requires_grad_(True)
    rlp, rh = _slime_semantics(ref_in, y, keep)
    ((rlp * up_lp).sum() + (rh * up_h).sum()).backward()

    x = z.clone().requires_grad_(True)
    lp, h = compat.calculate_log_probs_and_entropy(
        x, y, None, with_entropy=True, chunk_size=chunk_size, log_prob_keep_mask=keep
    )
    assert lp.shape == (T, 1) and h.shape == (T,)
    ((lp * up_lp).sum() + (h * up_h).sum()).backward()
    _close(lp.detach(), rlp.detach(), 1e-10, 1e-10)
    _close(h.detach(), rh.detach(), 1e-10, 1e-10)
    _close(x.grad, ref_in.grad, 1e-9, 1e-12)

    # with_entropy=False: entropy None; with_entropy_grad=False: entropy without gradient
    lp2, h2 = compat.calculate_log_probs_and_entropy(z, y, None, chunk_size=chunk_size, log_prob_keep_mask=keep)
    assert lp2.shape == (T, 1) and h2 is None
    _close(lp2, rlp.detach(), 1e-10, 1e-10)
    x3 = z.clone().requires_grad_(True)
    lp3, h3 = compat.calculate_log_probs_and_entropy(x3, y, None, True, chunk_size, keep, False)
    assert lp3.requires_grad and not h3.requires_grad
    _close(h3, rh.detach(), 1e-10, 1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slime_dtypes(dtype):
    g = torch.Generator().manual_seed(6)
    z = torch.randn(5, 32, generator=g).to(dtype)
    y = torch.randint(0, 32, (5,), generator=g)
    lp, h = compat.calculate_log_probs_and_entropy(z, y, None, with_entropy=True)
    assert lp.dtype == h.dtype == torch.float32  # slime computes in float32 (logits.float())
    rlp, rh = _slime_semantics(z.double(), y, None)
    _close(lp, rlp, 1e-5, 1e-5)
    _close(h, rh, 1e-5, 1e-5)


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("chunk_size", [-1, 3])
@pytest.mark.parametrize("with_mask", [False, True])
def test_slime_empty_batch(with_entropy, chunk_size, with_mask):
    # slime's own T = 0 branch returns flat (0,) results, entropy only if asked for
    z = torch.randn(0, 16, requires_grad=True)
    keep = torch.ones(0, 16, dtype=torch.bool) if with_mask else None
    lp, h = compat.calculate_log_probs_and_entropy(
        z, torch.zeros(0, dtype=torch.int64), None, with_entropy, chunk_size, keep
    )
    assert lp.shape == (0,)
    if with_entropy:
        assert h.shape == (0,)
    else:
        assert h is None


def test_slime_errors():
    z = torch.randn(3, 8)
    y = torch.randint(0, 8, (3,))
    with pytest.raises(TypeError, match="^chunk_size"):
        compat.calculate_log_probs_and_entropy(z, y, None, chunk_size=2.5)
    with pytest.raises(TypeError, match="^tp_group"):
        compat.calculate_log_probs_and_entropy(z, y, 4)
    with pytest.raises(ValueError, match="^tokens"):
        compat.calculate_log_probs_and_entropy(z, torch.tensor([0, 9, 1]), None)
    with pytest.raises((TypeError, ValueError), match="^log_prob_keep_mask"):
        compat.calculate_log_probs_and_entropy(z, y, None, log_prob_keep_mask=torch.ones(3, 7, dtype=torch.bool))


# ---------------------------------------------------------------- 8 gloo ranks, TP = 4 x PP = 2


def _megatron_job(rank: int, world: int) -> dict:
    """Every rank: a bare call on the 8-rank world, then compat next to megatron-core at TP=4 x PP=2, then TP=1,
    then a label_smoothing that differs across the world group."""
    import sys

    preloaded = "megatron.core.tensor_parallel" in sys.modules  # forked with it (tests/conftest.py)
    os.environ["DUALVP_COMPILE"] = "0"
    import megatron.core.parallel_state as ps
    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy as mcore

    out = {"rank": rank}
    try:  # no group, no Megatron state, 8 ranks: must raise (not the world group)
        compat.vocab_parallel_cross_entropy(torch.randn(3, 2, 4), torch.randint(0, 4, (3, 2)))
        out["bare"] = None
    except Exception as exc:  # noqa: BLE001
        out["bare"] = (type(exc).__name__, str(exc))

    ps.initialize_model_parallel(tensor_model_parallel_size=4, pipeline_model_parallel_size=2)
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group()
    out.update(tp_rank=tp_rank, tp=tp, pp_rank=ps.get_pipeline_model_parallel_rank())
    # each TP group its own data (computing on the wrong group could not match by chance)
    g = torch.Generator().manual_seed(100 + out["pp_rank"])
    S, B, VL = 5, 3, 6
    full = torch.randn(S, B, tp * VL, generator=g) * 3
    y = torch.randint(0, tp * VL, (S, B), generator=g)
    up = torch.randn(S, B, generator=g)
    shard = full[..., tp_rank * VL : (tp_rank + 1) * VL].contiguous()
    out.update(full=full, y=y, up=up)

    def loss_and_grad(fn):
        x = shard.clone().requires_grad_(True)  # fresh: megatron-core overwrites its input
        loss = fn(x)
        (loss * up).sum().backward()
        return loss.detach(), x.grad

    for a in (0.0, 0.1):
        out[f"mcore_{a}"] = loss_and_grad(lambda x, a=a: mcore(x, y, a))
        out[f"none_{a}"] = loss_and_grad(lambda x, a=a: compat.vocab_parallel_cross_entropy(x, y, a))
        out[f"explicit_{a}"] = loss_and_grad(
            lambda x, a=a: compat.vocab_parallel_cross_entropy(x, y, label_smoothing=a, tp_group=group)
        )
    # megatron-core's unit-test input (tests/unit_tests/tensor_parallel/test_cross_entropy.py), tp_group=None
    ut_logits = torch.arange(0, 8, dtype=torch.float32).repeat(16, 4)
    ut_target = torch.arange(0, 32, 2)
    out["ut_compat"] = compat.vocab_parallel_cross_entropy(ut_logits, ut_target)
    out["ut_mcore"] = mcore(ut_logits.clone(), ut_target)
    # slime's None is the world group (all 8 ranks) even with Megatron's state set up
    gs = torch.Generator().manual_seed(7)  # the same on every rank
    zs, ys = torch.randn(6, 8 * 4, generator=gs, dtype=torch.float64), torch.randint(0, 32, (6,), generator=gs)
    out["slime_in"] = (zs, ys)
    out["slime"] = compat.calculate_log_probs_and_entropy(zs[:, rank * 4 : (rank + 1) * 4], ys, None, with_entropy=True)
    ps.destroy_model_parallel()

    # TP = 1 (x PP = 8): megatron-core's label smoothing is right there, compare directly
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=8)
    torch.manual_seed(200 + rank)
    z1 = torch.randn(4, 2, 40) * 3
    y1 = torch.randint(0, 40, (4, 2))
    out["tp1"] = [
        (mcore(z1.clone(), y1, a), compat.vocab_parallel_cross_entropy(z1, y1, a)) for a in (0.0, 0.1, 0.5)
    ]
    ps.destroy_model_parallel()
    out["preloaded"] = preloaded
    out["smoothing"] = _smoothing_disagreement(rank, world)
    return out


_JOB: dict = {}


def _job():
    if "res" not in _JOB:
        _megatron_core()  # skip if megatron-core is missing
        _JOB["res"] = run_ranks(_megatron_job, 8, timeout=400)
    return _JOB["res"]


@pytest.mark.slow
def test_megatron_ranks_fork_with_megatron_imported():
    # tests/conftest.py names megatron-core in DUALVP_FORKSERVER_PRELOAD: the ranks' forkserver
    # imports it once, and every rank starts with it (instead of importing it in each rank)
    from dualvp_torch import testing

    res = _job()  # skips where megatron-core is missing
    assert "megatron.core.tensor_parallel" in testing._preload()
    assert [r["preloaded"] for r in res] == [True] * 8


@pytest.mark.slow
def test_megatron_bare_call_raises_on_every_rank():
    for r in _job():
        assert r["bare"] is not None, f"rank {r['rank']}: a bare call on an 8-rank world computed a loss"
        kind, msg = r["bare"]
        assert kind == "ValueError" and msg.startswith("tp_group"), r["bare"]


@pytest.mark.slow
@pytest.mark.parametrize("a", [0.0, 0.1])
def test_megatron_tp4_pp2_against_megatron_core_and_semantics(a):
    res = _job()
    assert sorted((r["pp_rank"], r["tp_rank"]) for r in res) == [(p, t) for p in range(2) for t in range(4)]
    for r in res:
        lo, hi = r["tp_rank"] * 6, (r["tp_rank"] + 1) * 6
        ref_in = r["full"].double().requires_grad_(True)
        ref = _smoothed_ce(ref_in, r["y"], a)
        (ref * r["up"].double()).sum().backward()
        l_none, g_none = r[f"none_{a}"]
        l_expl, g_expl = r[f"explicit_{a}"]
        assert torch.equal(l_none, l_expl) and torch.equal(g_none, g_expl)  # None is Megatron's TP group
        _close(l_none, ref.detach(), 1e-5, 1e-5)
        _close(g_none, ref_in.grad[..., lo:hi], 1e-5, 1e-6)
        if a == 0.0:  # megatron-core itself (its smoothing uses the local shard at TP > 1: not compared)
            l_m, g_m = r["mcore_0.0"]
            _close(l_none, l_m, 1e-6, 1e-6)
            _close(g_none, g_m, 1e-6, 1e-7)


@pytest.mark.slow
def test_megatron_unit_test_input_and_tp1_smoothing():
    for r in _job():
        _close(r["ut_compat"], r["ut_mcore"], 1e-6, 1e-6)
        for l_m, l_c in r["tp1"]:
            _close(l_c, l_m, 1e-5, 1e-5)


@pytest.mark.slow
def test_slime_none_is_world_group_under_megatron():
    for r in _job():
        zs, ys = r["slime_in"]
        rlp, rh = _slime_semantics(zs, ys, None)
        lp, h = r["slime"]
        assert lp.shape == (6, 1) and h.shape == (6,)
        _close(lp, rlp, 1e-10, 1e-10)
        _close(h, rh, 1e-10, 1e-10)


def _smoothing_disagreement(rank: int, world: int) -> dict:
    """On the world group (run at the end of :func:`_megatron_job`, one spawn for both)."""
    import torch.distributed as dist

    group = dist.group.WORLD
    torch.manual_seed(3)
    x = torch.randn(4, 5, requires_grad=True)
    y = torch.randint(0, 5 * world, (4,))
    out = {}
    # label_smoothing differs (only a > 0 enters the extra all-reduce), then is invalid on rank 1 only
    for name, a in (("differs", 0.1 * rank), ("invalid", 1.5 if rank == 1 else 0.1)):
        try:
            compat.vocab_parallel_cross_entropy(x, y, label_smoothing=a, tp_group=group)
            out[name] = None
        except Exception as exc:  # noqa: BLE001
            out[name] = (type(exc).__name__, str(exc))
    out["after"] = compat.vocab_parallel_cross_entropy(x, y, label_smoothing=0.1, tp_group=group).detach()
    return out


@pytest.mark.slow
def test_megatron_label_smoothing_disagreement_raises_on_every_rank():
    res = [r["smoothing"] for r in _job()]
    assert len(res) == 8
    for r in res:
        kind, msg = r["differs"]
        assert kind == "RuntimeError" and "label_smoothing" in msg, r["differs"]
    for r in res:  # the same error on both ranks, naming rank 1's argument
        kind, msg = r["invalid"]
        assert kind == "RuntimeError" and "rank 1 (label_smoothing)" in msg, r["invalid"]
    assert all(torch.isfinite(r["after"]).all() for r in res)  # the group is still usable
