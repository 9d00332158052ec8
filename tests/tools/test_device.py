"""``--device cuda`` of ``dualvp verify`` and ``dualvp bench``.

Without CUDA (CI, the development machines) both commands must exit 2 with a
message that says why, before they build a problem or start any process: the
in-process tests replace everything that would start one with a function
that fails the test. With too few GPUs for ``--tp`` (``torch.cuda`` patched
to report one GPU) verify says how many exist and how many it needs. The
bench worker's timing and memory seams are checked with stand-ins.

Tests marked ``cuda`` (skipped without a GPU; ``scripts/gpu-check.sh`` runs
them) run both commands on the GPU in a subprocess and check the exit code,
the table and the JSON fields.
"""

import json
import os
import subprocess
import sys
import types

import pytest

torch = pytest.importorskip("torch")

from dualvp import testing  # noqa: E402
from dualvp.tools import _proc, cli, verify  # noqa: E402
from dualvp.tools.bench import driver, worker  # noqa: E402

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
                      (driver, "_jax_gpu_problem"), (driver, "make_inputs"), (subprocess, "Popen")):
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
@pytest.mark.parametrize("command", ["verify", "bench"])
def test_cli_without_cuda_fails_fast_in_a_subprocess(command, tmp_path):
    extra = ["--quick", "--out", str(tmp_path / "x.json")] if command == "bench" else []
    proc = subprocess.run([sys.executable, "-m", "dualvp", command, "--device", "cuda", *extra],
                          capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"dualvp {command}: --device cuda: no CUDA device" in proc.stderr
    assert proc.stdout == "" and not (tmp_path / "x.json").exists()


def test_adapters_refuse_a_device_they_do_not_have():
    prob = verify.problem_for(types.SimpleNamespace(tokens=4, vocab=8, tp=1, dtype="float32", temperature=1.0,
                                                    mask="none", seed=0))
    with pytest.raises(ValueError, match="^device: only the torch backend"):
        testing.run("jax", prob, 1, device="cuda")
    with pytest.raises(ValueError, match="^device: expected 'cpu' or 'cuda'"):
        testing.run("torch", prob, 1, device="tpu")


def test_measure_syncs_before_every_clock_read_and_reports_unmeasured_memory():
    # the GPU seams of the worker loop, with stand-ins: sync() before each of
    # the 3 clock reads of the first call and of each timed call, none in the
    # warm-up; a memory context whose extra is None gives None, not a number
    log = []
    job = dict(impl="dualvp-torch", dtype="float32", T=4, V=8, reps=3, warmup=2)
    rec, out = worker._measure(job, "lp", lambda: log.append("f") or "out", lambda o: log.append("b"),
                               lambda: None, None, 128, sync=lambda: log.append("s"), peak=worker.NoPeak)
    assert out == "out"
    assert "".join(log) == "sfsbs" + "fb" * 2 + "sfsbs" * 3
    assert rec["peak_extra_bytes"] is None and rec["peak_extra_B"] is None
    assert rec["memory_method"] == worker.NoPeak.method and rec["reps"] == 3


def test_cuda_peak_is_max_allocated_after_minus_allocated_before():
    calls = []
    state = {"allocated": 1000, "peak": 1000}

    def reset():
        calls.append("reset")
        state["peak"] = state["allocated"]

    cuda = types.SimpleNamespace(synchronize=lambda: calls.append("sync"),
                                 memory_allocated=lambda: calls.append("allocated") or state["allocated"],
                                 reset_peak_memory_stats=reset,
                                 max_memory_allocated=lambda: calls.append("max") or state["peak"])
    with worker.CudaPeak(types.SimpleNamespace(cuda=cuda)) as pk:
        state["peak"], state["allocated"] = 1700, 1200  # a transient 700 B, 200 B kept (the gradient)
    assert pk.extra == 700 and pk.method == "cuda-max_memory_allocated"
    assert calls == ["sync", "allocated", "reset", "sync", "max"]


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


@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device")
def test_bench_quick_on_cuda(tmp_path):
    out = tmp_path / "bench.json"
    impls = ["dualvp-torch", "dualvp-torch-inplace", "torch-eager", "jax-naive"]
    modes = ["lp", "lp+ent+grad.keep"]
    proc = subprocess.run([sys.executable, "-m", "dualvp", "bench", "--device", "cuda", "--quick",
                           "--impls", ",".join(impls), "--modes", ",".join(modes), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "skipping the collectives run" in proc.stdout
    doc = json.loads(out.read_text())
    meta = doc["meta"]
    assert meta["device"] == "cuda" and meta["memory_method"] == driver.CUDA_MEMORY_METHOD
    assert meta["machine"]["gpu"], meta["machine"]
    assert doc["failures"] == [] and doc["collectives"] == []
    ran = [i for i in impls if i not in meta["skipped"]]
    if "jax-naive" in meta["skipped"]:  # JAX without a GPU backend: one reason, not a failure
        assert meta["skipped"]["jax-naive"].startswith("jax has no GPU backend"), meta["skipped"]
    assert {(r["impl"], r["mode"]) for r in doc["results"]} == {(i, m) for i in ran for m in modes}
    for r in doc["results"]:
        assert r["device"] == "cuda"
        assert r["errors"]["logprob"] < 1e-3 and r["errors"]["grad"] < 1e-3, r
        if r["impl"] == "jax-naive":
            assert r["peak_extra_B"] is None and r["memory_method"] == worker.NoPeak.method
            continue
        assert r["memory_method"] == "cuda-max_memory_allocated" and r["gpu"] == meta["machine"]["gpu"]
        assert isinstance(r["peak_extra_B"], float) and r["peak_extra_B"] >= 0
        if r["impl"] == "dualvp-torch":
            # the op's claim: the gradient plus O(T) (1 B of 64x2048 float32 = 512 KiB)
            assert r["peak_extra_B"] < 1.5, r


@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device")
def test_bench_linear_quick_on_cuda(tmp_path):
    out = tmp_path / "linear.json"
    proc = subprocess.run([sys.executable, "-m", "dualvp", "bench", "--op", "linear", "--device", "cuda", "--quick",
                           "--dtypes", "float32", "--impls", "fused,unfused,unfused-naive", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["device"] == "cuda" and doc["gpu"], doc
    (run,) = doc["runs"]
    for impl in ("fused", "unfused", "unfused-naive"):
        assert run[impl]["errors_vs_float64"]["logprob"]["max_abs"] < 1e-3, run[impl]
        assert run[impl]["peak_alloc_bytes"] > 0, run[impl]  # from torch.cuda.max_memory_allocated

def test_gpu_profile_script_runs_on_cpu():
    # benchmarks/gpu_profile.py is a step of scripts/gpu-check.sh: it must not first fail on the GPU machine
    # DUALVP_COMPILE=0: the script's plumbing without a compile (the compiled stages have their own tests)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_profile.py"), "--T", "8", "--V", "64",
                           "--modes", "mask", "--calls", "1", "--top", "3", "--host"],
                          capture_output=True, text=True, timeout=300, env=dict(_env(), DUALVP_COMPILE="0"), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    heads = [ln for ln in proc.stdout.splitlines() if ln.startswith("== ")]
    assert [h.split()[1] for h in heads] == ["mask"] and "ms/call" in heads[0], proc.stdout
    assert len(proc.stdout.splitlines()) > len(heads), proc.stdout  # the costliest ops follow the head
    assert "-- host, 1 calls" in proc.stdout and "tottime" in proc.stdout, proc.stdout  # --host: cProfile's table


def test_jax_paths_script_runs_on_cpu():
    # benchmarks/jax_paths.py (a gpu-check step): both forwards of dualvp_jax, the same numbers
    pytest.importorskip("jax")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "jax_paths.py"), "--T", "64", "--V", "256",
                           "--dtypes", "float32", "--modes", "ent", "--reps", "1"],
                          capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("float32")]
    assert "whole" in row and "chunked" in row and float(row.split("max diff")[1]) < 1e-5, row


def test_gpu_precision_script_runs_on_cpu():
    # benchmarks/gpu_precision.py (a gpu-check step): one line per accumulation dtype, errors vs float64
    # eager: the script's plumbing without a compile (the compiled stages have their own tests)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_precision.py"), "--T", "32", "--V", "512",
                           "--reps", "1", "--check-rows", "8", "--impl", "eager"],
                          capture_output=True, text=True, timeout=300, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("row sums in")]
    assert [r.split()[3] for r in rows] == ["float32", "float64"], proc.stdout
    errs = [float(r.split("entropy err")[1].split()[0]) for r in rows]
    assert all(0 <= e < 1e-4 for e in errs), rows
