"""``dualvp bench --op linear --quick``: every baseline that runs here is judged against float64.

No timing assertions (machines are noisy); the errors are the independent check: the fused op is held to
the shared tolerances, the baselines are only reported.
"""

import pytest

pytest.importorskip("torch")

from dualvp.testing import metrics  # noqa: E402
from dualvp.tools import cli  # noqa: E402
from dualvp.tools.bench import results  # noqa: E402


@pytest.mark.slow
def test_bench_linear_quick_appends_rows(tmp_path, capsys, monkeypatch):
    csv = tmp_path / "cpu.csv"
    impls = ["dualvp-fused", "dualvp-unfused", "torch-linear-ce", "cce", "liger-flce", "dualvp-fused-triton"]
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the Triton ones run on a CPU only when interpreted
    rc = cli.main(["bench", "--op", "linear", "--quick", "--dtypes", "float32", "--impls", ",".join(impls),
                   "--results", str(csv)])
    out = capsys.readouterr().out
    assert rc == 0, out[-2000:]
    for skipped in ("cce", "liger-flce", "dualvp-fused-triton"):  # CUDA only
        assert f"skipping {skipped}: runs on cuda only" in out
    rows = {r["impl"]: r for r in results.read(str(csv))}
    assert set(rows) >= {"dualvp-fused", "dualvp-unfused"}
    for name, r in rows.items():
        assert r["op"] == "linear" and (r["T"], r["H"], r["V_local"]) == ("64", "32", "1000")
        assert float(r["tflops"]) > 0 and float(r["wall_ms"]) > 0 and r["err_grad"] == ""
        assert (r["err_entropy"] == "") == (name == "torch-linear-ce"), r
    fused = rows["dualvp-fused"]
    for q in ("logprob", "entropy"):
        assert float(fused[f"err_{q}"]) <= metrics.tolerance("float32", q).atol * 10, fused
    for q in ("dh", "dW"):  # entries of order 1 at this size
        assert float(fused[f"err_{q}"]) <= 1e-4, fused


def test_bench_linear_rejects_unknown_impl(tmp_path, capsys):
    rc = cli.main(["bench", "--op", "linear", "--quick", "--impls", "dualvp-fused,nope", "--results", "none"])
    assert rc == 2 and "nope" in capsys.readouterr().out


def test_linear_bench_failures_are_rows_and_the_loop_goes_on(monkeypatch):
    # The first contact with a GPU lost every bfloat16 row: Cut Cross-Entropy's float32 backward
    # asserted and the bench stopped. Now an implementation that raises anything is a row with its
    # error, cce in float32 a row saying why it is skipped, and the next implementation still runs.
    import torch

    from dualvp.tools.bench import linear
    from dualvp.tools.bench import results as res

    class Boom(Exception):  # not one of the types the old bench caught (like triton's CompilationError)
        pass

    def broken(h, w, y, reduction="none", **_):
        raise Boom("does not compile")

    monkeypatch.setenv("DUALVP_COMPILE", "0")  # dualvp-unfused on the eager kernels: the rows are the point
    _fake_module(monkeypatch, "liger_kernel")
    _fake_module(monkeypatch, "liger_kernel.transformers")
    _fake_module(monkeypatch, "liger_kernel.transformers.functional", liger_fused_linear_cross_entropy=broken)
    got = []
    rows = linear.run_shape(8, 4, 32, torch.float32, ["cce", "liger-flce", "dualvp-unfused"], "cpu",
                            res.environment("cpu"), 1e10, reps=1, warmup=0, loop=1, profiled=0, on_row=got.append)
    assert got == rows and [r["impl"] for r in rows] == ["cce", "liger-flce", "dualvp-unfused"]
    assert rows[0]["note"].startswith("skipped: ") and "16-bit" in rows[0]["note"]
    assert rows[1]["note"] == "error: Boom: does not compile" and rows[1].get("wall_ms") is None
    assert rows[2].get("note") is None and rows[2]["err_logprob"] < 1e-5


def test_linear_bench_runs_bfloat16_first(monkeypatch, tmp_path):
    from dualvp.tools.bench import linear

    seen = []
    monkeypatch.setattr(linear, "run_shape", lambda T, H, V, dtype, *a, **k: seen.append((str(dtype), T)) or [])
    monkeypatch.setattr(linear.timing, "copy_bandwidth", lambda device: 1e10)
    rc = cli.main(["bench", "--op", "linear", "--dtypes", "float32,bfloat16", "--shapes", "4x2x8,6x2x8",
                   "--impls", "torch-linear-ce", "--results", "none"])
    assert rc == 0
    assert seen == [("torch.bfloat16", 4), ("torch.bfloat16", 6), ("torch.float32", 4), ("torch.float32", 6)]


def _fake_module(monkeypatch, name, **attrs):
    import sys
    import types

    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


@pytest.mark.slow
def test_baselines_without_entropy_are_judged_on_their_own_loss(monkeypatch):
    # Stand-ins for Cut Cross-Entropy and Liger's fused linear cross-entropy (plain torch, the real ones
    # need Triton on a GPU): the harness's sign, upstream gradients (per row for CCE, a uniform one for
    # Liger) and oracle choice must make both agree with float64 as closely as the unfused path does.
    import torch

    from dualvp.tools.bench import linear
    from dualvp.tools.bench import results as res

    def ce(h, w, y, reduction="none", **_):
        assert reduction == "none"
        return torch.nn.functional.cross_entropy((h @ w.T).float(), y, reduction="none")

    class OneScale(torch.autograd.Function):  # Liger's backward: every row scaled by grad_output's first entry
        @staticmethod
        def forward(ctx, h, w, y):
            with torch.enable_grad():
                h_, w_ = h.detach().requires_grad_(True), w.detach().requires_grad_(True)
                dh, dw = torch.autograd.grad(ce(h_, w_, y).sum(), (h_, w_))
            ctx.save_for_backward(dh, dw)
            return ce(h, w, y)

        @staticmethod
        def backward(ctx, g):
            dh, dw = ctx.saved_tensors
            return dh * g.reshape(-1)[0], dw * g.reshape(-1)[0], None

    _fake_module(monkeypatch, "cut_cross_entropy", linear_cross_entropy=ce)
    _fake_module(monkeypatch, "liger_kernel")
    _fake_module(monkeypatch, "liger_kernel.transformers")
    _fake_module(monkeypatch, "liger_kernel.transformers.functional",
                 liger_fused_linear_cross_entropy=lambda h, w, y, reduction: OneScale.apply(h, w, y))
    monkeypatch.setattr(linear, "_SKIP", {})  # the stand-in for CCE takes float32
    env = res.environment("cpu")
    rows = {r["impl"]: r for r in linear.run_shape(16, 8, 40, torch.float32, ["cce", "liger-flce", "dualvp-unfused"],
                                                   "cpu", env, 1e10, reps=1, warmup=0, loop=1, profiled=0)}
    for name in ("cce", "liger-flce"):
        r = rows[name]
        assert r["mode"] == "lp" and r["err_entropy"] is None
        for q in ("err_logprob", "err_dh", "err_dW"):
            assert r[q] < 1e-5, (name, q, r[q])
    assert rows["dualvp-unfused"]["err_entropy"] < 1e-5
