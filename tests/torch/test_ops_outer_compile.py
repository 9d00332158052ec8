"""The torch ops and the slime and megatron-core drop-ins inside a caller's ``torch.compile`` (a compiled loss).

Each op is at most one graph break there, run exactly as it runs eagerly: the caller's code before and after
it are the only frames dynamo compiles, and values and gradients are bit-identical to an eager call of the
same function (the caller's graph runs on dynamo's ``eager`` backend here, so nothing else differs).
Traced into instead, the op split into several graphs around its validation and thread pool.
``logprob_entropy`` on plain tensors is no break at all: it enters the caller's graph as the custom ops of
``dualvp_torch.library``, so ``fullgraph=True`` holds it (the tests at the end).
"""

import pytest

torch = pytest.importorskip("torch")

from torch._dynamo.testing import CompileCounter  # noqa: E402

from dualvp.testing import cases  # noqa: E402
from dualvp_torch import compat, linear_logprob_entropy, logprob_entropy  # noqa: E402
from dualvp_torch.testing import run_ranks  # noqa: E402


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


@pytest.mark.parametrize("op", [pytest.param(op, marks=pytest.mark.slow) if op in ("logits", "linear") else op
                                for op in sorted(LOSSES)])  # logits, linear: compile the op's kernels
def test_inside_a_callers_torch_compile(op, monkeypatch):
    if op not in ("logits", "linear"):  # the drop-ins take no impl: on the default (compiled) engine they would
        # compile the op's kernels, which the slow "logits" case holds inside a caller's compile
        monkeypatch.setenv("DUALVP_COMPILE", "0")
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


FULLGRAPH = {  # name: (logits dtype, keyword arguments of the op)
    "mask_temperature": (torch.float32, dict(temperature=0.7, use_keep=True)),
    "no_entropy": (torch.float32, dict(with_entropy=False)),
    "entropy_without_grad": (torch.float32, dict(entropy_grad=False, use_keep=True)),
    "bfloat16_eager_kernels": (torch.bfloat16, dict(impl="eager", temperature=1.3, use_keep=True)),
}


def _fullgraph_loss(x, y, keep, use_keep=False, **kw):
    lp, h = logprob_entropy(x, y, keep_mask=keep if use_keep else None, **kw)
    weights = torch.linspace(0.5, 1.5, lp.shape[-1], dtype=lp.dtype)
    return (lp * weights).sum() + (0.0 if h is None else 0.1 * (h * h).sum())


# the fast tier keeps the eager kernels on dynamo's counter backend (the others compile the op's kernels).
# The slow tier runs every call on aot_eager only: fullgraph=True already raises at a graph break (the
# counter's one frame), and AOTAutograd runs the same graph through the custom ops' registrations.
_FAST_FULLGRAPH = {("bfloat16_eager_kernels", "counter")}


@pytest.mark.parametrize("name,backend", [
    pytest.param(n, b, marks=() if (n, b) in _FAST_FULLGRAPH else pytest.mark.slow)
    for n in sorted(FULLGRAPH) for b in ("counter", "aot_eager") if b == "aot_eager" or (n, b) in _FAST_FULLGRAPH
])
def test_logprob_entropy_in_a_fullgraph_compile(name, backend):
    """``torch.compile(fullgraph=True)`` of a loss around the op: one frame, values and gradients bit for bit.

    ``aot_eager`` runs AOTAutograd, which traces the custom ops' registered backward.
    """
    dtype, kw = FULLGRAPH[name]
    prob = cases.make(cases.case("everything"))  # [3, 4] rows, ignored rows, keep mask, -inf logits
    y, keep = torch.from_numpy(prob.target), torch.from_numpy(prob.keep_mask)
    x0 = torch.from_numpy(prob.logits).to(dtype)

    x = x0.clone().requires_grad_()
    want = _fullgraph_loss(x, y, keep, **kw)
    want.backward()
    counter = CompileCounter()
    xc = x0.clone().requires_grad_()
    got = torch.compile(lambda x: _fullgraph_loss(x, y, keep, **kw), fullgraph=True,
                        backend=counter if backend == "counter" else backend)(xc)
    got.backward()
    assert torch.equal(got, want) and torch.equal(xc.grad, x.grad)
    if backend == "counter":
        assert counter.frame_count == 1


def test_fullgraph_errors_are_the_ops():
    """In the compiled graph the op raises its own errors (at run time); calls it cannot hold are refused."""
    x = torch.randn(4, 10, requires_grad=True)
    bad = torch.tensor([1, 2, 99, 3])
    with pytest.raises(ValueError) as eager:
        logprob_entropy(x, bad)
    with pytest.raises(ValueError) as compiled:
        torch.compile(lambda x: logprob_entropy(x, bad)[0].sum(), fullgraph=True, backend="aot_eager")(x)
    assert str(compiled.value) == str(eager.value) and str(eager.value).startswith("target:")
    # inplace_grad on a leaf that requires grad: the eager call's error, raised by the op in the graph
    y = torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError) as eager:
        logprob_entropy(x, y, inplace_grad=True)
    with pytest.raises(ValueError) as compiled:
        torch.compile(lambda x: logprob_entropy(x, y, inplace_grad=True)[0].sum(), fullgraph=True,
                      backend="aot_eager")(x)
    assert str(compiled.value) == str(eager.value) and str(eager.value).startswith("inplace_grad:")


@pytest.mark.parametrize("backend", ["counter", "aot_eager"])
def test_inplace_grad_in_a_fullgraph_compile(backend):
    """``inplace_grad=True`` holds in ``fullgraph=True``: one frame, values and gradients bit for bit, and
    logits passed into the compiled function hold their gradient after backward, as eagerly; another node
    that saved them raises torch's in-place error, as eagerly."""
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(5, 12, generator=gen)
    y = torch.tensor([0, 3, -100, 11, 7])
    gw = torch.linspace(0.5, 1.5, 5)

    def loss(z):
        lp, h = logprob_entropy(z, y, inplace_grad=True, impl="eager", temperature=0.8)
        return (lp * gw).sum() + 0.1 * (h * h).sum()

    counter = CompileCounter()
    compiled = torch.compile(loss, fullgraph=True, backend=counter if backend == "counter" else backend)
    got = []
    for fn in (loss, compiled):
        x = x0.clone().requires_grad_()
        z = x * 2  # logits made outside the loss: the op overwrites them with their gradient
        value = fn(z)
        value.backward()
        got.append((value.detach(), x.grad, z.detach().clone()))
    (v_e, g_e, z_e), (v_c, g_c, z_c) = got
    assert torch.equal(v_c, v_e) and torch.equal(g_c, g_e) and torch.equal(z_c, z_e)
    assert torch.equal(z_e, g_e / 2)  # z holds dloss/dz, and dloss/dx = 2 dloss/dz
    if backend == "counter":
        assert counter.frame_count == 1
    x = x0.clone().requires_grad_()
    z = x * 2
    saved = z * z  # another node saved z
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (compiled(z) + saved.sum()).backward()


def _fullgraph_ranks(rank, world_size):
    group = torch.distributed.group.WORLD
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(6, 20, generator=gen)  # this rank's shard: rank r holds ids [20 r, 20 r + 20)
    y = torch.randint(0, 20 * world_size, (6,), generator=gen)
    keep = torch.rand(6, 20, generator=gen) < 0.5

    def loss(x):
        lp, h = logprob_entropy(x + 0.5 * rank, y, group=group, keep_mask=keep, temperature=0.7)
        return lp.sum() + 0.1 * h.sum()

    x = x0.clone().requires_grad_()
    want = loss(x)
    want.backward()
    xc = x0.clone().requires_grad_()
    got = torch.compile(loss, fullgraph=True, backend="aot_eager")(xc)
    got.backward()
    return bool(torch.equal(got, want) and torch.equal(xc.grad, x.grad))


@pytest.mark.slow
def test_fullgraph_on_two_ranks():
    """With a process group (passed to the custom op by name), validation and all-gather included.

    The op's eager engine: the caller's graph holds the op as opaque whatever runs inside it (the compiled
    engine at W = 2: tests/cross/test_cross_backends.py; each rank would compile its kernels here)."""
    assert run_ranks(_fullgraph_ranks, 2, timeout=120, env={"DUALVP_COMPILE": "0"}) == [True, True]
