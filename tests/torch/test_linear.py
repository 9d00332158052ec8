"""The fused LM-head op ``dualvp_torch.linear_logprob_entropy`` against the float64 oracle.

Single process (``group=None``) for the options, dtypes, shapes, tiles, frozen
inputs, bad inputs, the non-finite policy and memory; real gloo ranks (W = 2,
4; one spawn each, see ``_linear_ranks.py``) for the reduction of ``dh``
(``reduce_hidden_grad`` both ways), sequence parallelism and the cross-rank
agreement.
"""

import functools
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.profiler import ProfilerActivity, profile  # noqa: E402

from . import _linear_ranks  # noqa: E402
from ._alloc import allocations, peak as peak_of  # noqa: E402
from dualvp import reference  # noqa: E402
from dualvp.testing.cases import round_to_dtype  # noqa: E402
from dualvp.testing.metrics import max_errors, tolerance, within_tolerance  # noqa: E402
from dualvp_torch import engines, linear_logprob_entropy  # noqa: E402
from dualvp_torch import linear as linear_mod  # noqa: E402
from dualvp_torch.linear_tiles import MAX_COLS, MIN_COLUMN_BUDGET, MIN_SIDE, column_budget, default_budget, tile_shape  # noqa: E402
from dualvp_torch.testing import run_ranks  # noqa: E402

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _problem(lead, H, V, dtype, *, seed=0, mask=False, ignore=True, scale=0.7):
    """Tensors in ``dtype`` and the float64 values the oracle sees (the same rounded numbers)."""
    rng = np.random.default_rng(seed)
    h = round_to_dtype(rng.normal(size=lead + (H,)), dtype)
    w = round_to_dtype(rng.normal(size=(V, H)) * scale, dtype)
    y = rng.integers(0, V, size=lead)
    if ignore and y.size > 2:
        y.reshape(-1)[[1, -1]] = -100
    keep = rng.random(lead + (V,)) < 0.5 if mask else None
    gl = round_to_dtype(rng.normal(size=lead), "float32")
    ge = round_to_dtype(rng.normal(size=lead), "float32")
    return dict(h=h, w=w, y=y, keep=keep, gl=gl, ge=ge, dtype=dtype)


def _torch_args(p, hidden_grad=True, weight_grad=True):
    dt = DT[p["dtype"]]
    h = torch.tensor(p["h"]).to(dt).requires_grad_(hidden_grad)
    w = torch.tensor(p["w"]).to(dt).requires_grad_(weight_grad)
    keep = None if p["keep"] is None else torch.tensor(p["keep"])
    return h, w, torch.tensor(p["y"]), keep


def _run(p, *, hidden_grad=True, weight_grad=True, with_entropy=True, entropy_grad=True, **kw):
    h, w, y, keep = _torch_args(p, hidden_grad, weight_grad)
    lp, en = linear_logprob_entropy(h, w, y, keep_mask=keep, with_entropy=with_entropy, entropy_grad=entropy_grad, **kw)
    loss = (lp * torch.tensor(p["gl"], dtype=lp.dtype)).sum()
    if en is not None and en.requires_grad:
        loss = loss + (en * torch.tensor(p["ge"], dtype=en.dtype)).sum()
    if loss.requires_grad:
        loss.backward()
    return lp, en, h.grad, w.grad


def _oracle(p, *, entropy_grad=True, **kw):
    lp, en = reference.linear_logprob_entropy(p["h"], p["w"], p["y"], keep_mask=p["keep"], **kw)
    dh, dw = reference.linear_logprob_entropy_grad(
        p["h"], p["w"], p["y"], p["gl"], p["ge"] if entropy_grad else None, keep_mask=p["keep"], **kw
    )
    return lp, en, dh, dw


def _grad_tol(dtype, ref):
    # the shared rule for dh / dW (dualvp.testing.metrics.tolerance)
    return tolerance(dtype, "dh", ref)


def _assert_close(got, ref, dtype, what):
    x = got.detach().double().numpy()
    if what in ("dh", "dW"):
        tol = _grad_tol(dtype, ref)
    else:
        tol = tolerance(dtype, what)
    assert within_tolerance(x, ref, tol), f"{what}: max errors {max_errors(x, ref)} > {tol}"


def _assert_all(out, ref, dtype, *, entropy=True, dh=True, dw=True):
    lp, en, gh, gw = out
    _assert_close(lp, ref[0], dtype, "logprob")
    if entropy:
        _assert_close(en, ref[1], dtype, "entropy")
    if dh:
        assert gh is not None and gh.dtype == DT[dtype]
        _assert_close(gh, ref[2], dtype, "dh")
    if dw:
        assert gw is not None and gw.dtype == DT[dtype]
        _assert_close(gw, ref[3], dtype, "dW")


def _budget(elements, impl):
    """memory_budget (bytes) for tiles of ``elements`` elements on ``impl``."""
    if elements is None:
        return None
    return elements * (4 + (engines.BLOCK_SCRATCH_BYTES if impl == "eager" else 0))


SHAPES = {
    # name: (lead, H, V_local, tile elements): V_local = 1001 divides no tile;
    # T = 37 divides no token chunk; the small tiles force many of them.
    "v1001_tiles": ((37,), 16, 1001, 8 * 130),  # 5 token chunks (8 rows, last 5) x 8 vocab blocks (last 91)
    "v1001_one_tile": ((37,), 16, 1001, None),
    "batch_dims": ((3, 5), 8, 64, 3 * 20),
    "token_major": ((300,), 8, 50, 1000),  # T > V_local: token chunks outside
}


def _eager_params():
    # float32: every shape, masked and not. bfloat16 in the fast tier: token_major masked and batch_dims
    # unmasked; its other shapes (slow) take the same tile code, and a masked many-tile vocab-major bfloat16
    # run is test_bfloat16_is_exact_up_to_the_final_rounding's (a tighter bound on dh and dW)
    fast_bf16 = {("token_major", True), ("batch_dims", False)}
    return [pytest.param(mask, dtype, shape, id=f"{'mask' if mask else 'nomask'}-{dtype}-{shape}",
                         marks=[pytest.mark.slow] if dtype == "bfloat16" and (shape, mask) not in fast_bf16 else [])
            for shape in SHAPES for dtype in ("float32", "bfloat16") for mask in (False, True)]


@pytest.mark.parametrize("mask,dtype,shape", _eager_params())
def test_vs_oracle_eager(shape, dtype, mask):
    lead, H, V, budget = SHAPES[shape]
    p = _problem(lead, H, V, dtype, mask=mask)
    kw = dict(temperature=0.7)
    out = _run(p, memory_budget=_budget(budget, "eager"), impl="eager", **kw)
    assert out[0].dtype == torch.float32 and out[0].shape == lead
    _assert_all(out, _oracle(p, **kw), dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,mask", [("float32", True), ("bfloat16", False)])
def test_vs_oracle_compiled(dtype, mask):
    p = _problem((37,), 16, 1001, dtype, mask=mask, seed=1)
    kw = dict(temperature=1.3)
    out = _run(p, memory_budget=_budget(8 * 130, "compiled"), impl="compiled", **kw)
    _assert_all(out, _oracle(p, **kw), dtype)


def test_float64():
    p = _problem((9,), 8, 70, "float64", mask=True)
    out = _run(p, memory_budget=_budget(3 * 16, "eager"), impl="eager", temperature=0.9)
    assert out[0].dtype == torch.float64
    _assert_all(out, _oracle(p, temperature=0.9), "float64")


def test_bfloat16_is_exact_up_to_the_final_rounding():
    # No bfloat16 accumulation anywhere: each gradient entry is the float64
    # oracle rounded once to bfloat16, up to float32 round-off (far below a
    # bfloat16 ulp, so at most a rounding tie flips: allow one ulp), not
    # the drift of several ulps that bfloat16 partial sums over 10 vocab
    # blocks or 5 token chunks would give.
    p = _problem((40,), 32, 600, "bfloat16", mask=True, seed=3)
    lp, en, gh, gw = _run(p, memory_budget=_budget(8 * 64, "eager"), impl="eager", temperature=0.8)
    ref = _oracle(p, temperature=0.8)
    for got, r in ((gh, ref[2]), (gw, ref[3])):
        x = got.double().numpy()
        ulp = np.spacing(np.abs(r).astype(np.float32)).astype(np.float64) * 2.0**16  # bfloat16: 16 fewer bits
        slack = 1e-6 * np.abs(r).max()  # float32 round-off of the sums, absolute
        assert np.all(np.abs(x - r) <= ulp + slack), np.max((np.abs(x - r) - slack) / ulp)


def test_ignore_index_and_entropy_options():
    p = _problem((20,), 8, 90, "float32", mask=True, ignore=False)
    p["y"][[0, 5, 6]] = -1
    ref = _oracle(p, ignore_index=-1, entropy_grad=False)
    out = _run(p, ignore_index=-1, entropy_grad=False, impl="eager", memory_budget=_budget(20 * 16, "eager"))
    assert not out[1].requires_grad
    _assert_all(out, ref, "float32")
    assert np.all(out[0].detach().numpy()[[0, 5, 6]] == 0)
    lp, en, gh, gw = _run(p, ignore_index=-1, with_entropy=False, impl="eager")
    assert en is None
    _assert_all((lp, en, gh, gw), ref, "float32", entropy=False)


def _count(op_name, fn):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == op_name)


@pytest.mark.slow
@pytest.mark.parametrize("frozen", ["hidden", "weight"])
def test_frozen_input_skips_its_matmul(frozen):
    p = _problem((16,), 8, 100, "float32")
    budget = _budget(16 * 25 * 8, "eager")  # 4 tiles of 16 x 25 (16 * 25 gave 34 of 16 x 3: a long profile)
    ref = _oracle(p)
    kw = dict(hidden_grad=frozen != "hidden", weight_grad=frozen != "weight", impl="eager", memory_budget=budget)
    out = _run(p, **kw)
    _assert_all(out, ref, "float32", dh=frozen != "hidden", dw=frozen != "weight")
    assert (out[2] is None) == (frozen == "hidden") and (out[3] is None) == (frozen == "weight")
    products = lambda fn: _count("aten::mm", fn) + _count("aten::addmm_", fn)  # noqa: E731
    both = products(lambda: _run(p, impl="eager", memory_budget=budget))
    one = products(lambda: _run(p, **kw))
    r, c = tile_shape(16, 100, budget, 4 + engines.BLOCK_SCRATCH_BYTES)
    n_tiles = -(-16 // r) * -(-100 // c)
    assert n_tiles >= 4
    # per tile: the forward block, its recomputation, and one product per trainable input
    assert both == 4 * n_tiles and one == 3 * n_tiles


@pytest.mark.parametrize("shape", ["v1001_tiles", pytest.param("token_major", marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_cpu_tiles_share_one_buffer_per_pass(monkeypatch, shape, dtype):
    # Every CPU tile of a pass is formed in one buffer (dualvp_torch.linear.TileBuffer): a fresh
    # tile per step faults in all its pages again. Ragged last tiles included; values: the oracle's.
    lead, H, V, elements = SHAPES[shape]
    p = _problem(lead, H, V, dtype)
    seen = []
    block = linear_mod._logits_block

    def recorded(*args, **kw):
        z = block(*args, **kw)
        seen.append((z.untyped_storage().data_ptr(), tuple(z.shape), z.is_contiguous()))
        return z

    monkeypatch.setattr(linear_mod, "_logits_block", recorded)
    budget = _budget(elements, "compiled")
    r, c = tile_shape(math.prod(lead), V, budget, 4)
    n_tiles = -(-math.prod(lead) // r) * -(-V // c)
    out = _run(p, impl="compiled", memory_budget=budget)
    _assert_all(out, _oracle(p), dtype)
    assert n_tiles >= 5 and len(seen) == 2 * n_tiles  # each tile formed in the forward and again in the backward
    for part in (seen[:n_tiles], seen[n_tiles:]):
        assert len({ptr for ptr, _, _ in part}) == 1
        assert all(contig for _, _, contig in part)
        assert len({shp for _, shp, _ in part}) > 1  # a ragged tile took a smaller view of the same buffer


def test_nonfinite_row_by_row():
    # A NaN in one hidden row: that row's log-prob, entropy and dh are NaN,
    # every other row matches the oracle; dW sums over the rows and is NaN
    # where that row reaches it (everywhere), as in the oracle.
    p = _problem((10,), 8, 80, "float32", mask=True)
    p["h"][4, 3] = np.nan
    out = _run(p, impl="eager", memory_budget=_budget(10 * 16, "eager"))
    with np.errstate(invalid="ignore"):  # the oracle's NaN row
        ref = _oracle(p)
    lp, en, gh, gw = (t.detach().double().numpy() for t in out)
    for got, r in ((lp, ref[0]), (en, ref[1])):
        assert np.isnan(got[4]) and np.isnan(r[4])
        assert within_tolerance(np.delete(got, 4), np.delete(r, 4), tolerance("float32", "logprob"))
    assert np.all(np.isnan(gh[4])) and not np.isnan(np.delete(gh, 4, axis=0)).any()
    assert within_tolerance(np.delete(gh, 4, axis=0), np.delete(ref[2], 4, axis=0), _grad_tol("float32", ref[2][:4]))
    assert np.isnan(gw).all() and np.isnan(ref[3]).all()


def test_tile_shape_respects_the_budget():
    for n, v, budget, e in [(37, 1001, 3200, 4), (300, 50, 1680, 4), (5, 7, 1, 4), (2048, 32000, 16 << 20, 4),
                            (40, 100000, 1 << 20, 48)]:
        r, c = tile_shape(n, v, budget, e)
        assert 1 <= r <= n and 1 <= c <= min(v, MAX_COLS)
        assert r * c * e <= max(budget, e)
        # batch invariance: the columns never follow the row count
        assert all(tile_shape(m, v, budget, e)[1] == c for m in (1, 7, 64, 1000, 100000))
        assert c in (1, min(v, MAX_COLS)) or c * MIN_SIDE * e <= budget  # the columns of MIN_SIDE rows
        if n * c * e <= budget:
            assert r == n  # the rows fill the budget
    # the op's default: columns from the column budget (V_local alone), rows from the tile budget
    cb = column_budget(32000, 2)
    cols = {tile_shape(n, 32000, default_budget(n, 32000, 2), 4, cb)[1] for n in (1, 8, 100, 4096, 100000)}
    assert len(cols) == 1, cols
    # the eager engine's (tiles with 44 B of scratch per element): at least MIN_COLUMN_BUDGET, from V_local alone
    cb = column_budget(32000, 4, scratch=True)
    assert cb >= MIN_COLUMN_BUDGET > column_budget(32000, 4)
    cols = {tile_shape(n, 32000, default_budget(n, 32000, 4), 48, cb)[1] for n in (1, 8, 100, 4096, 100000)}
    assert len(cols) == 1 and cols.pop() * MIN_SIDE * 48 <= cb, cols


# --- bad inputs (single process) ----------------------------------------------


def _bad_base():
    return dict(hidden=torch.randn(4, 6), weight=torch.randn(10, 6), target=torch.tensor([0, 3, 9, -100]))


BAD = {
    "hidden_not_tensor": (dict(hidden=[[1.0] * 6] * 4), TypeError, "hidden"),
    "hidden_int": (dict(hidden=torch.ones(4, 6, dtype=torch.int64)), TypeError, "hidden"),
    "weight_dtype": (dict(weight=torch.randn(10, 6, dtype=torch.float64)), TypeError, "weight"),
    "h_mismatch": (dict(weight=torch.randn(10, 5)), ValueError, "weight"),
    "weight_1d": (dict(weight=torch.randn(10)), ValueError, "weight"),
    "target_shape": (dict(target=torch.tensor([0, 1, 2])), ValueError, "target"),
    "target_float": (dict(target=torch.zeros(4)), TypeError, "target"),
    "target_range": (dict(target=torch.tensor([0, 3, 10, 1])), ValueError, "target"),
    "keep_mask_shape": (dict(keep_mask=torch.ones(4, 9, dtype=torch.bool)), ValueError, "keep_mask"),
    "keep_mask_dtype": (dict(keep_mask=torch.ones(4, 10)), TypeError, "keep_mask"),
    "temperature": (dict(temperature=0.0), ValueError, "temperature"),
    "reduce_hidden_grad": (dict(reduce_hidden_grad=1), TypeError, "reduce_hidden_grad"),
    "sequence_parallel_flag": (dict(sequence_parallel="yes"), TypeError, "sequence_parallel"),
    "sp_without_reduce": (dict(sequence_parallel=True, reduce_hidden_grad=False), ValueError, "reduce_hidden_grad"),
    "sp_rows": (dict(sequence_parallel=True, hidden=torch.randn(3, 6)), ValueError, "hidden"),
    "memory_budget_zero": (dict(memory_budget=0), ValueError, "memory_budget"),
    "memory_budget_type": (dict(memory_budget=1.5), TypeError, "memory_budget"),
    "impl": (dict(impl="fast"), ValueError, "impl"),
    "group": (dict(group="world"), TypeError, "group"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_inputs(name):
    change, err, arg = BAD[name]
    kw = _bad_base()
    kw.update(change)
    with pytest.raises(err, match=f"^{arg}:"):
        linear_logprob_entropy(kw.pop("hidden"), kw.pop("weight"), kw.pop("target"), **kw)


# --- memory ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dtype,limit", [("float32", 0.125), ("bfloat16", 0.3)])
def test_memory_well_under_the_logits(dtype, limit):
    T, H, V = 512, 32, 8192
    p = _problem((T,), H, V, dtype, mask=False)
    h, w, y, _ = _torch_args(p)
    dt = DT[dtype]
    B = T * V * torch.tensor([], dtype=dt).element_size()
    grads = (T * H + V * H) * h.element_size()
    gl = torch.randn(T)

    def step():
        lp, en = linear_logprob_entropy(h, w, y, impl="eager")
        (lp * gl + en).sum().backward()

    step()
    h.grad = w.grad = None
    sizes = allocations(step)
    peak = peak_of(sizes)
    assert h.grad is not None and w.grad is not None
    assert peak - grads <= limit * B, (peak - grads) / B
    assert max(sizes) < T * V * 4 / 4  # no allocation anywhere near a [T, V_local] float32 buffer


# --- real gloo ranks ------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _suite(world):
    return run_ranks(_linear_ranks.rank_suite, world, timeout=240)


def _linear_ref(world, **kw):
    p = _linear_ranks.problem(world)
    kw = dict(keep_mask=p["keep"], temperature=_linear_ranks.TAU)
    lp, en = reference.linear_logprob_entropy(p["hidden"], p["weight"], p["target"], **kw)
    dh, dw = reference.linear_logprob_entropy_grad(p["hidden"], p["weight"], p["target"], p["gl"], p["ge"], **kw)
    g = reference.logprob_entropy_grad(p["hidden"] @ p["weight"].T, p["target"], p["gl"], p["ge"], **kw)
    return p, lp, en, dh, dw, g


def _close(x, ref, what):
    tol = _grad_tol("float32", ref) if what in ("dh", "dW") else tolerance("float32", what)
    assert within_tolerance(x, ref, tol), f"{what}: {max_errors(x, ref)}"


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_against_oracle(world):
    res = _suite(world)
    p, lp, en, dh, dw, g = _linear_ref(world)
    v = _linear_ranks.V_LOCAL
    n = _linear_ranks.T // world
    for r, out in enumerate(res):
        for mode in ("plain", "partial", "sp"):
            _close(out[mode]["lp"], lp, "logprob")
            _close(out[mode]["en"], en, "entropy")
            _close(out[mode]["dw"], dw[r * v : (r + 1) * v], "dW")
        _close(out["plain"]["dh"], dh, "dh")  # reduce_hidden_grad=True: the whole dh on every rank
        # reduce_hidden_grad=False: this rank's vocabulary share G_r W_r ...
        _close(out["partial"]["dh"], g[:, r * v : (r + 1) * v] @ p["weight"][r * v : (r + 1) * v], "dh")
        # sequence_parallel=True: this rank's rows of dh
        _close(out["sp"]["dh"], dh[r * n : (r + 1) * n], "dh")
        assert out["after_ok"]
    # ... and the partial dh summed over the ranks is the oracle's dh
    _close(sum(out["partial"]["dh"] for out in res), dh, "dh")
    assert not np.allclose(res[0]["partial"]["dh"], dh)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(_linear_ranks.SCENARIOS))
def test_ranks_disagree_every_rank_raises(world, name):
    expected = _linear_ranks.SCENARIOS[name][1]
    seen = [out["bad"][name] for out in _suite(world)]
    for r, (kind, msg, seconds) in enumerate(seen):
        assert kind != "ok", f"rank {r} did not raise for {name}"
        assert expected in msg, (r, kind, msg)
        assert seconds < 60
