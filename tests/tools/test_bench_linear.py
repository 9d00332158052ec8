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
def test_bench_linear_quick_appends_rows(tmp_path, capsys):
    csv = tmp_path / "cpu.csv"
    impls = ["dualvp-fused", "dualvp-unfused", "torch-linear-ce", "cce", "liger-flce", "dualvp-fused-triton"]
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
