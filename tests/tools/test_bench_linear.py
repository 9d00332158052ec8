"""``dualvp bench --op linear --quick``: every baseline runs and is judged against the float64 oracle.

No timing assertions (machines are noisy); the errors are the independent
check: the fused op is held to the shared tolerances, the baselines are only
reported.
"""

import json

import pytest

pytest.importorskip("torch")

from dualvp.testing import metrics  # noqa: E402
from dualvp.tools import cli  # noqa: E402


def test_bench_linear_quick(tmp_path, capsys):
    out = tmp_path / "linear.json"
    impls = "fused,unfused,unfused-naive,torch-linear-ce"
    rc = cli.main(["bench", "--op", "linear", "--quick", "--dtypes", "float32", "--impls", impls, "--out", str(out)])
    assert rc == 0, capsys.readouterr().out[-2000:]
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    assert set(impls.split(",")) <= set(run)
    for impl in impls.split(","):
        errs = run[impl]["errors_vs_float64"]
        assert set(errs) == ({"logprob", "dh", "dW"} if impl == "torch-linear-ce" else {"logprob", "entropy", "dh", "dW"})
    fused = run["fused"]["errors_vs_float64"]
    for q in ("logprob", "entropy"):
        assert fused[q]["max_abs"] <= metrics.tolerance("float32", q).atol * 10, (q, fused[q])
    for q in ("dh", "dW"):  # relative to the largest entry, as the fused op's tests judge them
        assert fused[q]["max_abs_over_max_ref"] <= 10 * metrics.tolerance("float32", "grad").rtol, (q, fused[q])


def test_bench_linear_rejects_unknown_impl(tmp_path, capsys):
    rc = cli.main(["bench", "--op", "linear", "--quick", "--impls", "fused,nope", "--out", str(tmp_path / "x.json")])
    assert rc == 2 and "nope" in capsys.readouterr().out
