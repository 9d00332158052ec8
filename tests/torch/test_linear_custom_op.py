"""The fused LM-head op as its ``torch.library`` custom-op pair (``dualvp::linear_logprob_entropy_fwd`` /
``_bwd``, :mod:`dualvp_torch.linear`): eager and under a caller's ``torch.compile(fullgraph=True)`` (no graph
break), against the float64 oracle (``dualvp.reference``); ``torch.library.opcheck`` of its registrations.

Fast tier: the eager and Triton (interpreter) engines on dynamo's ``aot_eager`` backend; slow: the compiled
engine, and inductor as the caller's backend.
"""

import contextlib
import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # (tests/conftest.py sets it where there is no GPU)
torch = pytest.importorskip("torch")

from dualvp import reference  # noqa: E402
from dualvp.testing.metrics import max_errors, tolerance, within_tolerance  # noqa: E402
from dualvp_torch import linear_logprob_entropy  # noqa: E402

from .test_linear import _problem  # noqa: E402
from ._custom_op import compiled, matrix  # noqa: E402



def _loss_fn(p, impl, **kw):
    y = torch.tensor(p["y"])
    keep = None if p["keep"] is None else torch.tensor(p["keep"])
    gl = torch.tensor(p["gl"], dtype=torch.float32)
    ge = torch.tensor(p["ge"], dtype=torch.float32)

    def fn(h, w):
        lp, en = linear_logprob_entropy(h, w, y, keep_mask=keep, temperature=0.7, impl=impl, **kw)
        loss = (lp * gl).sum()
        if en is not None and en.requires_grad:
            loss = loss + (en * ge).sum()
        return lp, en, loss

    return fn


def _run(p, fn, hidden_grad=True, weight_grad=True):
    h = torch.tensor(p["h"], dtype=torch.float32, requires_grad=hidden_grad)
    w = torch.tensor(p["w"], dtype=torch.float32, requires_grad=weight_grad)
    lp, en, loss = fn(h, w)
    loss.backward()
    return lp, en, h.grad, w.grad


def _judge(p, out, entropy_grad=True):
    want_lp, want_en = reference.linear_logprob_entropy(p["h"], p["w"], p["y"], keep_mask=p["keep"], temperature=0.7)
    want_dh, want_dw = reference.linear_logprob_entropy_grad(
        p["h"], p["w"], p["y"], p["gl"], p["ge"] if entropy_grad else None, keep_mask=p["keep"], temperature=0.7)
    for what, got, want in (("logprob", out[0], want_lp), ("entropy", out[1], want_en), ("dh", out[2], want_dh),
                            ("dW", out[3], want_dw)):
        if got is None:
            continue
        x = got.detach().double().numpy()
        tol = tolerance("float32", "dh", want) if what in ("dh", "dW") else tolerance("float32", what)
        assert within_tolerance(x, want, tol), (what, max_errors(x, want))


# every mask x engine x caller, but the compiled engine under the fullgraph callers masked only
# (_custom_op.matrix: unmasked it compiles the same variants as under the eager caller)
@pytest.mark.parametrize("mask,impl,caller", matrix([True, False], ids=["mask", "nomask"]))
def test_eager_and_fullgraph_match_the_oracle(mask, impl, caller):
    p = _problem((2, 5), 8, 40, "float32", mask=mask)
    out = _run(p, compiled(_loss_fn(p, impl), caller))
    if caller == "eager":  # the op's autograd node is the custom op's
        assert type(out[0].grad_fn).__name__ == "dualvp_linear_logprob_entropy_fwdBackward"
    _judge(p, out)


@pytest.mark.parametrize("frozen", ["hidden", "weight"])
def test_fullgraph_frozen_input_and_no_entropy_grad(frozen):
    """One input frozen (its product skipped, its gradient None) and entropy_grad=False, under fullgraph=True."""
    p = _problem((9,), 8, 40, "float32", mask=True)
    fn = compiled(_loss_fn(p, "eager", entropy_grad=False), "aot_eager")
    out = _run(p, fn, hidden_grad=frozen != "hidden", weight_grad=frozen != "weight")
    assert (out[2] is None) == (frozen == "hidden") and (out[3] is None) == (frozen == "weight")
    assert not out[1].requires_grad
    _judge(p, out, entropy_grad=False)


def test_fullgraph_keep_ids():
    p = _problem((9,), 8, 40, "float32", mask=True)
    y = torch.tensor(p["y"])
    ids = torch.tensor([[int(v) for v in row.nonzero()[0][:6]] + [-1] * 2 for row in p["keep"]])
    keep_of_ids = torch.zeros(p["keep"].shape, dtype=torch.bool)
    for r, row in enumerate(ids.tolist()):
        keep_of_ids[r, [i for i in row if i >= 0]] = True
    p = dict(p, keep=keep_of_ids.numpy())
    gl, ge = torch.tensor(p["gl"], dtype=torch.float32), torch.tensor(p["ge"], dtype=torch.float32)

    def fn(h, w):
        lp, en = linear_logprob_entropy(h, w, y, keep_ids=ids, temperature=0.7, impl="eager")
        return lp, en, (lp * gl).sum() + (en * ge).sum()

    _judge(p, _run(p, compiled(fn, "aot_eager")))


def test_compiled_caller_equals_eager_caller_bit_for_bit():
    p = _problem((7,), 8, 40, "float32", mask=True)
    a, b = (_run(p, compiled(_loss_fn(p, "eager"), caller)) for caller in ("eager", "aot_eager"))
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_dispatch_modes_see_the_ops_with_the_same_bits():
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

    p = _problem((7,), 8, 40, "float32", mask=True)
    outs = []
    for mode in (None, Seen()):
        with mode if mode is not None else contextlib.nullcontext():
            outs.append(_run(p, _loss_fn(p, "eager")))
        if mode is not None:
            assert {"dualvp.linear_logprob_entropy_fwd.default",
                    "dualvp.linear_logprob_entropy_bwd.default"} <= set(mode.ops), mode.ops
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    _judge(p, outs[0])


def test_one_graph_no_break():
    p = _problem((7,), 8, 40, "float32", mask=True)
    torch._dynamo.reset()
    h = torch.tensor(p["h"], dtype=torch.float32, requires_grad=True)
    w = torch.tensor(p["w"], dtype=torch.float32, requires_grad=True)
    explain = torch._dynamo.explain(_loss_fn(p, "eager"))(h, w)
    assert explain.graph_count == 1 and explain.graph_break_count == 0, explain.break_reasons


@pytest.mark.parametrize("masked,frozen_weight,budget", [(False, False, None), (True, True, 4096)])
def test_opcheck(masked, frozen_weight, budget):
    """torch.library.opcheck: the schema, the fake kernel, the autograd registration and AOTAutograd."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(6, 8, generator=g, requires_grad=True)
    w = torch.randn(20, 8, generator=g, requires_grad=not frozen_weight)
    y = torch.randint(0, 20, (6,), generator=g)
    keep = (torch.rand(6, 20, generator=g) < 0.5) if masked else None
    args = (h, w, y, keep, "", 0.9, True, True, -100, True, False, budget, "eager", False, True, True,
            not frozen_weight)
    res = torch.library.opcheck(torch.ops.dualvp.linear_logprob_entropy_fwd.default, args)
    assert all(v == "SUCCESS" for v in res.values()), res
