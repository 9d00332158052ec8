"""dualvp_torch.logprob_entropy with K targets per row, a temperature tensor and sum p^2, against the float64
oracle (:data:`dualvp.testing.extended.EXT_CASES`): in process (W = 1) and on W = 2 gloo ranks, with one
statistics all-gather whatever K."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dualvp.testing import cases  # noqa: E402
from dualvp.testing import extended as ext  # noqa: E402
from dualvp_torch import logprob_entropy  # noqa: E402
from dualvp_torch.testing import run_ranks  # noqa: E402

from . import _ext_ranks  # noqa: E402


def _check(prob, outs: list):
    """Join the ranks' gradient shards and judge everything against the oracle."""
    r0 = outs[0]
    joined = ext.ExtOutputs(r0["logprob"], r0["entropy"], np.concatenate([o["grad"] for o in outs], axis=-1),
                            r0["sum_p2"])
    bad = ext.ext_failures(prob, joined)
    assert not bad, (prob.case.name, len(outs), bad)
    for o in outs[1:]:  # identical on every rank
        assert np.array_equal(o["logprob"], r0["logprob"], equal_nan=True)


_W1 = ["all_basic", "all_drop_target", "all_bfloat16", "all_float64", "all_neg_inf_masked", "all_empty", "k1",
       "p2_only", "row_tau_only"]


@pytest.mark.parametrize("name", _W1)
def test_extended_w1_eager(name):
    prob = ext.make_ext(ext.ext_case(name))
    _check(prob, [_ext_ranks.run_case(prob, 0, 1, None, "eager")])


@pytest.mark.slow
@pytest.mark.parametrize("case", ext.EXT_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("impl", ["eager", "compiled"])
def test_extended_w1_all(case, impl):
    prob = ext.make_ext(case)
    _check(prob, [_ext_ranks.run_case(prob, 0, 1, None, impl)])


_W2 = ("all_basic", "all_drop_target", "all_ignored_masked", "all_everything", "k_masked", "row_tau_masked")


@pytest.fixture(scope="module")
def w2():
    return run_ranks(_ext_ranks.rank_suite, 2, _W2, "eager", timeout=300, env={"DUALVP_COMPILE": "0"})


@pytest.mark.slow  # gloo ranks spawned
@pytest.mark.parametrize("name", _W2)
def test_extended_w2_gloo(w2, name):
    _check(ext.make_ext(ext.ext_case(name)), [r["results"][name] for r in w2])


@pytest.mark.slow  # gloo ranks spawned
def test_one_statistics_gather_whatever_k(w2):
    for r in w2:
        c = r["counts"]
        # validate=True: the agreement all-gather and the statistics all-gather; False: the statistics only
        assert c[(1, True)] == c[(8, True)], c
        assert c[(1, False)] == c[(8, False)], c
        assert sum(c[(8, False)].values()) == 1, c
        assert sum(c[(8, True)].values()) == 2, c


@pytest.mark.slow  # gloo ranks spawned
@pytest.mark.parametrize("field", ["targets per row", "with_sum_p2", "temperature tensor"])
def test_ranks_that_disagree_on_the_new_options_raise(w2, field):
    outcomes = [r["disagree"][field] for r in w2]
    assert {o[0] for o in outcomes} == {"RuntimeError"}, outcomes
    assert all(field in o[1] for o in outcomes), outcomes
    assert max(o[2] for o in outcomes) < 10.0, outcomes  # seconds, not a collective timeout


@pytest.mark.parametrize("bad", ext.EXT_BAD_INPUTS, ids=lambda b: b.name)
def test_extended_bad_input_raises(bad):
    from tests.cross.test_bad_inputs import _call

    kw = cases.bad_input_base()
    kw.update(bad.changes)
    with pytest.raises(bad.error) as info:
        _call("torch")(kw)
    msg = str(info.value)
    assert f"{bad.arg}:" in msg and "expected" in msg, msg


def test_default_engine_avoids_triton(monkeypatch):
    # impl="triton" runs these options (tests/torch/test_triton_logits.py); impl=None keeps choosing the spec
    # stages for them until the kernels are measured on a GPU, even where Triton is the default engine
    from dualvp_torch import checks, tuning

    monkeypatch.setenv("DUALVP_COMPILE", "0")  # impl=None: the eager engine, no compile cost here
    z = torch.zeros(3, 8)
    y = torch.zeros(3, 2, dtype=torch.int64)
    with tuning.using(tuning.Tuning(triton_default_devices=frozenset({"cpu"}))):
        assert checks.logits_call(z, y, multi_target=True).engine == "eager"
    lp, _ = logprob_entropy(z, y, multi_target=True)
    assert lp.shape == (3, 2)


def test_temperature_tensor_is_a_constant():
    rng = np.random.default_rng(0)
    z = torch.tensor(rng.normal(size=(4, 8)), dtype=torch.float32)
    tau = torch.tensor([0.5, 1.0, 1.5, 2.0], requires_grad=True)
    lp, h = logprob_entropy(z, torch.tensor([1, 2, 3, 4]), temperature=tau, impl="eager")
    assert not lp.requires_grad  # no gradient flows to the temperature
    for i in (0, 3):
        lpi, _ = logprob_entropy(z[i:i + 1], torch.tensor([i + 1]), temperature=float(tau[i].detach()),
                                 impl="eager")
        assert torch.allclose(lp[i], lpi[0], rtol=1e-6, atol=1e-6)


def test_fused_op_refuses_the_new_options_clearly():
    from dualvp_torch import linear_logprob_entropy

    h, w, y = torch.zeros(3, 4), torch.zeros(8, 4), torch.zeros(3, dtype=torch.int64)
    for kw in ({"multi_target": True}, {"with_sum_p2": True}):
        with pytest.raises(NotImplementedError, match=f"{next(iter(kw))}:"):
            linear_logprob_entropy(h, w, y, impl="eager", **kw)


@pytest.mark.parametrize("impl,masked", [("eager", True), pytest.param("compiled", False, marks=pytest.mark.slow),
                                         pytest.param("compiled", True, marks=pytest.mark.slow)])
def test_batch_invariance_bitwise(impl, masked):
    """K = 3 targets (one repeated, one ignored), a temperature per row, sum p^2: a row's outputs and gradient
    row alone (compiled: the one-row call runs the shared dynamic-T graph) and inside 7 rows, bitwise equal."""
    from dualvp_torch import tuning

    g = torch.Generator().manual_seed(2)
    T, V = 7, 300
    z = torch.randn(T, V, generator=g) * 3
    y = torch.randint(0, V, (T, 3), generator=g)
    y[0, 2], y[2, 1] = y[0, 0], -100
    keep = (torch.rand(T, V, generator=g) < 0.3) if masked else None
    tau = torch.rand(T, generator=g) + 0.5

    def run(rows):
        x = z[rows].clone().requires_grad_(True)
        lp, h, p2 = logprob_entropy(x, y[rows], keep_mask=None if keep is None else keep[rows],
                                    temperature=tau[rows], multi_target=True, with_sum_p2=True, impl=impl)
        (lp.sum() + h.sum() + 0.5 * p2.sum()).backward()
        return lp.detach(), h.detach(), p2.detach(), x.grad

    with tuning.using(tuning.Tuning(max_eager_workers=1)):
        full = run(slice(0, T))
        for i in (0, 2, T - 1):
            one = run(slice(i, i + 1))
            assert all(torch.equal(a[0], b[i]) for a, b in zip(one, full)), i
