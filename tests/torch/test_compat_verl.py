"""``dualvp_torch.compat.linear_cross_entropy`` (verl's fused op) against the float64 oracle, on the CPU.

verl's semantics (``verl/utils/kernel/linear_cross_entropy.py``): hidden
``[batch, tokens, H]`` and labels ``[batch, tokens]`` flattened to ``T``
rows; ``logprobs`` the log-probability (<= 0) per row, or its sum / its sum
divided by ``T`` (``reduction="sum"`` / ``"mean"``), float32; ``entropy``
``[T]`` float32 with its gradient; under tensor parallelism the weight is the
rank's contiguous vocabulary shard and ``d_hidden`` this rank's partial sum.
verl's own GPU test is ``tests/utils/test_linear_cross_entropy.py`` in verl's
repository (needs CUDA and verl; see the fused op's record in
docs/decisions.md for how it runs against this drop-in).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dualvp import reference  # noqa: E402
from dualvp.testing.cases import round_to_dtype  # noqa: E402
from dualvp.testing.metrics import max_errors, tolerance, within_tolerance  # noqa: E402
from dualvp_torch.compat import linear_cross_entropy  # noqa: E402
from dualvp_torch.testing import run_ranks  # noqa: E402

from . import _compat_verl_ranks  # noqa: E402

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _oracle(h, w, y, tau, g_lp, g_en, reduction):
    """float64 ``(logprobs, entropy, d_hidden, d_weight)`` of verl's contract, from the op's reference."""
    n = y.size
    lp, en = reference.linear_logprob_entropy(h.reshape(n, -1), w, y.reshape(-1), temperature=tau)
    gl = {"none": g_lp, "sum": np.full(n, g_lp), "mean": np.full(n, g_lp / n)}[reduction]
    dh, dw = reference.linear_logprob_entropy_grad(h.reshape(n, -1), w, y.reshape(-1), gl, g_en, temperature=tau)
    lp = {"none": lp, "sum": lp.sum(), "mean": lp.sum() / n}[reduction]
    return lp, en, dh.reshape(h.shape), dw


def _close(x, ref, dtype, what):
    tol = tolerance(dtype, what, ref) if what in ("dh", "dW") else tolerance(dtype, what)
    if what == "logprob" and np.ndim(ref) == 0:  # a sum over T rows: T times the per-row bound
        tol = type(tol)(tol.atol * 16, tol.rtol)
    assert within_tolerance(x, ref, tol), f"{what}: {max_errors(x, ref)} > {tol}"


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_semantics_against_the_oracle(reduction, dtype):
    rng = np.random.default_rng(1)
    T, H, V = 16, 24, 101  # verl's inputs: uniform(-0.5, 0.5) hidden and weight, labels in [0, V)
    h = round_to_dtype(rng.uniform(-0.5, 0.5, size=(1, T, H)) * 4, dtype)
    w = round_to_dtype(rng.uniform(-0.5, 0.5, size=(V, H)), dtype)
    y = rng.integers(0, V, size=(1, T))
    g_lp = round_to_dtype(rng.uniform(-1, 1, size=T if reduction == "none" else ()), "float32")
    g_en = round_to_dtype(rng.uniform(-0.5, 0.5, size=T), "float32")
    ht = torch.tensor(h).to(DT[dtype]).requires_grad_(True)
    wt = torch.tensor(w).to(DT[dtype]).requires_grad_(True)
    lp, en = linear_cross_entropy(ht, wt, torch.tensor(y), 1.5, reduction)
    assert lp.dtype == torch.float32 and en.dtype == torch.float32
    assert lp.shape == ((T,) if reduction == "none" else ()) and en.shape == (T,)
    d_h, d_w = torch.autograd.grad((en, lp), (ht, wt), (torch.tensor(g_en, dtype=torch.float32),
                                                        torch.tensor(g_lp, dtype=torch.float32)))
    assert d_h.shape == ht.shape and d_h.dtype == ht.dtype and d_w.dtype == wt.dtype
    ref = _oracle(h, w, y, 1.5, g_lp, g_en, reduction)
    assert np.all(ref[0] <= 0)  # log-probabilities, not losses
    for x, r, what in zip((lp, en, d_h, d_w), ref, ("logprob", "entropy", "dh", "dW")):
        _close(x.detach().double().numpy(), r, dtype, what)


def test_reduction_is_case_insensitive_and_checked():
    h, w, y = torch.randn(5, 8), torch.randn(9, 8), torch.randint(0, 9, (5,))
    a = linear_cross_entropy(h, w, y, 1.0, "MEAN")[0]
    b = linear_cross_entropy(h, w, y, 1.0, "none")[0].mean()
    assert torch.allclose(a, b)
    with pytest.raises(ValueError, match="^reduction:"):
        linear_cross_entropy(h, w, y, 1.0, "avg")
    with pytest.raises(TypeError, match="^reduction:"):
        linear_cross_entropy(h, w, y, 1.0, None)
    with pytest.raises(TypeError, match="^temperature:"):
        linear_cross_entropy(h, w, y, "1.0")
    with pytest.raises(ValueError, match="^temperature:"):
        linear_cross_entropy(h, w, y, 0.0)
    with pytest.raises(ValueError, match="^target:"):  # a label outside [0, V) (verl: undefined)
        linear_cross_entropy(h, w, torch.tensor([0, 1, 2, 3, 9]))


def test_minus_100_label_gives_zero_logprob_and_no_gradient():
    h = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(9, 8)
    lp, _ = linear_cross_entropy(h, w, torch.tensor([1, -100, 3, 4]))
    assert lp[1].item() == 0.0
    (g,) = torch.autograd.grad(lp.sum(), h)
    assert torch.all(g[1] == 0) and torch.any(g[0] != 0)


_REDUCTIONS = ("none", "mean")


@pytest.fixture(scope="module")
def two_ranks():
    # one spawn of the 2 ranks runs both reductions (a spawn costs a start-up of torch per rank)
    res = run_ranks(_compat_verl_ranks.rank_suites, 2, _REDUCTIONS, timeout=600)
    return {red: [r[red] for r in res] for red in _REDUCTIONS}


@pytest.mark.slow
@pytest.mark.parametrize("reduction", _REDUCTIONS)
def test_tensor_parallel_two_ranks(reduction, two_ranks):
    world = 2
    res = two_ranks[reduction]
    p = _compat_verl_ranks.problem(world)
    g_lp = p["g_logprobs"] if reduction == "none" else p["g_logprobs"][0]
    lp, en, dh, dw = _oracle(p["hidden"], p["weight"], p["labels"], _compat_verl_ranks.TAU, g_lp, p["g_entropy"],
                             reduction)
    v = _compat_verl_ranks.V_LOCAL
    for r, out in enumerate(res):
        _close(out["lp"], lp, "float32", "logprob")
        _close(out["en"], en, "float32", "entropy")
        _close(out["dw"], dw[r * v : (r + 1) * v], "float32", "dW")
        assert out["dh_shape"] == p["hidden"].shape
    # d_hidden is each rank's partial sum (verl's callers all-reduce it), not the whole gradient
    _close(sum(out["dh"] for out in res), dh, "float32", "dh")
    assert not np.allclose(res[0]["dh"], dh, atol=1e-3)


# ------------------------------------------------- the unfused and tensor-parallel functions (verl's engines)

from dualvp import reference as _ref  # noqa: E402
from dualvp_torch.compat import verl as dverl  # noqa: E402

from . import _compat_stacks as cs  # noqa: E402


@pytest.fixture
def _eager(monkeypatch):
    monkeypatch.setenv("DUALVP_COMPILE", "0")


@pytest.mark.usefixtures("_eager")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logprobs_from_logits_float32_out_ignore_and_grad(dtype):
    z = cs.logits((4, 6, 33), dtype, seed=11)
    y = np.random.default_rng(12).integers(0, 33, size=(4, 6))
    y[1, 2] = -100  # flash-attn's cross-entropy: 0 and no gradient
    g = np.random.default_rng(13).normal(size=(4, 6)).astype(np.float32)
    for inplace in (True, False):
        leaf = cs.t(z, dtype, grad=True)
        x = leaf * 1  # a non-leaf, as the model's logits are: inplace_backward may write into it
        lp = dverl.logprobs_from_logits(x, torch.tensor(y), inplace_backward=inplace)
        assert lp.dtype == torch.float32 and lp.shape == (4, 6)
        ref_lp, _ = _ref.logprob_entropy(z, y)
        cs.check(lp, ref_lp, dtype, "logprob")
        assert lp[1, 2].item() == 0.0
        lp.backward(torch.tensor(g))
        cs.check(leaf.grad, _ref.logprob_entropy_grad(z, y, g), dtype, "grad")
    leaf = cs.t(z, dtype, grad=True)  # a leaf: never overwritten, whatever inplace_backward says
    dverl.logprobs_from_logits(leaf, torch.tensor(y)).sum().backward()
    assert np.array_equal(cs.n(leaf.detach()), z)
    with pytest.raises(ValueError, match="labels"):
        dverl.logprobs_from_logits(leaf, torch.full((4, 6), 33))


@pytest.mark.usefixtures("_eager")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_entropy_and_sum_pi_squared_in_the_logits_dtype(dtype):
    z = cs.logits((5, 7, 31), dtype, seed=14)
    g = np.random.default_rng(15).normal(size=(5, 7))
    zero = np.zeros((5, 7), dtype=np.int64)
    _, ent = _ref.logprob_entropy(z, zero)
    s_ref, _ = cs.sum_pi_squared(z)
    for fn in (dverl.entropy_from_logits, dverl.vocab_parallel_entropy):
        x = cs.t(z, dtype, grad=True)
        h = fn(x)
        assert h.dtype == x.dtype
        cs.check(h, ent, dtype, "entropy", out_dtype=dtype)
        h.backward(torch.tensor(g).to(h.dtype))
        g_used = cs.n(torch.tensor(g).to(h.dtype))
        cs.check(x.grad, _ref.logprob_entropy_grad(z, zero, np.zeros((5, 7)), g_used), dtype, "grad")
        cs.check(fn(x.detach(), float32_output=True), ent, dtype, "entropy")
    for fn in (dverl.entropy_from_logits_with_chunking, dverl.vocab_parallel_entropy_with_chunking):
        h = fn(cs.t(z, dtype), 2)
        assert h.dtype == torch.float32  # verl's chunked functions return float32
        cs.check(h, ent, dtype, "entropy")
    for fn in (dverl.calculate_sum_pi_squared_from_logits, dverl.vocab_parallel_sum_pi_squared):
        x = cs.t(z, dtype, grad=True)
        s = fn(x)
        assert s.dtype == x.dtype
        cs.check(s, s_ref, dtype, "entropy", out_dtype=dtype)
        s.backward(torch.tensor(g).to(s.dtype))
        cs.check(x.grad, cs.sum_pi_squared_grad(z, cs.n(torch.tensor(g).to(s.dtype))), dtype, "grad")
        assert fn(x.detach(), float32_output=True).dtype == torch.float32


@pytest.mark.usefixtures("_eager")
def test_one_call_logprobs_and_entropy_and_float64():
    z = cs.logits((9, 40), "float64", seed=16)
    y = np.random.default_rng(17).integers(0, 40, size=9)
    lp, h = dverl.vocab_parallel_log_probs_and_entropy(cs.t(z, "float64"), torch.tensor(y))
    ref_lp, ref_h = _ref.logprob_entropy(z, y)
    cs.check(lp, ref_lp, "float64", "logprob")
    cs.check(h, ref_h, "float64", "entropy")
    s, _ = cs.sum_pi_squared(z)
    cs.check(dverl.calculate_sum_pi_squared_from_logits(cs.t(z, "float64")), s, "float64", "entropy")


def _verl_problem(world):
    z = cs.logits((3, 4, 8 * world), "float32", seed=18)
    rng = np.random.default_rng(19)
    y = rng.integers(0, 8 * world, size=(3, 4))
    y[0, 0] = -100
    ups = {"logprob": rng.normal(size=(3, 4)).astype(np.float32), "entropy": rng.normal(size=(3, 4)).astype(np.float32)}
    return z, y, ups


def test_tensor_parallel_functions_at_w2_against_the_oracle():
    world = 2
    z, y, ups = _verl_problem(world)
    ranks = run_ranks(cs.verl_ranks, world, z, y, ups, timeout=300, env={"DUALVP_COMPILE": "0"})
    ref_lp, ref_h = _ref.logprob_entropy(z, y)
    zero = np.zeros(y.shape, dtype=np.int64)
    g_lp = _ref.logprob_entropy_grad(z, y, ups["logprob"])
    g_h = _ref.logprob_entropy_grad(z, zero, np.zeros(y.shape), ups["entropy"])
    s_ref, _ = cs.sum_pi_squared(z)
    g_s = cs.sum_pi_squared_grad(z, ups["entropy"])
    v = z.shape[-1] // world
    for r, out in enumerate(ranks):
        cols = slice(r * v, (r + 1) * v)
        h, dt, gh = out["entropy"]
        assert dt == "torch.float32"
        cs.check(h, ref_h, "float32", "entropy")
        cs.check(gh, g_h[..., cols], "float32", "grad")
        lp, dt, gl = out["logprob"]
        cs.check(lp, ref_lp, "float32", "logprob")
        cs.check(gl, g_lp[..., cols], "float32", "grad")
        lp2, h2, g2 = out["both"]
        cs.check(lp2, ref_lp, "float32", "logprob")
        cs.check(h2, ref_h, "float32", "entropy")
        cs.check(g2, g_lp[..., cols] + g_h[..., cols], "float32", "grad")
        s, dt, gs = out["sum_pi_squared"]
        cs.check(s, s_ref, "float32", "entropy")
        cs.check(gs, g_s[..., cols], "float32", "grad")
        assert out["entropy_bf16"][1] == "torch.bfloat16"
        cs.check(out["chunked"], ref_h, "float32", "entropy")
        assert out["bare"] and "tp_group" in out["bare"]


def test_dtensor_logits_are_taken_as_they_are_at_w2():
    world = 2
    z, y, ups = _verl_problem(world)
    y[0, 0] = 3
    ranks = run_ranks(cs.verl_dtensor_ranks, world, z, y, ups, timeout=300, env={"DUALVP_COMPILE": "0"})
    ref_lp, ref_h = _ref.logprob_entropy(z, y)
    s_ref, _ = cs.sum_pi_squared(z)
    zero = np.zeros(y.shape, dtype=np.int64)
    g = (_ref.logprob_entropy_grad(z, y, ups["logprob"])
         + _ref.logprob_entropy_grad(z, zero, np.zeros(y.shape), ups["entropy"])
         + cs.sum_pi_squared_grad(z, ups["logprob"]))
    v = z.shape[-1] // world
    for r, out in enumerate(ranks):
        assert out["types"] == ["Tensor"] * 3  # plain tensors back, as after verl's .full_tensor()
        cs.check(out["logprob"], ref_lp, "float32", "logprob")
        cs.check(out["entropy"], ref_h, "float32", "entropy")
        cs.check(out["sum_pi_squared"], s_ref, "float32", "entropy")
        cs.check(out["grad"], g[..., r * v : (r + 1) * v], "float32", "grad")
