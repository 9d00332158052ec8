"""The fused LM-head op's Triton kernels (``impl="triton"``) against the float64 oracle, on the CPU.

The kernels run under Triton's interpreter: in this process when
``TRITON_INTERPRET=1`` was set before Triton was imported (``tests/conftest.py``
sets it where there is no GPU), else in a child process (one rank of
:func:`dualvp_torch.testing.run_ranks`) that sets it first: Triton defines its
own library functions (``tl.zeros``, ``tl.sum``, ...) as interpreted or
compiled at import. Operands:
float32, float16 and bfloat16 (converted to float32 after loading, the
interpreter's ``tl.dot`` being wrong on bfloat16), at sizes that divide no
tile. ``test_linear_triton_cuda.py`` runs the kernels on a GPU.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from dualvp import reference
from dualvp.testing import cases, oracle_linear
from dualvp.testing.cases import round_to_dtype
from dualvp.testing.metrics import max_errors, rounding_ratio, tolerance, within_rounding, within_tolerance
from dualvp.testing.modes import MODES
from dualvp_torch import linear_logprob_entropy, linear_triton, triton_kernels
from dualvp_torch.testing import run_ranks

from . import _linear_ranks, _linear_triton_ranks

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INTERPRET = {"TRITON_INTERPRET": "1"}
# tests/conftest.py sets TRITON_INTERPRET=1 (without a GPU) before triton is imported: the kernels then
# run in this process; otherwise each call runs in a child process that sets it first
_INTERPRETED = triton_kernels.interpreting()


def _case(dtype, *, T=20, V=50, mask="none", temperature=0.7, ignore_frac=0.2, seed=0):
    # T, V (and H = 20) divide none of the interpreter's tiles (16 x 32, K blocks of 16)
    return dict(lead=(T,), vocab=V, worlds=(1,), dtype=dtype, mask=mask, temperature=temperature,
                ignore_frac=ignore_frac, seed=seed)


def _run(case_kw, H=20, *, logit_scale=3.0, nan_at=None, impl="triton", **run_kw):
    """``(problem, (logprob, entropy, dh, dW))``: the problem here, the outputs from the interpreter's child."""
    P = _linear_triton_ranks.make_problem(case_kw, H, logit_scale, nan_at)
    args = (case_kw, H, dict(run_kw, impl=impl), logit_scale, nan_at)
    if _INTERPRETED:
        return P, _linear_triton_ranks.run_case(0, 1, *args)
    (out,) = run_ranks(_linear_triton_ranks.run_case, 1, *args, env=INTERPRET, timeout=600)
    return P, out


#: The default ``gradient_rounding`` (asserted where a test runs it by leaving the option out).
DEFAULT_ROUNDING = "fixed"


def _grad_ok(x, r, dtype, name, rounding=DEFAULT_ROUNDING, backward="gemm"):
    """``(ok, detail)`` of a ``dh`` / ``dW`` against the float64 oracle's ``r``.

    16-bit at ``gradient_rounding="fixed"`` (the default) / ``"once"``: issue
    45's rule, max |error| <= 2 x that of ``r`` rounded once
    (:func:`~dualvp.testing.metrics.within_rounding`); ``"split"`` (also
    ``"fixed"`` on the ``"atomic"`` backward, which runs it as ``"split"``)
    and float32: the stricter element-wise tolerance.
    """
    if dtype != "float32" and rounding != "split" and not (rounding == "fixed" and backward == "atomic"):
        return within_rounding(x, r, dtype), f"{name}: {rounding_ratio(x, r, dtype):.2f}x the rounding of float64"
    tol = tolerance(dtype, name, r)
    return within_tolerance(x, r, tol), f"{name}: max errors {max_errors(x, r)} > {tol}"


def _check(out, ref, dtype, *, entropy=True, dh=True, dw=True, rounding=DEFAULT_ROUNDING, backward="gemm"):
    lp, en, gh, gw = out
    checks = [("logprob", lp, ref.logprob)]
    if entropy:
        checks.append(("entropy", en, ref.entropy))
    if dh:
        checks.append(("dh", gh, ref.dh))
    assert (gh is None) == (not dh)
    if dw:
        checks.append(("dW", gw, ref.dW))
    assert (gw is None) == (not dw)
    for name, x, r in checks:
        if name in ("dh", "dW"):
            ok, detail = _grad_ok(x, r, dtype, name, rounding, backward)
            assert ok, detail
            continue
        tol = tolerance(dtype, name, r)
        assert within_tolerance(x, r, tol), f"{name}: max errors {max_errors(x, r)} > {tol}"


# --- fast subset: one run per operand dtype, masked and not ---------------------------


@pytest.mark.parametrize("dtype,mask,rounding", [("float32", "none", None), ("float16", "drop_target", None),
                                                   ("float16", "drop_target", "split")])
def test_vs_oracle(dtype, mask, rounding):
    # the default G rounding ("fixed") by issue 45's rule; the option "split" element-wise
    P, out = _run(_case(dtype, mask=mask), **_rounding_kw(rounding))
    _check(out, oracle_linear(P), dtype, rounding=rounding or DEFAULT_ROUNDING)


def _rounding_kw(rounding):
    """``run_case`` keywords: ``None`` the default G rounding (asserted "fixed"), else that option."""
    from dualvp_torch import tuning

    if rounding is None:
        assert tuning.current().gradient_rounding == DEFAULT_ROUNDING
        return {}
    return {"gradient_rounding": rounding}


@pytest.mark.slow
@pytest.mark.parametrize("dtype,mask,rounding", [("bfloat16", "nucleus", None), ("bfloat16", "nucleus", "split"),
                                                   ("float32", "random", None), ("float16", "none", None),
                                                   ("float16", "none", "split")])
def test_vs_oracle_larger(dtype, mask, rounding):
    # the default ("fixed") by issue 45's rule, the option "split" element-wise. T = 37, V = 130, H = 48
    # (T = 70, V = 230 before: 3x the interpreter's time, no other path): 3 row blocks of 16 in 2 groups
    # (the last block partial), 5 column blocks in 3 forward splits (the last block partial), 3 K blocks
    P, out = _run(_case(dtype, T=37, V=130, mask=mask, seed=11), 48, **_rounding_kw(rounding))
    _check(out, oracle_linear(P), dtype, rounding=rounding or DEFAULT_ROUNDING)


def test_bad_inputs_name_their_argument(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the checks pass the device; no kernel runs
    h, w, y = torch.randn(4, 6), torch.randn(10, 6), torch.tensor([0, 3, 9, -100])
    with pytest.raises(ValueError, match="^impl: 'triton' takes float32"):
        linear_logprob_entropy(h.double(), w.double(), y, impl="triton")
    with pytest.raises(TypeError, match="^allow_tf32:"):
        linear_logprob_entropy(h, w, y, impl="triton", allow_tf32=1)
    with pytest.raises(ValueError, match="^impl: expected None or one of"):
        linear_logprob_entropy(h, w, y, impl="cuda")
    # the shared checks come first, as on the torch path
    with pytest.raises(ValueError, match="^target:"):
        linear_logprob_entropy(h, w, torch.tensor([0, 3, 10, 1]), impl="triton")
    with pytest.raises(ValueError, match="^weight:"):
        linear_logprob_entropy(h, torch.randn(10, 5), y, impl="triton")


def test_unavailable_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "needs a CUDA device" in linear_triton.unavailable(torch.device("cpu"))
    with pytest.raises(ValueError, match="^impl: 'triton' needs a CUDA device"):
        linear_logprob_entropy(torch.randn(4, 6), torch.randn(10, 6), torch.tensor([0, 3, 9, 1]), impl="triton")


# --- slow: every mode, frozen inputs, dW chunks, non-finite rows, ranks ----------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype,rounding", [("float32", None), ("float16", None), ("float16", "split")])
def test_every_mode(mode, dtype, rounding):
    # the default G rounding ("fixed") by issue 45's rule; the option "split" (16-bit dh / dW element-wise).
    # The modes' options at T = 20, V = 50, H = 20 (T = 37, V = 130 before): 2 row, 2 column (2 splits) and
    # 2 K blocks, each last one partial; more blocks and groups: test_vs_oracle_larger
    m = MODES[mode]
    P, out = _run(_case(dtype, mask="random" if m.masked else "none", seed=5), **m.options(),
                  **_rounding_kw(rounding))
    ref = oracle_linear(P, entropy_grad=m.entropy_grad)
    _check(out, ref, dtype, entropy=m.with_entropy, rounding=rounding or DEFAULT_ROUNDING)
    assert (out[1] is None) == (not m.with_entropy)


@pytest.mark.slow
@pytest.mark.parametrize("frozen", ["hidden", "weight"])
def test_frozen_input(frozen):
    P, out = _run(_case("float32", mask="nucleus", seed=2), hidden_grad=frozen != "hidden",
                  weight_grad=frozen != "weight")
    _check(out, oracle_linear(P), "float32", dh=frozen != "hidden", dw=frozen != "weight")


@pytest.mark.slow
# ("atomic", "split") left out: "atomic" runs the default "fixed" as "split" (linear_triton.grads), the same
# kernels and chunks as ("atomic", None)
@pytest.mark.parametrize("backward,rounding", [("gemm", None), ("gemm", "split"), ("atomic", None)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16bit_dw_in_vocabulary_chunks(dtype, backward, rounding):
    # memory_budget: chunks of 64 columns (2 blocks of 32); V = 150 -> 3 chunks, the last ragged.
    # "atomic": one float32 dW chunk of 64 rows (it runs the default "fixed" as "split": the element-wise
    # check); "gemm": G_hi and G_lo [T, 64] in the dtype plus the float32 dW chunk of the option "split" (the
    # same budget gives the default "fixed" 64-column chunks too: G rounded once, its float32 dW chunk)
    budget = 64 * 48 * 4 if backward == "atomic" else 64 * (20 * 2 * 2 + 4 * 48)
    P, out = _run(_case(dtype, V=150, mask="all_but_target", seed=3), 48, memory_budget=budget,
                  triton_linear_backward=backward, **_rounding_kw(rounding))
    rounding = rounding or DEFAULT_ROUNDING
    ref = oracle_linear(P)
    if (dtype, backward, rounding) == ("float16", "gemm", "fixed"):
        # rows with two columns at p > 1/3 (test_fixed_within_the_rule_with_two_columns_above_a_third), in one
        # chunk or two: the chunks' dh and dW against the independent NumPy formulation of "fixed" too, within
        # one ulp of the largest entry (the kernel accumulates in float32, the model in float64, and a value
        # next to a rounding boundary of the one final rounding lands one ulp apart; the bfloat16 case is not
        # compared: the interpreter truncates float32 to bfloat16, so its G rounded once is not the model's)
        fixed = _g_fixed(P, dtype)
        for name, x, o, r in (("dh", out[2], fixed[0], ref.dh), ("dW", out[3], fixed[1], ref.dW)):
            ulp = 2.0 ** (np.floor(np.log2(np.abs(r).max())) - 10)  # float16: 11 significant bits
            assert np.abs(x - o).max() <= ulp, (name, np.abs(x - o).max() / ulp)
    _check(out, ref, dtype, rounding=rounding, backward=backward)


@pytest.mark.slow
def test_fixed_within_the_rule_with_two_columns_above_a_third():
    # float16, every column but the target masked (a top-1 keep mask: greedy replay), logits x 3 at
    # temperature 0.7: rows with a second column at 1/3 < p <= 1/2. Fixing the target and the p > 1/2
    # column only left that column's rounding error: 2.65x (dh) / 2.25x (dW) the rounding of the float64
    # result (the NumPy model gave the same); "fixed" now fixes every column with p > 1/3 (two per row at
    # most: the kernel's slots 1 and 2, an atomic min and max over the tiles). G rounded once alone stays
    # outside the rule here, so the check fails without the residual terms.
    dtype = "float16"
    for rounding in ("fixed", "once"):
        P, (_, _, dh, dw) = _run(_case(dtype, V=150, mask="all_but_target", seed=3), 48, gradient_rounding=rounding)
        ref = oracle_linear(P)
        ok = [within_rounding(x, r, dtype) for x, r in ((dh, ref.dh), (dw, ref.dW))]
        ratios = [rounding_ratio(x, r, dtype) for x, r in ((dh, ref.dh), (dw, ref.dW))]
        assert all(ok) == (rounding == "fixed"), (rounding, ratios)


@pytest.mark.slow
def test_temperature_and_confident_rows():
    # a large logit scale and a low temperature: rows whose max dominates (p ~ 1 on one column)
    P, out = _run(_case("float32", T=33, V=120, temperature=0.3, mask="nucleus", seed=9), 40, logit_scale=12.0)
    _check(out, oracle_linear(P), "float32")


@pytest.mark.slow
def test_nonfinite_row_by_row():
    P, (lp, en, gh, gw) = _run(_case("float32", mask="random", seed=4, ignore_frac=0.0), nan_at=(4, 3))
    with np.errstate(invalid="ignore"):
        ref = oracle_linear(P)
    for got, r in ((lp, ref.logprob), (en, ref.entropy)):
        assert np.isnan(got[4]) and np.isnan(r[4])
        assert within_tolerance(np.delete(got, 4), np.delete(r, 4), tolerance("float32", "logprob"))
    assert np.all(np.isnan(gh[4])) and not np.isnan(np.delete(gh, 4, axis=0)).any()
    assert np.isnan(gw).all()


@pytest.mark.slow
def test_matches_the_torch_path():
    # an independent formulation of the same op: the torch tile loop over the spec's stages
    kw = _case("float32", mask="drop_target", seed=6, T=50, V=111)
    _, a = _run(kw)
    _, b = _run(kw, impl="eager")
    for xa, yb, q in zip(a, b, ("logprob", "entropy", "dh", "dW")):
        tol = tolerance("float32", q, yb)
        assert within_tolerance(xa, yb, tol), (q, max_errors(xa, yb))


# (dtype, G rounding): None the default ("fixed"); float16 also under the option "split"
_RANK_SUITES = (("float32", None), ("float16", None), ("float16", "split"))


@pytest.fixture(scope="module")
def two_ranks():
    # one spawn of the 2 ranks runs the suite in every dtype (a spawn costs a start-up of torch per rank)
    res = run_ranks(_linear_triton_ranks.rank_suites, 2, _RANK_SUITES, env={"TRITON_INTERPRET": "1"}, timeout=600)
    return {s: [r[s] for r in res] for s in _RANK_SUITES}


@pytest.mark.slow
@pytest.mark.parametrize("dtype,rounding", _RANK_SUITES)
def test_two_ranks(dtype, rounding, two_ranks):
    world = 2
    res = two_ranks[dtype, rounding]
    p = _linear_ranks.problem(world)
    if dtype != "float32":
        p = dict(p, hidden=cases.round_to_dtype(p["hidden"], dtype), weight=cases.round_to_dtype(p["weight"], dtype))
    kw = dict(keep_mask=p["keep"], temperature=_linear_ranks.TAU)
    lp, en = reference.linear_logprob_entropy(p["hidden"], p["weight"], p["target"], **kw)
    dh, dw = reference.linear_logprob_entropy_grad(p["hidden"], p["weight"], p["target"], p["gl"], p["ge"], **kw)
    g = reference.logprob_entropy_grad(p["hidden"] @ p["weight"].T, p["target"], p["gl"], p["ge"], **kw)
    v, n = _linear_ranks.V_LOCAL, _linear_ranks.T // world
    # element-wise per shard: float32 and the option "split"; 16-bit "fixed" (the default) by the rule on the
    # whole gradient
    per_shard = dtype == "float32" or rounding == "split"

    def close(x, ref, what):
        # dh / dW: issue 45's rule at the default ("fixed"), element-wise under the option "split"
        if what in ("dh", "dW"):
            ok, detail = _grad_ok(x, ref, dtype, what, rounding or DEFAULT_ROUNDING)
            assert ok, detail
            return
        assert within_tolerance(x, ref, tolerance(dtype, what)), (what, max_errors(x, ref))

    for r, out in enumerate(res):
        for mode in ("plain", "partial", "sp"):
            close(out[mode]["lp"], lp, "logprob")
            close(out[mode]["en"], en, "entropy")
            if per_shard:  # element-wise: each rank's dW shard
                close(out[mode]["dw"], dw[r * v : (r + 1) * v], "dW")
        close(out["plain"]["dh"], dh, "dh")
        close(out["partial"]["dh"], g[:, r * v : (r + 1) * v] @ p["weight"][r * v : (r + 1) * v], "dh")
        if per_shard:  # each rank's sequence-parallel rows
            close(out["sp"]["dh"], dh[r * n : (r + 1) * n], "dh")
        assert np.array_equal(out["plain"]["lp"], res[0]["plain"]["lp"])  # identical on every rank
    assert all(out["sp"]["dh"].shape[0] == n for out in res)
    if not per_shard:
        # "fixed": the op's dW (the ranks' shards) and sequence-parallel dh (the ranks' rows) as a whole,
        # the rule's unit being the whole gradient's rounding (a 37 x 8 float16 shard alone: "fixed" 2.09x
        # on rank 1, the whole dW 1.52x, NumPy model of "fixed")
        for mode in ("plain", "partial", "sp"):
            close(np.concatenate([out[mode]["dw"] for out in res]), dw, "dW")
        close(np.concatenate([out["sp"]["dh"] for out in res]), dh, "dh")


# --- the 16-bit backward's gradient tile: hi + lo split (default), rounded once + rank-1 fixes, or once ---------------


def _g_once(P, dtype):
    """``(dh, dW)`` of ``G`` (float64 oracle, through float32) rounded once to ``dtype``, products in float64.

    An independent formulation of ``gradient_rounding="once"``: NumPy on the
    oracle's ``G`` (``dualvp.reference``), not the kernels' arithmetic; the
    results rounded once to ``dtype`` as the op returns them.
    """
    z = P.hidden @ P.weight.T
    g = reference.logprob_entropy_grad(z, P.target, P.grad_logprob, P.grad_entropy, keep_mask=P.keep_mask,
                                       temperature=P.case.temperature, ignore_index=P.case.ignore_index)
    g16 = round_to_dtype(g.astype(np.float32).astype(np.float64), dtype)
    return round_to_dtype(g16 @ P.weight, dtype), round_to_dtype(g16.T @ P.hidden, dtype)


#: The 16-bit precision cases at T = 64, V = 512, H = 64 and the roundings each is checked at: each case's
#: forward runs once, its backward once per rounding (:func:`_linear_triton_ranks.run_roundings`).
_ROUNDING_RUNS = {("float16", "nucleus", 3): ("split", "fixed", "once"), ("bfloat16", "nucleus", 3): ("split",),
                  ("bfloat16", "none", 0): ("fixed",), ("float16", "none", 0): ("fixed",)}
_ROUNDED: dict = {}


def _rounded(dtype, mask, seed, rounding):
    """``(problem, (dh, dW))`` of the case at ``gradient_rounding=rounding``; each case's runs made once."""
    key = (dtype, mask, seed)
    case_kw = _case(dtype, T=64, V=512, mask=mask, seed=seed)
    if key not in _ROUNDED:
        args = (case_kw, 64, _ROUNDING_RUNS[key])
        if _INTERPRETED:
            _ROUNDED[key] = _linear_triton_ranks.run_roundings(0, 1, *args)
        else:
            (_ROUNDED[key],) = run_ranks(_linear_triton_ranks.run_roundings, 1, *args, env=INTERPRET, timeout=600)
    return _linear_triton_ranks.make_problem(case_kw, 64), _ROUNDED[key][rounding]


def _floor(r, dtype):
    # the error of the float64 result rounded once to dtype: the precision goal's unit
    return np.abs(round_to_dtype(r, dtype) - r).max()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_split_gradient_within_twice_the_rounding(dtype):
    # hi + lo split of G: max |error| of dh and dW <= 2 x the float64 result rounded once. ("fixed", the
    # default, on this case: test_fixed_gradient_within_twice_the_rounding's float16 nucleus seed 3 case
    # is the same run; bfloat16 nucleus at the default: test_vs_oracle_larger, by the same rule.)
    P, (dh, dw) = _rounded(dtype, "nucleus", 3, "split")
    ref = oracle_linear(P)
    for name, x, r in (("dh", dh, ref.dh), ("dW", dw, ref.dW)):
        assert np.abs(x - r).max() <= 2 * _floor(r, dtype), (name, np.abs(x - r).max() / _floor(r, dtype))


def _g_fixed(P, dtype):
    """``(dh, dW)`` of ``G`` rounded once to ``dtype`` but exact (float32) at the target and the ``p > 1/3`` columns.

    An independent formulation of ``gradient_rounding="fixed"`` (as
    ``benchmarks/g_rounding.py``'s ``fixed``): NumPy on the oracle's ``G``;
    ``p`` the unmasked softmax of the float64 logits.
    """
    z = P.hidden @ P.weight.T
    g = reference.logprob_entropy_grad(z, P.target, P.grad_logprob, P.grad_entropy, keep_mask=P.keep_mask,
                                       temperature=P.case.temperature, ignore_index=P.case.ignore_index)
    g32 = g.astype(np.float32).astype(np.float64)
    fixed = round_to_dtype(g32, dtype)
    rows = np.nonzero((P.target >= 0) & (P.target < z.shape[1]))[0]
    fixed[rows, P.target[rows]] = g32[rows, P.target[rows]]
    u = z / P.case.temperature
    p = np.exp(u - u.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    fixed = np.where(p > 1 / 3, g32, fixed)
    return round_to_dtype(fixed @ P.weight, dtype), round_to_dtype(fixed.T @ P.hidden, dtype)


@pytest.mark.parametrize("dtype,mask,seed,model", [
    pytest.param("bfloat16", "none", 0, False, marks=pytest.mark.slow),  # ~6 s under the interpreter
    pytest.param("float16", "nucleus", 3, False, marks=pytest.mark.slow),
    pytest.param("float16", "none", 0, True, marks=pytest.mark.slow),
])
def test_fixed_gradient_within_twice_the_rounding(dtype, mask, seed, model):
    # gradient_rounding="fixed", the default (G rounded once + the rank-1 residual terms at the target and the
    # p > 1/3 columns): max |error| of dh and dW <= 2 x the float64 result rounded once (issue 45). G
    # rounded once alone exceeds it on the bfloat16 case (2.6x dW, measured under the interpreter).
    P, (dh, dw) = _rounded(dtype, mask, seed, "fixed")
    ref = oracle_linear(P)
    for name, x, r in (("dh", dh, ref.dh), ("dW", dw, ref.dW)):
        assert np.abs(x - r).max() <= 2 * _floor(r, dtype), (name, np.abs(x - r).max() / _floor(r, dtype))
    if model:
        # the same rounding as the NumPy formulation, within one rounding unit (float16: see
        # test_gradient_rounded_once_option). G rounded once alone is 2.2x (dh) / 2.4x (dW) away on this
        # case; on float16 nucleus seed 3 the default is 1.01x away (one dW entry's last rounding flips)
        fixed = _g_fixed(P, dtype)
        for name, x, o, r in (("dh", dh, fixed[0], ref.dh), ("dW", dw, fixed[1], ref.dW)):
            assert np.abs(x - o).max() <= _floor(r, dtype), (name, np.abs(x - o).max() / _floor(r, dtype))


@pytest.mark.slow
def test_gradient_rounded_once_option():
    # gradient_rounding="once": G rounded once to the operand dtype; the kernels' dh and dW against the
    # independent NumPy formulation of the same rounding (within one rounding unit: the kernels' G is
    # float32 arithmetic, which may round a few entries of G the other way). float16 only: the
    # interpreter converts float32 to bfloat16 by truncation (a GPU rounds to nearest), so its
    # bfloat16 G rounded once is not the GPU's.
    dtype = "float16"
    P, (dh, dw) = _rounded(dtype, "nucleus", 3, "once")
    ref = oracle_linear(P)
    once = _g_once(P, dtype)
    for name, x, o, r in (("dh", dh, once[0], ref.dh), ("dW", dw, once[1], ref.dW)):
        assert np.abs(x - o).max() <= _floor(r, dtype), (name, np.abs(x - o).max() / _floor(r, dtype))
