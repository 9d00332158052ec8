"""The fused LM-head op on a CUDA device (skipped without one): Triton kernels and the 16-bit tile path.

Run on a GPU machine::

    python -m pytest -q tests/torch/test_linear_triton_cuda.py

Checks: both implementations (``impl="triton"``, ``"compiled"``) against the
float64 oracle on the shared cases and every mode; the precision goals in
bfloat16 at a model-like shape (log-prob and entropy within 1e-4 of float64;
``dh`` and ``dW`` within 2x of the float64 result rounded once to bfloat16);
float32 exact by default even when torch's global TF32 flag is on, and the
``allow_tf32=True`` option; verl's own test shapes and tolerances through the
verl drop-in; peak memory beyond the inputs and gradients.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("triton")

from dualvp.testing import cases, oracle_linear  # noqa: E402
from dualvp.testing.cases import round_to_dtype  # noqa: E402
from dualvp.testing.metrics import (max_errors, rounding_ratio, tolerance, within_rounding,  # noqa: E402
                                    within_tolerance)
from dualvp.testing.modes import MODES  # noqa: E402
from dualvp_torch import linear_logprob_entropy  # noqa: E402
from dualvp_torch.compat import linear_cross_entropy  # noqa: E402

pytestmark = pytest.mark.cuda

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _run(P, impl, *, with_entropy=True, entropy_grad=True, **kw):
    dt = DT[P.case.dtype]
    h = torch.tensor(P.hidden, device="cuda").to(dt).requires_grad_(True)
    w = torch.tensor(P.weight, device="cuda").to(dt).requires_grad_(True)
    keep = None if P.keep_mask is None else torch.tensor(P.keep_mask, device="cuda")
    lp, en = linear_logprob_entropy(h, w, torch.tensor(P.target, device="cuda"), keep_mask=keep,
                                    temperature=P.case.temperature, ignore_index=P.case.ignore_index,
                                    with_entropy=with_entropy, entropy_grad=entropy_grad, impl=impl, **kw)
    loss = (lp * torch.tensor(P.grad_logprob, device="cuda", dtype=lp.dtype)).sum()
    if en is not None and en.requires_grad:
        loss = loss + (en * torch.tensor(P.grad_entropy, device="cuda", dtype=en.dtype)).sum()
    loss.backward()
    return [None if x is None else x.detach().double().cpu().numpy() for x in (lp, en, h.grad, w.grad)]


def _setting(rounding):
    """The tuning of a run: ``None`` the default (asserted ``"fixed"``), else ``gradient_rounding=rounding``."""
    from dualvp_torch import tuning

    if rounding is None:
        assert tuning.DEFAULT.gradient_rounding == "fixed"
        return tuning.DEFAULT
    return tuning.Tuning(gradient_rounding=rounding)


def _failures(out, ref, dtype, entropy=True, rounding=None):
    # 16-bit dh / dW at the default gradient_rounding="fixed" (rounding None): issue 45's rule (max |error|
    # <= 2 x that of the float64 result rounded once); the option "split" and float32: element-wise
    bad = []
    for x, r, q in zip(out, ref, ("logprob", "entropy", "dh", "dW")):
        if q == "entropy" and not entropy:
            continue
        if q in ("dh", "dW") and dtype != "float32" and rounding != "split":
            if not within_rounding(x, r, dtype):
                bad.append(f"{q}: {rounding_ratio(x, r, dtype):.2f}x the rounding of float64")
            continue
        tol = tolerance(dtype, q, r)
        if not within_tolerance(x, r, tol):
            bad.append(f"{q}: {max_errors(x, r)} > {tol}")
    return bad


@pytest.mark.parametrize("rounding", [None, "split"])
@pytest.mark.parametrize("impl", ["triton", "compiled"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_modes_against_the_oracle(impl, mode, dtype, rounding):
    # the default G rounding ("fixed") by issue 45's rule; the option "split" element-wise
    from dualvp_torch import tuning

    m = MODES[mode]
    c = cases.case("basic", lead=(300,), vocab=1001, worlds=(1,), dtype=dtype, temperature=0.8, ignore_frac=0.1,
                   mask="drop_target" if m.masked else "none", seed=7)
    P = cases.make_linear(c, 96)
    with tuning.using(_setting(rounding)):
        out = _run(P, impl, **m.options())
    assert not _failures(out, oracle_linear(P, entropy_grad=m.entropy_grad), dtype, m.with_entropy, rounding)


@pytest.mark.parametrize("impl", ["triton", "compiled"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_split_option_elementwise(impl, dtype):
    # gradient_rounding="split" (G_hi + G_lo, an option) set explicitly: the element-wise 16-bit tolerance
    from dualvp_torch import tuning

    c = cases.case("basic", lead=(300,), vocab=1001, worlds=(1,), dtype=dtype, temperature=0.8, ignore_frac=0.1,
                   mask="drop_target", seed=7)
    P = cases.make_linear(c, 96)
    with tuning.using(tuning.Tuning(gradient_rounding="split")):
        out = _run(P, impl)
    assert not _failures(out, oracle_linear(P), dtype, rounding="split")


@pytest.mark.parametrize("rounding", [None, "split"])
@pytest.mark.parametrize("impl", ["triton", "compiled"])
@pytest.mark.parametrize("name", ["confident_lm_bf16", "nucleus", "temp_0.3", "ignored_masked", "float16"])
def test_shared_cases(impl, name, rounding):
    from dualvp_torch import tuning

    c = cases.case(name)
    c = cases.case(name, lead=(max(1, int(np.prod(c.lead))) * 16,), vocab=c.vocab * 8, worlds=(1,))
    P = cases.make_linear(c, 64)
    with tuning.using(_setting(rounding)):
        out = _run(P, impl)
    assert not _failures(out, oracle_linear(P), c.dtype, rounding=rounding)


@pytest.mark.parametrize("rounding", [None, "split"])
@pytest.mark.parametrize("impl", ["triton", "compiled"])
def test_bfloat16_precision_goals(impl, rounding):
    # the goals: log-prob / entropy <= 1e-4 of float64; dh, dW within 2x of float64 rounded once to bf16
    # (the default "fixed" and the option "split")
    from dualvp_torch import tuning

    c = cases.case("basic", lead=(2048,), vocab=32000, worlds=(1,), dtype="bfloat16", seed=1)
    P = cases.make_linear(c, 512)
    with tuning.using(_setting(rounding)):
        lp, en, dh, dw = _run(P, impl)
    ref = oracle_linear(P)
    assert np.abs(lp - ref.logprob).max() <= 1e-4 and np.abs(en - ref.entropy).max() <= 1e-4
    for x, r, q in ((dh, ref.dh, "dh"), (dw, ref.dW, "dW")):
        err, floor = np.abs(x - r).max(), np.abs(round_to_dtype(r, "bfloat16") - r).max()
        assert err <= 2 * floor, (q, err, floor)


@pytest.mark.parametrize("impl", ["triton", "compiled"])
def test_float32_exact_by_default_and_tf32_option(impl):
    c = cases.case("basic", lead=(512,), vocab=4096, worlds=(1,), seed=2)
    P = cases.make_linear(c, 256)
    ref = oracle_linear(P)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # a caller's global setting must not make the default inexact
    try:
        assert not _failures(_run(P, impl), ref, "float32")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    lp, en, dh, dw = _run(P, impl, allow_tf32=True)  # TF32: ~10-bit products, measured by the bench
    assert np.abs(lp - ref.logprob).max() < 0.5 and np.isfinite(dh).all() and np.isfinite(dw).all()


@pytest.mark.parametrize("impl", ["triton", "compiled"])
def test_memory_beyond_inputs_and_gradients(impl):
    # bfloat16, T=4096, H=1024, V_local=32000: peak extra (forward + backward) beyond the inputs, the returned
    # dh and dW and the float32 dh buffer (the buffer of its all-reduce) stays under 0.1 B (B = T V_local 2 bytes)
    T, H, V = 4096, 1024, 32000
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(T, H, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_(True)
    w = (torch.randn(V, H, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_(True)
    y = torch.randint(0, V, (T,), device="cuda", generator=g)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, en = linear_logprob_entropy(h, w, y, impl=impl)
    (lp.sum() + en.sum()).backward()
    torch.cuda.synchronize()
    B = T * V * 2
    extra = torch.cuda.max_memory_allocated() - base - (h.numel() + w.numel()) * 2 - T * H * 4
    print(f"{impl}: peak extra {extra / B:.3f} B")
    # the tile path: a float32 tile of B / 4 bytes, one 16-bit part of G (B / 8) and product temporaries
    limit = 0.1 if impl == "triton" else 0.5
    assert extra <= limit * B


@pytest.mark.parametrize("impl", ["triton", "compiled"])
@pytest.mark.parametrize("shape", [(1530, 2048, 32256), (2169, 896, 151936)])
def test_verl_shapes_and_tolerances(impl, shape):
    # verl's test_linear_cross_entropy cases 2 and 1: bf16 uniform(-0.5, 0.5) inputs, temperature 1.5, against a
    # float32 torch reference with verl's tolerances, and against float64
    T, H, V = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.empty((1, T, H), dtype=torch.bfloat16, device="cuda").uniform_(-0.5, 0.5, generator=g).requires_grad_()
    w = torch.empty((V, H), dtype=torch.bfloat16, device="cuda").uniform_(-0.5, 0.5, generator=g).requires_grad_()
    y = torch.randint(0, V, (1, T), device="cuda", generator=g)
    g_en = torch.empty((T,), dtype=torch.bfloat16, device="cuda").uniform_(-0.5, 0.5, generator=g)
    g_lp = torch.empty((T,), dtype=torch.bfloat16, device="cuda").uniform_(-1, 1, generator=g)
    lp, en = linear_cross_entropy(h, w, y, 1.5, impl=impl)
    d_h, d_w = torch.autograd.grad((en, lp), (h, w), (g_en, g_lp))
    # float64 reference from the same rounded inputs
    z = (h.double().reshape(T, H) @ w.double().t()) / 1.5
    z.requires_grad_(True)
    logp = torch.log_softmax(z, dim=-1)
    r_lp = logp.gather(1, y.reshape(T, 1)).squeeze(1)
    r_en = -(logp.exp() * logp).sum(-1)
    assert (lp.double() - r_lp).abs().max().item() <= 1e-4
    assert (en.double() - r_en).abs().max().item() <= 1e-4
    (gz,) = torch.autograd.grad((r_en, r_lp), (z,), (g_en.double(), g_lp.double()))
    r_dh = (gz @ w.double()).reshape(1, T, H) / 1.5
    r_dw = (gz.t() @ h.double().reshape(T, H)) / 1.5
    torch.testing.assert_close(d_h.float(), r_dh.float(), atol=2e-2, rtol=4e-2)
    torch.testing.assert_close(d_w.float(), r_dw.float(), atol=2e-2, rtol=4e-2)
    for x, r in ((d_h, r_dh), (d_w, r_dw)):
        err = (x.double() - r).abs().max().item()
        floor = (r.bfloat16().double() - r).abs().max().item()
        assert err <= 2 * floor, (err, floor)
