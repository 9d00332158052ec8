"""``dualvp bench`` on a GPU (tests marked ``cuda``: skipped without one; ``scripts/gpu-check.sh`` runs them),
and the GPU profile script's plumbing on the CPU.

On a GPU: the logits op's quick run fills the CUDA-only columns (kernel time, launches), W=2 ranks sharing
the one GPU over gloo agree with the float64 oracle, and the linear op's quick run judges its rows.
"""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from dualvp.tools.bench import results  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAVE_CUDA = torch.cuda.is_available()



def _bench(tmp_path, *args, timeout=300, rc=(0,)):
    csv = tmp_path / "cuda.csv"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "dualvp", "bench", "--device", "cuda", *args, "--results", str(csv)],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=str(tmp_path))
    assert proc.returncode in rc, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, results.read(str(csv))


@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device")
def test_bench_quick_on_cuda_fills_the_cuda_columns(tmp_path):
    impls = ["dualvp-torch", "dualvp-torch-inplace", "torch-eager", "liger"]
    stdout, rows = _bench(tmp_path, "--quick", "--sizes", "1024x8192", "--impls", ",".join(impls),
                          "--modes", "lp,lp+ent+grad.keep", rc=(0, 1))
    # Liger (a baseline) may be missing or fail: its row says why; the others must have figures
    assert not [r for r in rows if r["note"] and r["impl"] != "liger"], stdout
    rows = [r for r in rows if not r["note"]]
    ran = {r["impl"] for r in rows}
    assert {"dualvp-torch", "dualvp-torch-inplace", "torch-eager"} <= ran, stdout
    assert all(r["device"] == torch.cuda.get_device_name(0) for r in rows)
    for r in rows:
        for k in ("wall_ms", "kernel_ms", "host_us", "launches", "floor_ms", "peak_extra_B"):
            assert float(r[k]) > 0 or (k == "peak_extra_B" and float(r[k]) >= 0), (k, r)
        assert float(r["err_logprob"]) < 1e-4 and float(r["err_grad"]) < 1e-4, r
    if "liger" in ran:  # log-prob only
        assert {r["mode"] for r in rows if r["impl"] == "liger"} == {"lp"}
    lp = {r["impl"]: r for r in rows if r["mode"] == "lp"}
    assert float(lp["dualvp-torch"]["peak_extra_B"]) < 1.5  # the gradient plus O(T)
    assert float(lp["dualvp-torch-inplace"]["peak_extra_B"]) < 0.5


@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device")
def test_two_ranks_share_one_gpu_over_gloo(tmp_path):
    stdout, rows = _bench(tmp_path, "--quick", "--sizes", "256x4096", "--impls", "dualvp-torch",
                          "--worlds", "2", "--gloo-size", "512x8192", "--modes", "lp,lp+ent+grad,lp+ent+grad.keep")
    w2 = [r for r in rows if r["W"] == "2"]
    assert sorted(r["mode"] for r in w2) == ["lp", "lp+ent+grad", "lp+ent+grad.keep"], stdout
    for r in w2:
        assert r["V_local"] == "8192" and float(r["kernel_ms"]) > 0
        assert float(r["err_logprob"]) < 1e-5 and float(r["err_grad"]) < 1e-5, r
        if r["err_entropy"]:
            assert float(r["err_entropy"]) < 1e-5, r
    assert stdout.count("ranks agree: True") == 3, stdout


@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_CUDA, reason="no CUDA device")
def test_bench_linear_quick_on_cuda(tmp_path):
    # exit 1 when an implementation failed: a baseline's failure is only reported (its row says why);
    # dualvp's own must have figures
    stdout, rows = _bench(tmp_path, "--op", "linear", "--quick", "--dtypes", "float32,bfloat16", rc=(0, 1))
    notes = {(r["impl"], r["dtype"]): r["note"] for r in rows if r["note"]}
    assert not {k: v for k, v in notes.items() if k[0].startswith("dualvp")}, notes
    assert notes.get(("cce", "float32"), "skipped").startswith("skipped"), notes  # 16-bit only
    got = {(r["impl"], r["dtype"]): r for r in rows if not r["note"]}
    assert ("dualvp-fused", "float32") in got and ("dualvp-unfused", "bfloat16") in got, stdout
    for r in got.values():
        assert float(r["kernel_ms"]) > 0 and float(r["launches"]) > 0 and float(r["tflops"]) > 0, r
        assert float(r["err_logprob"]) < 0.1, r  # baselines in bfloat16 are only reported
    assert float(got["dualvp-fused", "float32"]["err_logprob"]) < 1e-4


@pytest.mark.slow
def test_gpu_profile_script_runs_on_cpu(capsys, monkeypatch):
    # benchmarks/gpu_profile.py is a step of scripts/gpu-check.sh: it must not first fail on the GPU machine.
    # Run as __main__ in this process (its imports are this process's: a process of its own would be a
    # torch start-up for nothing the script does differently).
    import runpy

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["gpu_profile.py", "--T", "8", "--V", "64", "--modes", "lp+ent+grad.keep",
                                      "--calls", "1", "--top", "3", "--host", "--impl", "eager"])
    with pytest.raises(SystemExit) as info:
        runpy.run_path(os.path.join(ROOT, "benchmarks", "gpu_profile.py"), run_name="__main__")
    out = capsys.readouterr()
    assert info.value.code == 0, out.out[-3000:] + out.err[-3000:]
    proc = subprocess.CompletedProcess(sys.argv, 0, out.out, out.err)
    heads = [ln for ln in proc.stdout.splitlines() if ln.startswith("== ")]
    assert len(heads) == 1 and heads[0].startswith("== lp+ent+grad.keep") and "x floor" in heads[0], proc.stdout
    assert "host" in heads[0] and "us/call" in heads[0]
    assert "Python calls per call in dualvp's own files" in proc.stdout and "tottime" in proc.stdout, proc.stdout
