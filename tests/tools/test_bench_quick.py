"""``dualvp bench --quick`` end to end at a tiny size: the rows it appends to the results file, the W=2 run,
the interleaved run. No timing assertions: machines are noisy; the errors against float64 are the check."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dualvp.tools.bench import results
from dualvp.tools.bench.implementations import MODES

from ._bench_cli import run_bench, worker_here

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _have(mod):
    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False


def _quick_bench(tmp_path, impls, modes, *extra, expect_rc=0, here=None):
    """``dualvp bench --quick`` at 16 x 256; its stdout and the rows of its results file.

    ``here=(capsys, monkeypatch)``: through the CLI's entry point in this process (its workers are
    processes all the same), else as ``python -m dualvp``."""
    csv = tmp_path / "cpu.csv"
    args = ["--quick", "--sizes", "16x256", "--impls", ",".join(impls), "--modes", ",".join(modes),
            "--results", str(csv), *extra]
    if here is not None:
        return run_bench(args, tmp_path, *here, expect_rc=expect_rc), results.read(str(csv))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "dualvp", "bench", *args], capture_output=True, text=True,
                          timeout=540, env=env, cwd=str(tmp_path))
    assert proc.returncode == expect_rc, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, results.read(str(csv))


@pytest.mark.slow
def test_bench_quick_appends_one_row_per_impl_and_mode(tmp_path, capsys, monkeypatch):
    # A torch and a JAX worker (dualvp's eager kernels and dualvp_jax; the compiled stages are held against
    # the oracle by tests/torch), two modes, and the W=2 gloo run of dualvp's eager kernels. One run, with
    # --interleave: the workers' starts (each a torch or JAX process) are the cost, so the interleaved turns
    # are checked on this run rather than on a second one, and the other implementations' loops run in this
    # process (test_worker_loop_of_each_framework_against_the_oracle; torch-eager as a worker process of the
    # command as a process of its own: test_per_impl_workers_make_inputs_in_the_background_and_a_failure_is_a_row).
    # In this process.
    impls = [i for i, m in (("dualvp-torch-eager", "dualvp_torch"), ("dualvp-jax", "dualvp_jax")) if _have(m)]
    if not impls:
        pytest.skip("neither torch nor jax installed")
    modes = ["lp", "lp+ent+grad.keep"]
    out = tmp_path / "run.json"
    stdout, rows = _quick_bench(tmp_path, impls, modes, "--gloo-size", "8x128", "--reps", "3", "--interleave",
                                "--out", str(out), here=(capsys, monkeypatch))
    assert "appended" in stdout and "goal" not in stdout  # figures only
    one = [r for r in rows if r["W"] == "1"]
    assert sorted((r["impl"], r["mode"]) for r in one) == sorted((i, m) for i in impls for m in modes)
    assert len({(r["date"], r["commit"], r["device"], r["versions"]) for r in rows}) == 1
    for r in rows:
        assert r["op"] == "logits" and r["dtype"] == "float32" and r["H"] == ""
        assert r["kernel_ms"] == "" and r["launches"] == ""  # CUDA only
        for k in ("wall_ms", "fwd_ms", "bwd_ms", "host_us", "queued_ms", "peak_extra_B", "floor_ms"):
            assert float(r[k]) >= 0, (k, r)
        # float32 against the float64 oracle: small, and the entropy is reported exactly when computed
        assert float(r["err_logprob"]) < 1e-5 and float(r["err_grad"]) < 1e-5, r
        assert (r["err_entropy"] == "") == (not MODES[r["mode"]].with_entropy), r
    assert all(r["T"] == "16" and r["V_local"] == "256" for r in one)
    if "dualvp-torch-eager" in impls:
        w2 = [r for r in rows if r["W"] == "2"]
        assert sorted(r["mode"] for r in w2) == sorted(modes) and all(r["V_local"] == "128" for r in w2)
        assert "ranks agree: True" in stdout

    # --interleave: the implementations of the case run at once and take turns; their timed calls must
    # alternate one by one and never overlap (each record carries its calls' wall-clock spans). Without
    # the turns the calls would come in one block per implementation.
    doc = json.loads(out.read_text())
    assert doc["failures"] == []
    single = [r for r in doc["results"] if r.get("world", 1) == 1]
    calls = sorted((a, b, r["impl"]) for r in single for a, b in r["spans"])
    assert len(calls) == len(impls) * len(modes) * 3
    for (a0, a1, ia), (b0, b1, ib) in zip(calls, calls[1:]):
        assert a1 <= b0, ("two workers' timed calls overlap", ia, ib)
    order = [i for _, _, i in calls]  # round robin: each implementation once per round, in one order
    n = len(impls)
    assert sorted(order[:n]) == sorted(impls) and order == [order[k % n] for k in range(len(order))], order


@pytest.mark.slow
@pytest.mark.skipif(not _have("dualvp_torch"), reason="needs torch")
def test_interleaved_run_survives_a_worker_that_dies(tmp_path):
    # A worker that fails while the others wait for their turn must not hang the group: its exit ends its
    # turn, the others run to the end, and the failure is reported against its own job.
    from dualvp.tools.bench import driver, procs
    from dualvp.tools.bench.inputs import make_inputs

    ddir = tmp_path / "data"
    driver._save_inputs(str(ddir), make_inputs(8, 64, 0))
    jobs = []
    # two workers (each a torch process): the first needs the turn back twice (reps=2) after the
    # second, which fails on its inputs, has left the group
    impls = ["dualvp-torch-eager", "torch-eager"]
    for i, impl in enumerate(impls):
        out = tmp_path / f"out{i}"
        out.mkdir()
        data = ddir if i != 1 else tmp_path / "missing"  # the second worker fails on its inputs
        case = dict(index=0, T=8, V=64, dtype="float32", data_dir=str(data), out_dir=str(out))
        jobs.append(dict(impl=impl, cases=[case], modes=["lp"], reps=2, warmup=0, loop=1, err_rows=8, options={},
                         port=None, device="cpu"))
    got = []
    errs = procs.run_jobs(jobs, str(tmp_path), 300, lambda rec, job: got.append(job["impl"]), interleave=True)
    assert got == [impls[0]]
    assert [job["impl"] for job, _ in errs] == [impls[1]] and "missing" in errs[0][1], errs


@pytest.mark.slow
@pytest.mark.skipif(not _have("torch"), reason="needs torch")
def test_one_worker_runs_several_cases(tmp_path, capsys, monkeypatch):
    # On a GPU one worker per implementation runs every (size, dtype): each record names its case, and
    # each case's outputs land in its own folder.
    from dualvp.tools.bench import driver
    from dualvp.tools.bench.inputs import make_inputs, round_logits

    cases = []
    for i, (T, V, dtype) in enumerate(((8, 64, "float32"), (4, 32, "bfloat16"))):
        inp = make_inputs(T, V, i)
        inp["logits"] = round_logits(inp["logits"], dtype)
        driver._save_inputs(str(tmp_path / f"data{i}"), inp)
        (tmp_path / f"out{i}").mkdir()
        cases.append(dict(index=i, T=T, V=V, dtype=dtype, data_dir=str(tmp_path / f"data{i}"),
                          out_dir=str(tmp_path / f"out{i}")))
    job = dict(impl="torch-eager", cases=cases, modes=["lp", "lp+ent+grad"], reps=1, warmup=0, loop=1, err_rows=4,
               options={}, port=None, device="cpu")
    got = worker_here(job, capsys, monkeypatch)
    assert [(r["case"], r["mode"], r["dtype"], r["T"]) for r in got] == [
        (0, "lp", "float32", 8), (0, "lp+ent+grad", "float32", 8),
        (1, "lp", "bfloat16", 4), (1, "lp+ent+grad", "bfloat16", 4)]
    for i in (0, 1):
        assert sorted(os.listdir(tmp_path / f"out{i}")) == ["out_0_r0.npz", "out_1_r0.npz"]


# The implementations test_bench_quick_appends_one_row_per_impl_and_mode does not start as workers:
# the JAX baseline, and the in-place one (its gradient is read back from the overwritten logits;
# dualvp's default selection, which compiles on a CPU: in its richest mode only, each mode being a
# compilation of its own), each judged by the bench's own oracle.
@pytest.mark.slow
@pytest.mark.parametrize("impl, module, modes", [("jax-naive", "jax", ("lp", "lp+ent+grad.keep")),
                                                 ("dualvp-torch-inplace", "dualvp_torch", ("lp+ent+grad.keep",))],
                         ids=["jax-naive", "dualvp-torch-inplace"])
def test_worker_loop_of_each_framework_against_the_oracle(tmp_path, capsys, monkeypatch, impl, module, modes):
    if not _have(module):
        pytest.skip(f"needs {module}")
    from dualvp.tools.bench import driver
    from dualvp.tools.bench.inputs import errors, make_inputs

    ddir, odir = tmp_path / "data", tmp_path / "out"
    driver._save_inputs(str(ddir), make_inputs(16, 256, 0))
    odir.mkdir()
    modes = list(modes)
    case = dict(index=0, T=16, V=256, dtype="float32", data_dir=str(ddir), out_dir=str(odir))
    job = dict(impl=impl, cases=[case], modes=modes, reps=1, warmup=0, loop=1, err_rows=16, options={}, port=None,
               device="cpu")
    got = worker_here(job, capsys, monkeypatch)
    assert [(r["impl"], r["mode"], r["T"], r["V_local"]) for r in got] == [(impl, m, 16, 256) for m in modes]
    oracle = driver._saved_oracle(str(ddir), 16)
    for i, m in enumerate(modes):
        with np.load(odir / f"out_{i}_r0.npz") as o:
            e = errors(oracle, m, o["lp"], o["h"], o["g"])
        # float32 against the float64 oracle: small, and the entropy is reported exactly when computed
        assert e["logprob"] < 1e-5 and e["grad"] < 1e-5 and e["grad_rows"] == 16, (m, e)
        assert (e["entropy"] is None) == (not MODES[m].with_entropy) and (e["entropy"] or 0) < 1e-5, (m, e)
        assert all(got[i][k] >= 0 for k in ("wall_ms", "fwd_ms", "bwd_ms")), got[i]


@pytest.mark.slow
@pytest.mark.skipif(not _have("torch"), reason="needs torch")
def test_per_impl_workers_make_inputs_in_the_background_and_a_failure_is_a_row(tmp_path):
    # The GPU's worker layout (one worker per implementation over every case, the inputs made by a
    # background process in order while the workers wait for each case), here on the CPU. A baseline
    # that raises in every call (a slime file whose op is broken) gives a row per case and mode with
    # its error, and the implementation after it still runs.
    slime = tmp_path / "slime_src" / "slime" / "utils"
    slime.mkdir(parents=True)
    (slime / "ppo_utils.py").write_text(
        "def calculate_log_probs_and_entropy(*a, **k):\n    raise RuntimeError('broken on purpose')\n")
    modes = ["lp", "lp+ent+grad"]
    stdout, rows = _quick_bench(tmp_path, ["slime", "torch-eager"], modes, "--sizes", "8x64,16x128",
                                "--dtypes", "float32,bfloat16", "--per-impl-workers", "--worlds", "none",
                                "--slime-path", str(tmp_path / "slime_src"), expect_rc=1)
    cases = [(T, V, d) for T, V in (("8", "64"), ("16", "128")) for d in ("float32", "bfloat16")]
    eager = [(r["T"], r["V_local"], r["dtype"], r["mode"]) for r in rows if r["impl"] == "torch-eager"]
    assert sorted(eager) == sorted(c + (m,) for c in cases for m in modes), stdout
    for r in rows:
        if r["impl"] == "torch-eager":
            assert r["note"] == "" and float(r["err_logprob"]) < (1e-5 if r["dtype"] == "float32" else 0.1), r
    broken = [r for r in rows if r["impl"] == "slime"]
    assert broken and all(r["note"].startswith("error: ") and "broken on purpose" in r["note"] for r in broken)
    assert all(r["wall_ms"] == "" for r in broken)
    assert {(r["T"], r["V_local"], r["dtype"]) for r in broken} <= set(cases)
