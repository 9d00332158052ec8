"""``--device cuda`` of ``dualvp verify`` and ``dualvp bench``.

Without CUDA (CI, the development machines) both commands must exit 2 with a
message that says why, before they build a problem or start any process: the
in-process tests replace everything that would start one with a function
that fails the test. With too few GPUs for ``--tp`` (``torch.cuda`` patched
to report one GPU) verify says how many exist and how many it needs.
Tests marked ``cuda`` (skipped without a GPU; ``scripts/gpu-check.sh`` runs
them) run verify on the GPU. The bench's own GPU tests and its timing seams:
``tests/tools/test_bench_cuda.py``.
"""

import os
import subprocess
import sys
import types

import pytest

torch = pytest.importorskip("torch")

from dualvp import testing  # noqa: E402
from dualvp.tools import _proc, cli, verify  # noqa: E402
from dualvp.tools.bench import driver, options  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAVE_CUDA = torch.cuda.is_available()
no_cuda_here = pytest.mark.skipif(HAVE_CUDA, reason="this machine has CUDA: the no-CUDA message cannot appear")


def _env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.fixture
def nothing_starts(monkeypatch):
    """Every way verify and bench start work fails the test instead."""

    def refuse(*a, **k):
        raise AssertionError("started work before the --device check")

    for mod, name in ((_proc, "start_python"), (verify, "start_python"), (verify, "start_jax"),
                      (verify, "problem_for"), (testing, "run"), (testing, "oracle"), (driver, "run_workers"),
                      (options, "_jax_gpu_problem"), (driver, "make_inputs"), (subprocess, "Popen")):
        monkeypatch.setattr(mod, name, refuse)


@no_cuda_here
def test_verify_without_cuda_exits_2_before_anything(nothing_starts, capsys):
    for extra in ([], ["--tp", "1"], ["--op", "linear"]):
        assert cli.main(["verify", "--device", "cuda", *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("dualvp verify: --device cuda: no CUDA device") and "is_available() is False" in err, err


@no_cuda_here
def test_bench_without_cuda_exits_2_before_anything(nothing_starts, tmp_path, capsys):
    out = tmp_path / "b" / "bench.json"
    for extra in (["--quick"], ["--op", "linear"]):
        assert cli.main(["bench", "--device", "cuda", *extra, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("dualvp bench: --device cuda: no CUDA device"), err
    assert not (tmp_path / "b").exists()


def test_verify_with_too_few_gpus_says_how_many(nothing_starts, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cli.main(["verify", "--device", "cuda", "--tp", "4"]) == 2
    err = capsys.readouterr().err
    assert "this machine has 1 GPU(s); --tp 4 needs 4" in err and "NCCL" in err, err
    # the torch backend is the one that runs on the GPU: without it --device cuda is a mistake
    assert cli.main(["verify", "--device", "cuda", "--tp", "1", "--backends", "jax"]) == 2
    assert "--backends jax has no torch" in capsys.readouterr().err


@no_cuda_here
@pytest.mark.slow
def test_cli_without_cuda_fails_fast_in_a_subprocess(tmp_path):
    # `dualvp bench` in a fresh interpreter (torch imported by the check itself). verify asks the same
    # _proc.cuda_problem first; its order is pinned in process by
    # test_verify_without_cuda_exits_2_before_anything, and its fresh process here added no path.
    proc = subprocess.run([sys.executable, "-m", "dualvp", "bench", "--device", "cuda", "--quick", "--out",
                           str(tmp_path / "x.json")], capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "dualvp bench: --device cuda: no CUDA device" in proc.stderr
    assert proc.stdout == "" and not (tmp_path / "x.json").exists()


def test_adapters_refuse_a_device_they_do_not_have():
    prob = verify.problem_for(types.SimpleNamespace(tokens=4, vocab=8, tp=1, dtype="float32", temperature=1.0,
                                                    mask="none", seed=0))
    with pytest.raises(ValueError, match="^device: only the torch backend"):
        testing.run("jax", prob, 1, device="cuda")
    with pytest.raises(ValueError, match="^device: expected 'cpu' or 'cuda'"):
        testing.run("torch", prob, 1, device="tpu")


# --------------------------------------------------------------------------- on a GPU


@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device")
@pytest.mark.parametrize("tp", [1, 2])
def test_verify_on_cuda(tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"--tp {tp} needs {tp} GPUs")
    proc = subprocess.run([sys.executable, "-m", "dualvp", "verify", "--device", "cuda", "--tp", str(tp)],
                          capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    where = "1 GPU, in this process" if tp == 1 else f"{tp} NCCL ranks"
    assert f"device: torch on CUDA ({where})" in proc.stdout, proc.stdout
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("torch vs ")]
    assert len(rows) == 6 and all(ln.rstrip().endswith("PASS") for ln in rows), proc.stdout
    assert proc.stdout.rstrip().endswith("PASS: 12 checks within tolerance")
