"""DTensor logits (``torch.distributed.tensor``) on real gloo ranks, against the float64 oracle.

One spawn per world size: W = 2 on a 1-D ``("tp",)`` mesh and W = 4 on a
2-D ``(2, 2)`` mesh. Each rank builds the same full problem from a seed,
distributes it, runs every sub-check of :data:`_CHECKS_1D` / :data:`_CHECKS_2D`
and returns, per check, either ``None`` (passed), a failure description, or
(for the error checks) the exception it saw. The tests below read those
results: numbers against :mod:`dualvp.reference` within
:data:`dualvp.testing.TOLERANCES`, output and gradient placements, and that
every bad input raises the same error on every rank.
"""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.tensor")

from dualvp import reference  # noqa: E402
from dualvp.testing import cases  # noqa: E402

_ENV = {"DUALVP_COMPILE": "0"}  # compilation is tested elsewhere; keep the spawns fast


# --- helpers run inside the ranks -------------------------------------------


def _np(t):
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().to(torch.float64).numpy()


def _problem(shape, seed, dtype, mask):
    """Full logits / target / keep mask / upstream gradients, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    v = shape[-1]
    z = (3.0 * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
    y = torch.randint(0, v, shape[:-1], generator=g)
    keep = (torch.rand(shape, generator=g) < 0.4) if mask else None
    gl = torch.randn(shape[:-1], generator=g, dtype=torch.float64)
    gh = torch.randn(shape[:-1], generator=g, dtype=torch.float64)
    return z, y, keep, gl, gh


def _compare(name, dtype_name, got, ref, quantity, out):
    if not cases.within_tolerance(got, ref, cases.tolerance(dtype_name, quantity)):
        err = cases.max_errors(got, ref)
        out.append(f"{name}: {quantity} off the oracle by {err[0]:.3g} (abs), {err[1]:.3g} (rel)")


def _run_case(mesh, name, *, shape, placements, dtype=torch.float32, mask=False, temperature=1.0,
              local_companions=False, entropy_grad=True, dtensor_loss=False, seed=0):
    """Forward + backward of one DTensor call vs the oracle; returns a list of failures."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import dualvp_torch

    fails: list = []
    dtype_name = str(dtype).replace("torch.", "")
    z, y, keep, gl, gh = _problem(shape, seed, dtype, mask)
    ndim = len(shape)
    norm = tuple(Shard(p.dim % ndim) if isinstance(p, Shard) else p for p in placements)
    row_pl = tuple(Replicate() if (isinstance(p, Shard) and p.dim == ndim - 1) else p for p in norm)
    dz = distribute_tensor(z, mesh, placements).requires_grad_()
    dy = distribute_tensor(y, mesh, row_pl)
    dk = None if keep is None else distribute_tensor(keep, mesh, placements)
    if local_companions:  # this rank's rows as plain tensors
        dy = dy.to_local()
        dk = None if dk is None else dk.to_local()
    lp, h = dualvp_torch.logprob_entropy(dz, dy, keep_mask=dk, temperature=temperature, entropy_grad=entropy_grad)

    for out_name, t in (("logprob", lp), ("entropy", h)):
        if not isinstance(t, DTensor):
            fails.append(f"{name}: {out_name} is a {type(t).__name__}, expected a DTensor")
            return fails
        if tuple(t.placements) != row_pl or tuple(t.shape) != tuple(shape[:-1]):
            fails.append(f"{name}: {out_name} placements {t.placements} shape {tuple(t.shape)}, "
                         f"expected {row_pl} {tuple(shape[:-1])}")
    if h.requires_grad != entropy_grad:
        fails.append(f"{name}: entropy.requires_grad = {h.requires_grad}, expected {entropy_grad}")

    keep_np = None if keep is None else keep.numpy()
    ref_lp, ref_h = reference.logprob_entropy(_np(z), y.numpy(), keep_mask=keep_np, temperature=temperature)
    _compare(name, dtype_name, _np(lp), ref_lp, "logprob", fails)
    _compare(name, dtype_name, _np(h), ref_h, "entropy", fails)

    # Upstream gradients gl (and gh): either through plain tensors
    # (full_tensor) or through DTensor arithmetic with sharded weights, whose
    # backward redistributes the gradient to the outputs' placements.
    use_h = entropy_grad
    odt = lp.dtype  # upstream gradients in the outputs' dtype; the oracle gets the same numbers
    gl, gh = gl.to(odt), gh.to(odt)
    if dtensor_loss:
        wl = distribute_tensor(gl, mesh, row_pl)
        loss = (lp * wl).sum()
        if use_h:
            loss = loss + (h * distribute_tensor(gh, mesh, row_pl)).sum()
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
    else:
        loss = (lp.full_tensor() * gl).sum()
        if use_h:
            loss = loss + (h.full_tensor() * gh).sum()
    loss.backward()
    grad = dz.grad
    if not isinstance(grad, DTensor) or tuple(grad.placements) != norm:
        fails.append(f"{name}: logits gradient {type(grad).__name__} placements "
                     f"{getattr(grad, 'placements', None)}, expected a DTensor with {norm}")
        return fails
    if grad.to_local().shape != dz.to_local().shape:
        fails.append(f"{name}: local gradient shape {tuple(grad.to_local().shape)} != local logits "
                     f"{tuple(dz.to_local().shape)}")
    ref_g = reference.logprob_entropy_grad(_np(z), y.numpy(), _np(gl), _np(gh) if use_h else None,
                                           keep_mask=keep_np, temperature=temperature)
    _compare(name, dtype_name, _np(grad), ref_g, "grad", fails)
    return fails


def _run_ext_case(mesh, name, *, shape, placements, k=3, mask=False, local_companions=False, seed=0):
    """The extended options through DTensors: K targets ``[..., K]``, a temperature per row (a DTensor with the
    rows' placements, or plain local rows) and ``sum_p2``; forward + backward vs the oracle; a list of failures."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    import dualvp_torch

    fails: list = []
    z, _, keep, _, gh = _problem(shape, seed, torch.float32, mask)
    g = torch.Generator().manual_seed(seed + 100)
    v = shape[-1]
    y = torch.randint(0, v, shape[:-1] + (k,), generator=g)
    tau = (0.5 + torch.rand(shape[:-1], generator=g)).to(torch.float32)
    gl = torch.randn(shape[:-1] + (k,), generator=g, dtype=torch.float64).float()
    gs = torch.randn(shape[:-1], generator=g, dtype=torch.float64).float()
    gh = gh.float()
    ndim = len(shape)
    norm = tuple(Shard(p.dim % ndim) if isinstance(p, Shard) else p for p in placements)
    row_pl = tuple(Replicate() if (isinstance(p, Shard) and p.dim == ndim - 1) else p for p in norm)
    dz = distribute_tensor(z, mesh, placements).requires_grad_()
    dy, dtau = distribute_tensor(y, mesh, row_pl), distribute_tensor(tau, mesh, row_pl)
    dk = None if keep is None else distribute_tensor(keep, mesh, placements)
    if local_companions:
        dy, dtau, dk = dy.to_local(), dtau.to_local(), (None if dk is None else dk.to_local())
    lp, h, p2 = dualvp_torch.logprob_entropy(dz, dy, keep_mask=dk, temperature=dtau, multi_target=True,
                                             with_sum_p2=True)
    for out_name, t, want in (("logprob", lp, shape[:-1] + (k,)), ("entropy", h, shape[:-1]),
                              ("sum_p2", p2, shape[:-1])):
        if not isinstance(t, DTensor) or tuple(t.placements) != row_pl or tuple(t.shape) != tuple(want):
            fails.append(f"{name}: {out_name} {type(t).__name__} placements {getattr(t, 'placements', None)} "
                         f"shape {tuple(t.shape)}, expected a DTensor {row_pl} {tuple(want)}")
            return fails
    kw = dict(keep_mask=None if keep is None else keep.numpy(), temperature=_np(tau))
    ref_lp, ref_h = reference.logprob_entropy(_np(z), y.numpy(), **kw)
    _compare(name, "float32", _np(lp), ref_lp, "logprob", fails)
    _compare(name, "float32", _np(h), ref_h, "entropy", fails)
    _compare(name, "float32", _np(p2), reference.sum_squared_probs(_np(z), temperature=_np(tau)), "entropy", fails)
    ((lp.full_tensor() * gl).sum() + (h.full_tensor() * gh).sum() + (p2.full_tensor() * gs).sum()).backward()
    grad = dz.grad
    if not isinstance(grad, DTensor) or tuple(grad.placements) != norm:
        fails.append(f"{name}: logits gradient placements {getattr(grad, 'placements', None)}, expected {norm}")
        return fails
    ref_g = (reference.logprob_entropy_grad(_np(z), y.numpy(), _np(gl), _np(gh), **kw)
             + reference.sum_squared_probs_grad(_np(z), _np(gs), temperature=_np(tau)))
    _compare(name, "float32", _np(grad), ref_g, "grad", fails)
    return fails


def _raises(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects type and message
        return (type(exc).__name__, str(exc))
    return None


def _error_checks_1d(mesh, rank):
    """name -> (exception type, message) or None, for bad DTensor inputs on a 1-D mesh."""
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor, DTensor

    import dualvp_torch

    f = dualvp_torch.logprob_entropy
    z, y, keep, _, _ = _problem((4, 16), 1, torch.float32, True)
    dz = distribute_tensor(z, mesh, [Shard(-1)])
    dy = distribute_tensor(y, mesh, [Replicate()])
    out = {}
    z15 = torch.randn(4, 15)
    out["uneven_vocab"] = _raises(lambda: f(distribute_tensor(z15, mesh, [Shard(-1)]), dy))
    # Partial: every rank holds a summand of the logits.
    zp = DTensor.from_local(z / mesh.size(0), mesh, [Partial()], run_check=False)
    out["partial"] = _raises(lambda: f(zp, dy))
    out["target_sharded_on_vocab_dim"] = _raises(lambda: f(dz, distribute_tensor(y, mesh, [Shard(0)])))
    out["target_global_shape"] = _raises(lambda: f(dz, distribute_tensor(y[:3], mesh, [Replicate()])))
    out["keep_mask_replicated"] = _raises(lambda: f(dz, dy, keep_mask=distribute_tensor(keep, mesh, [Replicate()])))
    out["group_given"] = _raises(lambda: f(dz, dy, group=torch.distributed.group.WORLD))
    out["dtensor_target_plain_logits"] = _raises(lambda: f(dz.to_local(), dy))
    out["bad_temperature"] = _raises(lambda: f(dz, dy, temperature=0.0))
    leaf = distribute_tensor(z, mesh, [Shard(-1)]).requires_grad_()
    out["inplace_on_leaf"] = _raises(lambda: f(leaf, dy, inplace_grad=True))
    # A rank-private mistake (only rank 1's local target has the wrong shape)
    # must still make every rank raise, through the op's agreement step.
    y_local = dy.to_local() if rank == 0 else dy.to_local()[:3]
    out["one_rank_bad_local_target"] = _raises(lambda: f(dz, y_local))
    # Out-of-range global target on the DTensor path.
    out["target_out_of_range"] = _raises(lambda: f(dz, distribute_tensor(torch.full((4,), 16), mesh, [Replicate()])))
    # the extended options: a temperature DTensor sharded over the vocab mesh dim, K targets of the wrong shape
    out["temperature_sharded_on_vocab_dim"] = _raises(
        lambda: f(dz, dy, temperature=distribute_tensor(torch.ones(4), mesh, [Shard(0)])))
    out["multi_target_global_shape"] = _raises(
        lambda: f(dz, distribute_tensor(torch.zeros(3, 2, dtype=torch.long), mesh, [Replicate()]),
                  multi_target=True))
    return out


def _error_checks_2d(mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import dualvp_torch

    z, y, _, _, _ = _problem((4, 16), 2, torch.float32, False)
    dy = distribute_tensor(y, mesh, [Replicate(), Replicate()])
    out = {}
    dz2 = distribute_tensor(z, mesh, [Shard(-1), Shard(-1)])
    out["vocab_over_two_mesh_dims"] = _raises(lambda: dualvp_torch.logprob_entropy(dz2, dy))
    dz = distribute_tensor(z, mesh, [Shard(0), Shard(-1)])
    out["target_rows_not_sharded"] = _raises(lambda: dualvp_torch.logprob_entropy(dz, dy))
    return out


def _rank_1d(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    res = {}
    res["f64"] = _run_case(mesh, "f64", shape=(6, 32), placements=[Shard(-1)], dtype=torch.float64)
    res["f32_mask_temp_3d"] = _run_case(mesh, "f32_mask_temp_3d", shape=(2, 3, 32), placements=[Shard(2)],
                                        mask=True, temperature=0.7, seed=1)
    res["bf16_mask"] = _run_case(mesh, "bf16_mask", shape=(5, 64), placements=[Shard(-1)],
                                 dtype=torch.bfloat16, mask=True, seed=2)
    res["local_companions"] = _run_case(mesh, "local_companions", shape=(6, 32), placements=[Shard(-1)],
                                        mask=True, temperature=1.5, local_companions=True, seed=3)
    res["dtensor_loss_no_entropy_grad"] = _run_case(mesh, "dtensor_loss_no_entropy_grad", shape=(6, 32),
                                                    placements=[Shard(-1)], mask=True, entropy_grad=False,
                                                    dtensor_loss=True, seed=4)
    res["replicated_vocab"] = _run_case(mesh, "replicated_vocab", shape=(4, 16), placements=[Replicate()],
                                        mask=True, seed=5)
    res["rows_sharded_vocab_replicated"] = _run_case(mesh, "rows_sharded_vocab_replicated", shape=(6, 16),
                                                     placements=[Shard(0)], temperature=0.5, seed=6)
    res["ext_mask"] = _run_ext_case(mesh, "ext_mask", shape=(6, 32), placements=[Shard(-1)], mask=True, seed=7)
    res["ext_3d_local_companions"] = _run_ext_case(mesh, "ext_3d_local_companions", shape=(2, 3, 32),
                                                   placements=[Shard(2)], k=2, local_companions=True, seed=8)
    return {"cases": res, "errors": _error_checks_1d(mesh, rank)}


def _rank_2d(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    res = {}
    res["dp_tp"] = _run_case(mesh, "dp_tp", shape=(8, 32), placements=[Shard(0), Shard(-1)], dtype=torch.float64)
    res["dp_tp_mask_temp"] = _run_case(mesh, "dp_tp_mask_temp", shape=(8, 32), placements=[Shard(0), Shard(1)],
                                       mask=True, temperature=0.8, seed=1)
    # T = 7 rows over dp = 2: DTensor chunks them 4 + 3 (uneven rows are fine).
    res["uneven_rows_dtensor_loss"] = _run_case(mesh, "uneven_rows_dtensor_loss", shape=(7, 32),
                                                placements=[Shard(0), Shard(-1)], mask=True, dtensor_loss=True,
                                                seed=2)
    res["local_companions"] = _run_case(mesh, "local_companions", shape=(8, 32), placements=[Shard(0), Shard(-1)],
                                        mask=True, local_companions=True, seed=3)
    # Vocab on the *first* mesh dim: groups {0, 2} and {1, 3}.
    res["tp_dp"] = _run_case(mesh, "tp_dp", shape=(2, 4, 32), placements=[Shard(-1), Shard(1)], mask=True,
                             temperature=1.3, seed=4)
    res["rows_replicated"] = _run_case(mesh, "rows_replicated", shape=(5, 32), placements=[Replicate(), Shard(-1)],
                                       seed=5)
    res["ext_dp_tp_mask"] = _run_ext_case(mesh, "ext_dp_tp_mask", shape=(7, 32), placements=[Shard(0), Shard(-1)],
                                          mask=True, seed=6)
    return {"cases": res, "errors": _error_checks_2d(mesh)}


# --- the tests ----------------------------------------------------------------

pytestmark = pytest.mark.slow  # gloo ranks spawned


@functools.lru_cache(maxsize=None)
def _results(world):
    from dualvp_torch.testing import run_ranks

    fn = _rank_1d if world == 2 else _rank_2d
    return run_ranks(fn, world, timeout=240, env=_ENV)


@pytest.mark.parametrize("world", [2, 4])
def test_against_oracle_and_placements(world):
    res = _results(world)
    names = set(res[0]["cases"])
    assert len(names) >= 6
    failures = [f"rank {r}: {f}" for r, out in enumerate(res) for n in sorted(names) for f in out["cases"][n]]
    assert not failures, "\n".join(failures)


_EXPECTED_1D = {
    "uneven_vocab": ("ValueError", "logits:", ("(4, 15)", "V = 15", "[8, 7]")),
    "partial": ("ValueError", "logits:", ("Partial",)),
    "target_sharded_on_vocab_dim": ("ValueError", "target:", ("placements",)),
    "target_global_shape": ("ValueError", "target:", ("(4,)", "(3,)")),
    "keep_mask_replicated": ("ValueError", "keep_mask:", ("placements",)),
    "group_given": ("ValueError", "group:", ()),
    "dtensor_target_plain_logits": ("TypeError", "target:", ("DTensor",)),
    "bad_temperature": ("ValueError", "temperature", ()),
    "inplace_on_leaf": ("ValueError", "inplace_grad:", ("leaf",)),
    "target_out_of_range": ("ValueError", "target", ()),
    "temperature_sharded_on_vocab_dim": ("ValueError", "temperature:", ("placements",)),
    "multi_target_global_shape": ("ValueError", "target:", ("(4, 2)", "(3, 2)")),
}


def _check_errors(res, expected):
    for name, (etype, prefix, parts) in expected.items():
        seen = [r["errors"][name] for r in res]
        assert all(s is not None for s in seen), f"{name}: some rank did not raise: {seen}"
        assert len({s for s in seen}) == 1, f"{name}: ranks raised differently: {seen}"
        typ, msg = seen[0]
        assert typ == etype and msg.startswith(prefix), f"{name}: {typ}: {msg}"
        for part in parts:
            assert part in msg, f"{name}: {part!r} not in {msg!r}"


def test_errors_1d_identical_on_every_rank():
    res = _results(2)
    _check_errors(res, _EXPECTED_1D)
    # A mistake on one rank only: every rank raises the same RuntimeError
    # naming rank 1 and the target (no rank goes on into the all-gather).
    seen = [r["errors"]["one_rank_bad_local_target"] for r in res]
    assert all(s is not None for s in seen) and len(set(seen)) == 1, seen
    assert seen[0][0] == "RuntimeError" and "rank 1 (target)" in seen[0][1], seen


def test_errors_2d_identical_on_every_rank():
    _check_errors(
        _results(4),
        {
            "vocab_over_two_mesh_dims": ("ValueError", "logits:", ("2 mesh dims",)),
            "target_rows_not_sharded": ("ValueError", "target:", ("placements",)),
        },
    )
