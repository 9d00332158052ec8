"""The extended logits op (``multi_target``, a temperature tensor, ``with_sum_p2``) as its ``torch.library``
custom-op pair (``dualvp::logprob_entropy_ext_fwd`` / ``_bwd`` / ``_bwd_``, :mod:`dualvp_torch.extended`):
eager and under a caller's ``torch.compile(fullgraph=True)`` (no graph break), against the float64 oracle of
:mod:`dualvp.testing.extended`; ``torch.library.opcheck`` of its registrations.

Fast tier: the eager and Triton (interpreter) engines on dynamo's ``aot_eager`` backend (AOTAutograd traces
the op's fake kernel and its autograd registration); slow: the compiled engine, and inductor as the caller's
backend.
"""

import contextlib
import os

import numpy as np
import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # (tests/conftest.py sets it where there is no GPU)
torch = pytest.importorskip("torch")

from dualvp.testing import extended as ext  # noqa: E402
from dualvp_torch import logprob_entropy  # noqa: E402

from . import _ext_ranks  # noqa: E402
from ._custom_op import compiled, fresh, matrix  # noqa: E402

_CASES = ["all_nucleus", "k_masked", "row_tau_only", "p2_only"]


def _loss_fn(prob, impl, ids=False, inplace=False):
    """``fn(x) -> (logprob, entropy, sum_p2 or None, loss)`` on the problem's logits ``x`` (W = 1)."""
    c = prob.case
    _, keep = prob.shard(0, 1)
    cdt = torch.float64 if c.dtype == "float64" else torch.float32
    y = torch.tensor(prob.target)
    tau = torch.tensor(prob.temperature, dtype=cdt) if c.row_temperature else prob.temperature
    kw = {}
    if keep is not None:
        kw = ({"keep_ids": torch.tensor(_ext_ranks.keep_ids_of(prob))} if ids
              else {"keep_mask": torch.tensor(keep)})
    gl = torch.tensor(prob.grad_logprob, dtype=cdt)
    ge = torch.tensor(prob.grad_entropy, dtype=cdt)
    gs = torch.tensor(prob.grad_sum_p2, dtype=cdt) if c.sum_p2 else None

    def fn(x):
        z = x * 1 if inplace else x
        out = logprob_entropy(z, y, temperature=tau, ignore_index=c.ignore_index, multi_target=c.targets > 0,
                              with_sum_p2=c.sum_p2, impl=impl, inplace_grad=inplace, **kw)
        lp, h = out[0], out[1]
        loss = (lp * gl).sum() + (h * ge).sum()
        p2 = None
        if c.sum_p2:
            p2 = out[2]
            loss = loss + (p2 * gs).sum()
        return lp, h, p2, loss

    return fn


def _run(prob, fn):
    x = torch.tensor(prob.shard(0, 1)[0], dtype=torch.float64).to(_ext_ranks._DT[prob.case.dtype])
    x.requires_grad_(True)
    lp, h, p2, loss = fn(x)
    loss.backward()
    return lp, h, p2, x.grad


def _judge(prob, lp, h, p2, g):
    f = lambda a: None if a is None else a.detach().to(torch.float64).numpy()  # noqa: E731
    bad = ext.ext_failures(prob, ext.ExtOutputs(f(lp), f(h), f(g), f(p2)))
    assert not bad, (prob.case.name, bad)


# every case x engine x caller, but the compiled engine on all_nucleus only (_custom_op.matrix): its
# fullgraph callers compile the same variants as the eager caller, and the eager caller's call on the
# compiled engine is test_logits_extended.py::test_extended_w1_all[compiled-*] (every extended case)
@pytest.mark.parametrize("name,impl,caller", matrix(_CASES, compiled_first_case_only=True))
def test_eager_and_fullgraph_match_the_oracle(name, impl, caller):
    prob = ext.make_ext(ext.ext_case(name))
    lp, h, p2, g = _run(prob, compiled(_loss_fn(prob, impl), caller))
    if caller == "eager":  # the op's autograd node is the custom op's
        assert type(lp.grad_fn).__name__ == "dualvp_logprob_entropy_ext_fwdBackward"
    _judge(prob, lp, h, p2, g)


@pytest.mark.parametrize("variant", ["keep_ids", "inplace_grad"])
def test_fullgraph_keep_ids_and_inplace_grad(variant):
    """keep_ids and inplace_grad=True (the in-place backward op in the backward graph) under fullgraph=True."""
    prob = ext.make_ext(ext.ext_case("all_nucleus"))
    fn = _loss_fn(prob, "eager", ids=variant == "keep_ids", inplace=variant == "inplace_grad")
    _judge(prob, *_run(prob, compiled(fn, "aot_eager")))


def test_compiled_caller_equals_eager_caller_bit_for_bit():
    """The same op object either way: the compiled caller's outputs and gradient equal the eager caller's."""
    prob = ext.make_ext(ext.ext_case("all_drop_target"))
    a, b = (_run(prob, compiled(_loss_fn(prob, "eager"), caller)) for caller in ("eager", "aot_eager"))
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert torch.isfinite(a[3]).all()


@pytest.mark.parametrize("inplace", [False, True], ids=["fresh-grad", "inplace-grad"])
def test_dispatch_modes_see_the_ops_with_the_same_bits(inplace):
    """Eagerly the op's autograd node runs its kernels directly; under a dispatch mode the ops go through the
    dispatcher (the bodies check the call again). Both routes: the same bits, and the mode sees both ops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    prob = ext.make_ext(ext.ext_case("all_nucleus"))
    fn = _loss_fn(prob, "eager", inplace=inplace)
    outs = []
    for mode in (None, Seen()):
        with mode if mode is not None else contextlib.nullcontext():
            outs.append(_run(prob, fn))
        if mode is not None:
            bwd = "dualvp.logprob_entropy_ext_bwd_.default" if inplace else "dualvp.logprob_entropy_ext_bwd.default"
            assert "dualvp.logprob_entropy_ext_fwd.default" in mode.ops and bwd in mode.ops, mode.ops
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    _judge(prob, *outs[0])


def test_one_graph_no_break():
    """dynamo's own account: one graph, no break, for every extended option at once."""
    prob = ext.make_ext(ext.ext_case("all_nucleus"))
    x = torch.tensor(prob.shard(0, 1)[0], dtype=torch.float32, requires_grad=True)
    explain = torch._dynamo.explain(fresh(_loss_fn(prob, "eager")))(x)
    assert explain.graph_count == 1 and explain.graph_break_count == 0, explain.break_reasons


def test_temperature_tensor_that_requires_grad_stays_a_constant_under_fullgraph():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(4, 8, generator=g)
    tau = (torch.rand(4, generator=g) + 0.5).requires_grad_(True)
    y = torch.tensor([1, 2, 3, 4])
    fn = torch.compile(lambda z, t: logprob_entropy(z, y, temperature=t, impl="eager"), fullgraph=True,
                       backend="aot_eager")
    lp, _ = fn(z, tau)
    assert not lp.requires_grad
    want = torch.log_softmax(z.double() / tau.detach().double()[:, None], -1).gather(1, y[:, None])[:, 0]
    assert torch.allclose(lp.double(), want, rtol=1e-6, atol=1e-6)


def _opcheck_args(masked: bool, ids: bool, row_tau: bool, k: int, with_sum_p2: bool, with_entropy: bool):
    g = torch.Generator().manual_seed(3)
    t, v = 5, 24
    z = torch.randn(t, v, generator=g, dtype=torch.float64).float().requires_grad_(True)
    y = torch.randint(0, v, (t, k) if k else (t,), generator=g)
    keep = (torch.rand(t, v, generator=g) < 0.5) if masked else None
    kid = torch.randint(-1, v, (t, 3), generator=g) if ids else None
    tau = torch.rand(t, generator=g) + 0.5 if row_tau else None
    return (z, y, keep, tau, "", 0.9, with_entropy, True, -100, True, False, "eager", 0.0, k > 0, with_sum_p2, kid)


@pytest.mark.parametrize("masked,ids,row_tau,k,with_sum_p2,with_entropy", [
    (True, False, True, 2, True, True), (False, False, False, 0, True, True), (False, True, False, 3, False, True),
    (False, False, True, 0, False, False)])
def test_opcheck(masked, ids, row_tau, k, with_sum_p2, with_entropy):
    """torch.library.opcheck: the schema, the fake kernel's shapes and dtypes, the autograd registration and
    AOTAutograd (dynamic shapes) against the op's own eager results."""
    res = torch.library.opcheck(torch.ops.dualvp.logprob_entropy_ext_fwd.default,
                                _opcheck_args(masked, ids, row_tau, k, with_sum_p2, with_entropy))
    assert all(v == "SUCCESS" for v in res.values()), res


def test_fake_shapes_match_the_op():
    """The fake kernel's outputs have the real outputs' shapes and dtypes (incl. the saved statistics)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _opcheck_args(True, False, True, 3, True, True)
    real = torch.ops.dualvp.logprob_entropy_ext_fwd.default(*[a.detach() if isinstance(a, torch.Tensor) else a
                                                             for a in args])
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = torch.ops.dualvp.logprob_entropy_ext_fwd.default(*fake_args)
    assert [(r.shape, r.dtype) for r in real] == [(f.shape, f.dtype) for f in fake]
    assert np.isfinite(real[0].numpy()).all()
