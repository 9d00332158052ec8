"""The logits op on its Triton kernels on a CUDA device (skipped without one).

What the CPU cannot check: the kernels compiled for the GPU on the whole
conformance table (``impl="triton"``, and ``impl=None`` with the Triton
kernels as the CUDA default, fresh and in place), a caller's
``torch.compile(fullgraph=True)`` holding the op with no graph break,
CUDA-graph capture and replay equal to eager, and W = 2 ranks sharing one GPU
over gloo with CUDA tensors (NCCL where two GPUs exist).
Run by ``scripts/gpu-check.sh`` or
``python -m pytest -q -m cuda tests/torch/test_triton_logits_cuda.py``.
"""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 would interpret the kernels; run this module without it", allow_module_level=True)

from dualvp import reference  # noqa: E402
from dualvp.testing import backends, cases, metrics, oracle  # noqa: E402
from dualvp_torch import logprob_entropy, tuning  # noqa: E402
from dualvp_torch.testing import run_ranks  # noqa: E402

pytestmark = pytest.mark.cuda

_DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _np(t):
    return t.detach().double().cpu().numpy()


def _run(p, rank=0, world=1, group=None, impl="triton", inplace=False, dev="cuda"):
    zs, ks = p.shard(rank, world)
    leaf = torch.tensor(zs, device=dev).to(_DT[p.case.dtype]).requires_grad_(True)
    z = leaf * 1 if inplace else leaf
    keep = None if ks is None else torch.tensor(ks, device=dev)
    lp, h = logprob_entropy(z, torch.tensor(p.target, device=dev), group=group, keep_mask=keep,
                            temperature=p.case.temperature, ignore_index=p.case.ignore_index, inplace_grad=inplace,
                            impl=impl)
    torch.autograd.backward([lp, h], [torch.tensor(p.grad_logprob, device=dev, dtype=lp.dtype),
                                      torch.tensor(p.grad_entropy, device=dev, dtype=h.dtype)])
    return _np(lp), _np(h), _np(leaf.grad)


def _failures(p, out) -> list:
    ref = oracle(p)
    return [f"{p.case.name} {q}: {metrics.max_errors(x, getattr(ref, q))}"
            for q, x in zip(("logprob", "entropy", "grad"), out)
            if not metrics.within_tolerance(x, getattr(ref, q), metrics.tolerance(p.case.dtype, q))]


@pytest.mark.parametrize("impl", ["triton", None])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("case", [c for c in cases.CASES if 1 in c.worlds], ids=lambda c: c.name)
def test_case(case, impl, inplace):
    with tuning.using(tuning.Tuning(triton_default_devices={"cuda"})):  # impl=None: the Triton kernels
        assert not _failures(cases.make(case), _run(cases.make(case), impl=impl, inplace=inplace))


@pytest.mark.parametrize("on", [False, True])
def test_default_impl_on_cuda_follows_the_tuning(on, monkeypatch):
    from dualvp_torch import engines, logits_triton

    ran = []
    grad = logits_triton.grad
    monkeypatch.setattr(logits_triton, "grad", lambda *a, **k: ran.append(1) or grad(*a, **k))
    z = torch.randn(4, 32, device="cuda", requires_grad=True)
    with tuning.using(tuning.Tuning(triton_default_devices={"cuda"} if on else ())):
        lp, _ = logprob_entropy(z, torch.tensor([0, 1, 2, 3], device="cuda"))
        assert (engines.select(None, z.device) == "triton") == on
    lp.sum().backward()
    assert bool(ran) == on


@pytest.mark.parametrize("bad", [b for b in cases.BAD_INPUTS if "torch" in b.backends], ids=lambda b: b.name)
def test_bad_input(bad):
    kw = {"impl": "triton", **cases.bad_input_base(), **bad.changes}
    for k, v in list(kw.items()):
        if isinstance(v, (np.ndarray, np.generic)):
            kw[k] = torch.as_tensor(v, device="cuda")
    z = kw.pop("logits")
    with pytest.raises(bad.error) as info:
        logprob_entropy(z, kw.pop("target"), **kw)
    assert f"{bad.arg}:" in str(info.value) and "expected" in str(info.value)


def test_precision_goals():
    """float32, T=64, V=32000: entropy error <= 1e-6, gradient <= 5e-7 against float64 (issue 41's goals)."""
    rng = np.random.default_rng(3)
    T, V = 64, 32000
    z64 = cases.round_to_dtype(rng.normal(0.0, 2.0, (T, V)), "float32")
    y = rng.integers(0, V, T)
    gl, ge = (cases.round_to_dtype(rng.normal(size=T), "float32") for _ in range(2))
    z = torch.tensor(z64, dtype=torch.float32, device="cuda", requires_grad=True)
    lp, h = logprob_entropy(z, torch.tensor(y, device="cuda"), validate=False)
    torch.autograd.backward([lp, h], [torch.tensor(gl, device="cuda").float(), torch.tensor(ge, device="cuda").float()])
    ref_lp, ref_h = reference.logprob_entropy(z64, y)
    ref_g = reference.logprob_entropy_grad(z64, y, gl, ge)
    err = [np.abs(_np(x) - r).max() for x, r in ((lp, ref_lp), (h, ref_h), (z.grad, ref_g))]
    print(f"cuda float32 T={T} V={V}: logprob {err[0]:.2e} entropy {err[1]:.2e} grad {err[2]:.2e}")
    assert err[1] <= 1e-6 and err[2] <= 5e-7


def _loss(z, y, keep, gl, ge):
    lp, h = logprob_entropy(z, y, keep_mask=keep, temperature=0.8, validate=False, impl="triton")
    return (lp * gl).sum() + (h * ge).sum()


@pytest.mark.parametrize("masked", [False, True])
def test_fullgraph_compile_holds_the_op(masked):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    T, V = 96, 5000
    z0 = torch.randn(T, V, device="cuda")
    y = torch.randint(0, V, (T,), device="cuda")
    keep = (torch.rand(T, V, device="cuda") < 0.5) if masked else None
    gl, ge = torch.randn(T, device="cuda"), torch.randn(T, device="cuda")
    grads = []
    for fn in (_loss, torch.compile(_loss, fullgraph=True)):  # fullgraph: a graph break raises
        z = z0.clone().requires_grad_(True)
        loss = fn(z, y, keep, gl, ge)
        loss.backward()
        grads.append((loss.detach(), z.grad))
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert torch.allclose(grads[0][0], grads[1][0], rtol=1e-5)  # the compiled graph sums in its own order
    assert torch.equal(grads[0][1], grads[1][1])  # the same gradient kernel on the same upstream gradients


def test_cuda_graph_capture_and_replay():
    T, V = 128, 6000
    z = torch.randn(T, V, device="cuda", requires_grad=True)
    y = torch.randint(0, V, (T,), device="cuda")
    keep = torch.rand(T, V, device="cuda") < 0.7
    gl, ge = torch.randn(T, device="cuda"), torch.randn(T, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: kernels compiled and cached plans made outside the capture
        for _ in range(2):
            z.grad = None
            _loss(z, y, keep, gl, ge).backward()
    torch.cuda.current_stream().wait_stream(side)
    z.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = _loss(z, y, keep, gl, ge)
        static_loss.backward()
    for seed in range(3):  # new data in the captured buffers, replay, compare with eager
        torch.manual_seed(seed)
        with torch.no_grad():
            z.copy_(torch.randn(T, V, device="cuda") * (seed + 1))
            y.copy_(torch.randint(0, V, (T,), device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        ze = z.detach().clone().requires_grad_(True)
        loss = _loss(ze, y, keep, gl, ge)
        loss.backward()
        assert torch.equal(static_loss, loss.detach()) and torch.equal(z.grad, ze.grad), seed


def _gloo_rank(rank, world, problems):
    """Rank ``rank`` on the one GPU (``cuda:0``), a gloo group carrying CUDA tensors."""
    from dualvp.testing.oracle import Outputs

    group = torch.distributed.group.WORLD
    return [Outputs(*_run(p, rank, world, group)) for p in problems]


@pytest.mark.slow
def test_two_ranks_on_one_gpu_over_gloo():
    probs = [cases.make(c) for c in cases.CASES if 2 in c.worlds]
    outs = backends.merge_ranks(run_ranks(_gloo_rank, 2, probs, timeout=600))
    assert not [f for p, o in zip(probs, outs) for f in _failures(p, tuple(o))]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank")
def test_two_ranks_nccl():
    probs = [cases.make(c) for c in cases.CASES if 2 in c.worlds]
    outs = backends.run_all("torch", probs, 2, impl="triton", device="cuda", timeout=600)
    assert not [f for p, o in zip(probs, outs) for f in _failures(p, tuple(o))]


def _rows_out(z, y, keep, gl, ge):
    z = z.clone().requires_grad_(True)
    lp, h = logprob_entropy(z, y, keep_mask=keep, temperature=0.8, impl="triton", validate=False)
    torch.autograd.backward([lp, h], [gl, ge])
    return lp.detach(), h.detach(), z.grad


@pytest.mark.parametrize("V", [19008, 75968])  # one column split; two (4-byte logits over 65,536 columns)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("keep", [False, True])
def test_batch_invariance_bitwise(V, dtype, keep):
    """A row's results alone and inside T in {7, 64, 1000}: bitwise equal (blocks and splits from V only)."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    n = 1000
    z = (torch.randn(n, V, generator=gen, device="cuda") * 3).to(_DT[dtype])
    y = torch.randint(0, V, (n,), generator=gen, device="cuda")
    y[3] = -100
    k = torch.rand(n, V, generator=gen, device="cuda") < 0.3 if keep else None
    gl, ge = torch.randn(n, generator=gen, device="cuda"), torch.randn(n, generator=gen, device="cuda")
    alone = {r: _rows_out(z[r:r + 1], y[r:r + 1], None if k is None else k[r:r + 1], gl[r:r + 1], ge[r:r + 1])
             for r in (0, 3, 6)}
    for t in (7, 64, 1000):
        batch = _rows_out(z[:t], y[:t], None if k is None else k[:t], gl[:t], ge[:t])
        for r, one in alone.items():
            for a, b in zip(one, batch):
                assert torch.equal(a[0], b[r]), (t, r)


def test_launches_per_forward_and_backward():
    """W = 1, validate=False: 2 kernels per forward + backward (stats writing the outputs, grad), no fill."""
    z = torch.randn(64, 19008, device="cuda", requires_grad=True)
    y = torch.randint(0, 19008, (64,), device="cuda")
    for _ in range(2):  # compiled and cached
        lp, h = logprob_entropy(z, y, impl="triton", validate=False)
        (lp.sum() + h.sum()).backward()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        lp, h = logprob_entropy(z, y, impl="triton", validate=False)
        torch.autograd.backward([lp, h], [torch.ones_like(lp), torch.ones_like(h)])
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ours = [n for n in names if "logits_" in n]
    assert sorted(set(ours)) == ["logits_grad_kernel", "logits_stats_kernel"] and len(ours) == 2, names
