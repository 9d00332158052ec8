"""The logits op's one primitive, the custom-op pair of ``dualvp_torch.library``: eager and under a caller's
``torch.compile(fullgraph=True)``, every engine, against the float64 oracle.

Eager calls and compiled callers run the same ``dualvp::logprob_entropy_fwd`` / ``_bwd`` object, so
both must match the oracle, and each other. Fast tier: the eager and Triton (interpreter) engines on
dynamo's ``aot_eager`` backend (AOTAutograd traces the op's fake and its autograd registration); slow: the
compiled engine, and inductor as the caller's backend.
"""

import contextlib
import os

import numpy as np
import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # (tests/conftest.py sets it where there is no GPU)
torch = pytest.importorskip("torch")

from dualvp.testing import cases, metrics, oracle  # noqa: E402
from dualvp_torch import logprob_entropy  # noqa: E402
from ._custom_op import CALLERS, ENGINES, compiled  # noqa: E402



def _loss_fn(impl, problem):
    c = problem.case
    keep = None if problem.keep_mask is None else torch.from_numpy(problem.keep_mask)
    y = torch.from_numpy(problem.target)
    gl = torch.from_numpy(problem.grad_logprob).float()
    ge = torch.from_numpy(problem.grad_entropy).float()

    def fn(z):
        lp, h = logprob_entropy(z, y, keep_mask=keep, temperature=c.temperature, ignore_index=c.ignore_index,
                                impl=impl)
        return lp, h, (lp * gl).sum() + (h * ge).sum()

    return fn


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize("impl", ENGINES)
def test_eager_and_fullgraph_match_the_oracle(impl, caller):
    p = cases.make(cases.case("nucleus", lead=(2, 3), vocab=72))
    fn = compiled(_loss_fn(impl, p), caller)
    z = torch.tensor(p.logits, dtype=torch.float32, requires_grad=True)
    lp, h, loss = fn(z)
    loss.backward()
    if caller == "eager":  # the op's autograd node is the custom op's
        assert "dualvp_logprob_entropy_fwd" in type(lp.grad_fn).__name__
    ref = oracle(p)
    for q, got in (("logprob", lp), ("entropy", h), ("grad", z.grad)):
        want = getattr(ref, q)
        assert metrics.within_tolerance(got.detach().double().numpy(), want, metrics.tolerance("float32", q)), (
            q, metrics.max_errors(got.detach().double().numpy(), want))


def test_compiled_caller_equals_eager_caller_bit_for_bit():
    """The same op object either way: the compiled caller's outputs and gradient equal the eager caller's."""
    p = cases.make(cases.case("random_mask_temp", lead=(5,), vocab=40))
    outs = []
    for caller in ("eager", "aot_eager"):
        fn = compiled(_loss_fn("eager", p), caller)
        z = torch.tensor(p.logits, dtype=torch.float32, requires_grad=True)
        lp, h, loss = fn(z)
        loss.backward()
        outs.append((lp.detach(), h.detach(), z.grad))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert np.isfinite(outs[0][2].numpy()).all()


@pytest.mark.parametrize("inplace", [False, True], ids=["fresh-grad", "inplace-grad"])
def test_dispatch_modes_see_the_ops_with_the_same_bits(inplace):
    """Eagerly, with only a backend below autograd, the op's autograd node runs its kernels without a second
    trip through the dispatcher (library, "autograd"); under a dispatch mode the ops go through it. Both
    routes: the mode sees the forward and backward ops, and values and gradients are bit for bit equal."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    p = cases.make(cases.case("nucleus", lead=(2, 3), vocab=72))
    keep, y = torch.from_numpy(p.keep_mask), torch.from_numpy(p.target)
    gl = torch.from_numpy(p.grad_logprob).float()
    outs = []
    for mode in (None, Seen()):
        x = torch.tensor(p.logits, dtype=torch.float32, requires_grad=True)
        z = x * 1
        with mode if mode is not None else contextlib.nullcontext():
            lp, h = logprob_entropy(z, y, keep_mask=keep, temperature=0.8, impl="eager", inplace_grad=inplace)
            ((lp * gl).sum() + 0.5 * h.sum()).backward()
        outs.append((lp.detach(), h.detach(), x.grad))
        if mode is not None:
            bwd = "dualvp.logprob_entropy_bwd_.default" if inplace else "dualvp.logprob_entropy_bwd.default"
            assert "dualvp.logprob_entropy_fwd.default" in mode.ops and bwd in mode.ops
    for a, b in zip(*outs):
        assert torch.equal(a, b)
