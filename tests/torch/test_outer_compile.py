"""The torch ops and the slime and megatron-core drop-ins called inside a caller's ``torch.compile`` (a compiled loss function).

Each op is one graph break there, run exactly as it runs eagerly: the caller's code before and after it
are the only frames dynamo compiles, and values and gradients are bit-identical to an eager call of the
same function (the caller's graph runs on dynamo's ``eager`` backend here, so nothing else differs).
Traced into instead, the op split into several graphs around its validation and thread pool.
"""

import pytest

torch = pytest.importorskip("torch")

from torch._dynamo.testing import CompileCounter  # noqa: E402

from dualvp.testing import cases  # noqa: E402
from dualvp_torch import compat, linear_logprob_entropy, logprob_entropy  # noqa: E402


def _logits_loss(x, y, keep):
    lp, h = logprob_entropy(x, y, keep_mask=keep, temperature=0.7)
    weights = torch.linspace(0.5, 1.5, lp.shape[-1], dtype=lp.dtype)
    return (lp * weights).sum() + 0.1 * h.sum()


def _linear_loss(x, y, keep, weight):
    lp, h = linear_logprob_entropy(x, weight, y, keep_mask=keep, temperature=0.7)
    weights = torch.linspace(0.5, 1.5, lp.shape[-1], dtype=lp.dtype)
    return (lp * weights).sum() + 0.1 * h.sum()


def _slime_loss(x, y, keep):
    # slime's [T, V] call; its rows are the case's rows, flattened
    lp, h = compat.calculate_log_probs_and_entropy(
        x.reshape(-1, x.shape[-1]), y.reshape(-1), None, with_entropy=True,
        log_prob_keep_mask=keep.reshape(-1, keep.shape[-1]),
    )
    weights = torch.linspace(0.5, 1.5, lp.shape[0], dtype=lp.dtype)
    return (lp[:, 0] * weights).sum() + 0.1 * h.sum()


def _megatron_loss(x, y, keep, smoothing=0.0):
    # megatron-core's per-token loss (the keep mask is not one of its arguments)
    loss = compat.vocab_parallel_cross_entropy(x, y, smoothing)
    weights = torch.linspace(0.5, 1.5, loss.shape[-1], dtype=loss.dtype)
    return (loss * weights).sum()


def _megatron_smoothed_loss(x, y, keep):
    return _megatron_loss(x, y, keep, smoothing=0.1)


LOSSES = {"logits": _logits_loss, "linear": _linear_loss, "slime": _slime_loss, "megatron": _megatron_loss,
          "megatron-smoothed": _megatron_smoothed_loss}


@pytest.mark.parametrize("op", sorted(LOSSES))
def test_inside_a_callers_torch_compile(op):
    prob = cases.make(cases.case("everything"))  # [3, 4] rows, ignored rows, keep mask, -inf logits
    y, keep = torch.from_numpy(prob.target), torch.from_numpy(prob.keep_mask)
    gen = torch.Generator().manual_seed(0)
    if op != "linear":
        x0, extra = torch.from_numpy(prob.logits).float(), ()
    else:
        x0, extra = torch.randn(*y.shape, 16, generator=gen), (torch.randn(prob.logits.shape[-1], 16, generator=gen),)
    loss = LOSSES[op]

    x = x0.clone().requires_grad_()
    loss(x, y, keep, *extra).backward()
    counter = CompileCounter()
    xc = x0.clone().requires_grad_()
    value = torch.compile(loss, backend=counter)(xc, y, keep, *extra)
    value.backward()

    assert torch.equal(value, loss(x0, y, keep, *extra))
    assert torch.equal(xc.grad, x.grad)
    # the caller's frame, split once at the op: the code before it and the code after it
    assert counter.frame_count <= 2, counter.frame_count
