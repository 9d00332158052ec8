"""The torch tile path's 16-bit GEMMs (CUDA: ``torch.mm(..., out_dtype=float32)``), emulated on the CPU.

torch has no CPU kernel of a 16-bit matmul with float32 output, so these tests
replace ``dualvp_torch.linear._mm_f32`` by its contract (16-bit operands,
exact products, float32 accumulation and output) and switch the path on for
CPU tensors. They check that every product takes 16-bit operands (no float32
copy of a weight or hidden row), the results against the float64 oracle, and
the precision goal of the gradient tile (the default ``"fixed"`` rounding and
the ``"split"`` option): ``dh`` and ``dW`` within 2x of the float64 result
rounded once to the input dtype.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dualvp.testing import cases, oracle_linear  # noqa: E402
from dualvp.testing.cases import round_to_dtype  # noqa: E402
from dualvp.testing.metrics import (max_errors, rounding_ratio, tolerance, within_rounding,  # noqa: E402
                                    within_tolerance)
from dualvp_torch import linear as linear_mod  # noqa: E402
from dualvp_torch import linear_logprob_entropy  # noqa: E402


@pytest.fixture
def emulated(monkeypatch):
    """The CUDA 16-bit path on CPU tensors; returns the operand dtypes of every product it ran."""
    seen = []

    def mm_f32(a, b):
        seen.append((a.dtype, b.dtype))
        return a.float() @ b.float()

    monkeypatch.setattr(linear_mod, "_native_out_dtype", lambda x, cdt: x.dtype != cdt)
    monkeypatch.setattr(linear_mod, "_mm_f32", mm_f32)
    return seen


def _run(P, budget=None, impl="eager"):
    dt = getattr(torch, P.case.dtype)
    h = torch.tensor(P.hidden).to(dt).requires_grad_(True)
    w = torch.tensor(P.weight).to(dt).requires_grad_(True)
    keep = None if P.keep_mask is None else torch.tensor(P.keep_mask)
    lp, en = linear_logprob_entropy(h, w, torch.tensor(P.target), keep_mask=keep, temperature=P.case.temperature,
                                    ignore_index=P.case.ignore_index, memory_budget=budget, impl=impl)
    gl, ge = torch.tensor(P.grad_logprob, dtype=lp.dtype), torch.tensor(P.grad_entropy, dtype=en.dtype)
    (lp * gl + en * ge).sum().backward()
    return [x.detach().double().numpy() for x in (lp, en, h.grad, w.grad)]


def _oracle_params():
    # shape x (dtype, mask) x rounding; the fast tier: every (dtype, mask) vocab-major at the default "fixed",
    # "split" and token-major once each (the other combinations, slow, run the same products)
    shapes = {"vocab_major": (37, 16, 301, 2 * 37 * 40), "token_major": (300, 8, 50, 4 * 1000)}
    fast = {("vocab_major", "drop_target", "split"), ("token_major", "random", "fixed")}
    out = []
    for sid, shape in shapes.items():
        for dtype, mask in [("bfloat16", "none"), ("float16", "drop_target"), ("bfloat16", "random")]:
            for rounding in ("fixed", "split"):
                slow = not ((sid == "vocab_major" and rounding == "fixed") or (sid, mask, rounding) in fast)
                out.append(pytest.param(dtype, mask, shape, rounding, id=f"{sid}-{dtype}-{mask}-{rounding}",
                                        marks=[pytest.mark.slow] if slow else []))
    return out


@pytest.mark.parametrize("dtype,mask,shape,rounding", _oracle_params())
def test_against_the_oracle(emulated, dtype, mask, shape, rounding):
    # "fixed" (the default): dh and dW by issue 45's rule; the option "split": the element-wise tolerance
    # (max |error| <= 2 x that of the float64 result rounded once). Log-prob and entropy element-wise either way.
    from dualvp_torch import tuning

    T, H, V, tile = shape  # tile: elements of one eager tile (several tiles, ragged last ones)
    c = cases.case("basic", lead=(T,), vocab=V, worlds=(1,), dtype=dtype, mask=mask, temperature=0.8,
                   ignore_frac=0.2, seed=2)
    P = cases.make_linear(c, H)
    setting = tuning.DEFAULT if rounding == "fixed" else tuning.Tuning(gradient_rounding=rounding)
    assert setting.gradient_rounding == rounding
    with tuning.using(setting):
        out = _run(P, budget=tile * (4 + 44))
    ref = oracle_linear(P)
    for x, r, q in zip(out, ref, ("logprob", "entropy", "dh", "dW")):
        if q in ("dh", "dW") and rounding == "fixed":
            assert within_rounding(x, r, dtype), (q, rounding_ratio(x, r, dtype))
            continue
        tol = tolerance(dtype, q, r)
        assert within_tolerance(x, r, tol), (q, max_errors(x, r))
    assert emulated and all(a in (torch.bfloat16, torch.float16) and b == a for a, b in emulated)
    # the forward block and its recomputation, then one part of G ("fixed") or two ("split") for each of
    # dh and dW, per tile
    assert len(emulated) % (4 if rounding == "fixed" else 6) == 0


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=pytest.mark.slow)])
def test_split_gradient_within_twice_the_rounding(emulated, dtype):
    # "split" (an option, set explicitly): max |error| of dh and dW <= 2 x max |float64 oracle rounded once - oracle|
    from dualvp_torch import tuning

    c = cases.case("basic", lead=(256,), vocab=2048, worlds=(1,), dtype=dtype, mask="nucleus", temperature=0.7,
                   seed=3)
    P = cases.make_linear(c, 128)
    with tuning.using(tuning.Tuning(gradient_rounding="split")):
        _, _, dh, dw = _run(P)
    ref = oracle_linear(P)
    for x, r in ((dh, ref.dh), (dw, ref.dW)):
        floor = np.abs(round_to_dtype(r, dtype) - r).max()
        assert np.abs(x - r).max() <= 2 * floor, (np.abs(x - r).max(), floor)


@pytest.mark.parametrize("rounding,impl,budget", [
    ("fixed", "eager", None), ("fixed", "eager", 256 * 300 * (4 + 44)),
    pytest.param("fixed", "compiled", None, marks=pytest.mark.slow),
    ("once", "eager", None),  # the control, failing the bound: once in the fast tier
    pytest.param("once", "eager", 256 * 300 * (4 + 44), marks=pytest.mark.slow),
    pytest.param("once", "compiled", None, marks=pytest.mark.slow)],
    ids=lambda v: "None" if v is None else str(v))
def test_fixed_gradient_within_twice_the_rounding(emulated, rounding, impl, budget):
    # gradient_rounding="fixed": G rounded once, one product per part, and the rank-1 residual terms at
    # the target and p > 1/3 columns: dh and dW within 2x of the float64 result rounded once (issue 45).
    # "once" alone exceeds 2x on this case (benchmarks/g_rounding.py: 2.30 dh, 2.11 dW), so the check
    # fails without the residual terms. budget: several tiles per row and per column (vocab-major)
    from dualvp_torch import tuning

    c = cases.case("basic", lead=(256,), vocab=2048, worlds=(1,), dtype="bfloat16", mask="none", temperature=0.7,
                   seed=2)
    P = cases.make_linear(c, 128)
    with tuning.using(tuning.Tuning(gradient_rounding=rounding)):
        _, _, dh, dw = _run(P, budget=budget, impl=impl)
    ref = oracle_linear(P)
    ratios = [np.abs(x - r).max() / np.abs(round_to_dtype(r, "bfloat16") - r).max() for x, r in ((dh, ref.dh),
                                                                                              (dw, ref.dW))]
    assert (max(ratios) <= 2) == (rounding == "fixed"), ratios
    assert emulated and len(emulated) % 4 == 0  # forward block, recompute, dh and dW: one part of G each


@pytest.mark.parametrize("budget", [pytest.param(None, marks=pytest.mark.slow), 20 * 40 * (4 + 44)])
@pytest.mark.parametrize("rounding", ["fixed", "once"])
def test_fixed_gradient_two_columns_above_a_third(emulated, rounding, budget):
    # float16, a top-1 keep mask, logits x 3 at tau 0.7 (tests/torch/test_linear_triton.py's case): rows
    # whose second column has 1/3 < p <= 1/2, whose rounding error fixing the target and the p > 1/2 column
    # alone left (2.65x dh / 2.97x dW the rounding of the float64 result, NumPy model); "fixed" fixes both
    # p > 1/3 columns (the tile's two largest logits), "once" fails. budget: tiles of 40 columns, so a row's
    # two columns may sit in two tiles
    from dualvp_torch import tuning

    c = cases.case("basic", lead=(20,), vocab=150, worlds=(1,), dtype="float16", mask="all_but_target",
                   temperature=0.7, ignore_frac=0.2, seed=3)
    P = cases.make_linear(c, 48)
    with tuning.using(tuning.Tuning(gradient_rounding=rounding)):
        _, _, dh, dw = _run(P, budget=budget)
    ref = oracle_linear(P)
    ok = [within_rounding(x, r, "float16") for x, r in ((dh, ref.dh), (dw, ref.dW))]
    assert all(ok) == (rounding == "fixed"), [rounding_ratio(x, r, "float16") for x, r in ((dh, ref.dh),
                                                                                         (dw, ref.dW))]


@pytest.mark.parametrize("rounding", ["fixed", pytest.param("once", marks=pytest.mark.slow)])
def test_fixed_gradient_keep_ids(emulated, rounding):
    # keep_ids: the kept values written over G rounded once, their residuals added back at every kept
    # column; against the oracle (G rounded once alone fails this case)
    from dualvp import testing
    from dualvp_torch import tuning

    p = cases.make_linear(cases.case("confident_lm_bf16_ids"), 8)
    h = torch.from_numpy(p.hidden).to(torch.bfloat16).requires_grad_(True)
    w = torch.from_numpy(p.weight).to(torch.bfloat16).requires_grad_(True)
    with tuning.using(tuning.Tuning(gradient_rounding=rounding)):
        lp, en = linear_logprob_entropy(h, w, torch.from_numpy(p.target), keep_ids=torch.from_numpy(p.keep_ids),
                                        temperature=p.case.temperature, ignore_index=p.case.ignore_index,
                                        impl="eager", memory_budget=600)
        torch.autograd.backward([lp, en], [torch.from_numpy(x).to(lp.dtype) for x in (p.grad_logprob,
                                                                                    p.grad_entropy)])
    out = testing.LinearOutputs(*(x.detach().double().numpy() for x in (lp, en, h.grad, w.grad)))
    assert bool(testing.failures(p, {"torch": out})) == (rounding == "once")


@pytest.mark.parametrize("rounding", ["fixed", pytest.param("split", marks=pytest.mark.slow)])
def test_batch_invariant(emulated, rounding):
    # the tile path's 16-bit GEMMs (emulated) at the default "fixed" rounding (its dh residual terms per row)
    # and the option "split": a row's log-prob, entropy and dh bitwise the same alone and in larger calls;
    # tau 0.3: rows with p > 1/3
    from dualvp_torch import tuning

    from .test_linear_batch_invariance import check_invariance, fused_runner, make_fused_table

    table = make_fused_table(v=301, h=16, dtype="bfloat16", tau=0.3, n_other=200)
    setting = tuning.DEFAULT if rounding == "fixed" else tuning.Tuning(gradient_rounding=rounding)
    assert setting.gradient_rounding == rounding
    with tuning.using(setting):
        check_invariance(fused_runner(table, "eager"), table, (7, 64, 200))
    assert emulated


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_residual_rows_added_in_row_order(device):
    # the "fixed" dW residual terms (linear._add_rows_): rows sharing a column summed in row order, so
    # bitwise the same run to run (on CUDA: not index_add_'s atomics) and equal to a sequential loop
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(5)
    n, v, h = 2000, 7, 64  # ~286 rows per column
    col = torch.randint(0, v, (n,), generator=g).to(device)
    rows = (torch.randn(n, h, generator=g) * torch.logspace(-6, 2, n)[:, None]).to(device)
    acc0 = torch.randn(v, h, generator=g).to(device)
    want = acc0.clone()
    for t, c in enumerate(col.tolist()):  # float32, one row after another
        want[c] += rows[t]
    for _ in range(3):
        acc = acc0.clone()
        linear_mod._add_rows_(acc, col, rows)
        assert torch.equal(acc, want)
