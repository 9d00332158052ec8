"""``dualvp bench --quick`` runs end to end at a tiny size and writes the
expected JSON structure. No timing assertions: machines are noisy."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from dualvp.tools.bench.implementations import MODES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _have(mod):
    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False


def _quick_bench(tmp_path, impls, modes, *extra):
    """``dualvp bench --quick`` at 16 x 256; its stdout and result document."""
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "dualvp", "bench", "--quick", "--sizes", "16x256", "--impls", ",".join(impls),
         "--modes", ",".join(modes), "--out", str(out), *extra],
        capture_output=True, text=True, timeout=540, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


@pytest.mark.slow
def test_bench_quick_writes_json_and_png(tmp_path):
    # Eager implementations (no compile: the compiled kernels are held against
    # the oracle by tests/torch), the in-place one among them (its gradient is
    # read back from the overwritten logits), the donated JAX one (one program
    # per call, on a fresh copy), two modes, W=2 gloo run.
    impls = [i for i, m in (("torch-eager", "torch"), ("jax-naive", "jax"), ("dualvp-torch-eager", "dualvp_torch"),
                            ("dualvp-torch-inplace-eager", "dualvp_torch"), ("dualvp-jax", "dualvp_jax"),
                            ("dualvp-jax-donated", "dualvp_jax"), ("dualvp-jax-recycled", "dualvp_jax"),
                            ("dualvp-jax-hugetlb", "dualvp_jax")) if _have(m)]
    if not impls:
        pytest.skip("neither torch nor jax installed")
    modes = ["lp", "lp+ent+grad.keep"]
    stdout, doc = _quick_bench(tmp_path, impls, modes, "--gloo-size", "8x128")
    assert "goals:" in stdout
    assert set(doc) >= {"meta", "results", "collectives", "summary", "failures"}
    assert doc["failures"] == []
    meta = doc["meta"]
    assert meta["memory_method"] and meta["machine"]["cpus"]
    assert {"transparent_hugepage", "thp_defrag", "page_reporting_order", "glibc_tunables",
            "thp_mem_alloc_enable"} <= set(meta["machine"])
    if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        assert "[" in meta["machine"]["transparent_hugepage"], meta["machine"]
    assert meta["sizes"] == [{"T": 16, "V_local": 256}]
    got = {(r["impl"], r["mode"]) for r in doc["results"]}
    assert got == {(i, m) for i in impls for m in modes}
    for r in doc["results"]:
        assert r["dtype"] == "float32" and r["T"] == 16 and r["V_local"] == 256
        for k in ("fwd_s", "bwd_s", "fwdbwd_s", "mean_fwdbwd_s", "peak_extra_B", "B"):
            assert isinstance(r[k], (int, float)) and r[k] >= 0, (k, r)
        assert set(r["first_call_s"]) == {"fwd", "bwd"}
        assert r["mean_fwdbwd_s"] * r["reps"] == pytest.approx(sum(r["times_fwdbwd_s"]))
        assert isinstance(r["minor_faults_fwdbwd"], (int, float)) and r["minor_faults_fwdbwd"] >= 0, r
        # the *-hugetlb workers are started with the glibc tunable, the others with the parent's environment
        want = "glibc.malloc.hugetlb=1" if r["impl"].endswith("-hugetlb") else os.environ.get("GLIBC_TUNABLES")
        assert r["glibc_tunables"] == want, r
        assert r["B"] == 16 * 256 * 4
        e = r["errors"]
        # float32 against the float64 oracle: small, and the entropy is
        # reported exactly when the mode computes it
        assert e["logprob"] < 1e-3 and e["grad"] < 1e-3
        assert (e["entropy"] is None) == (not MODES[r["mode"]].with_entropy)
    if "dualvp-torch-eager" in impls:
        coll = [c for c in doc["collectives"] if c["impl"] == "dualvp-torch-eager"]
        assert {(c["world"], c["mode"]) for c in coll} == {(2, m) for m in modes}
        for c in coll:
            assert c["ranks_agree"]
            assert c["per_call"]["fwd"]["count"] >= 1 and c["per_call"]["fwd"]["bytes"] > 0
            assert c["errors"]["grad"] < 1e-3
    assert os.path.exists(tmp_path / "bench.png") or not _have("matplotlib")
    assert [g["goal"] for g in doc["summary"]["goals"]]


@pytest.mark.slow
def test_bench_interleave_alternates_the_workers(tmp_path):
    # --interleave: the implementations of a (size, dtype) run at once and
    # take turns; their timed calls must alternate one by one and never
    # overlap (each record carries its calls' wall-clock intervals). Without
    # the turns the calls would come in one block per implementation.
    impls = [i for i, m in (("dualvp-torch-eager", "dualvp_torch"), ("jax-naive", "jax"),
                            ("dualvp-jax", "dualvp_jax")) if _have(m)]
    if len(impls) < 2:
        pytest.skip("needs two of torch / jax")
    modes = ["lp", "lp+ent+grad.keep"]
    _, doc = _quick_bench(tmp_path, impls, modes, "--worlds", "none", "--reps", "3", "--interleave")
    assert doc["failures"] == [] and doc["meta"]["interleave"] is True
    assert "interleaved" in doc["meta"]["timing_method"]
    assert {(r["impl"], r["mode"]) for r in doc["results"]} == {(i, m) for i in impls for m in modes}
    calls = sorted((w0, w1, r["impl"]) for r in doc["results"] for w0, w1 in r["wall_fwdbwd"])
    assert len(calls) == len(impls) * len(modes) * 3
    for (a0, a1, ia), (b0, b1, ib) in zip(calls, calls[1:]):
        assert a1 <= b0, ("two workers' timed calls overlap", ia, ib)
    order = [i for _, _, i in calls]  # round robin: each implementation once per round, in one order
    n = len(impls)
    assert sorted(order[:n]) == sorted(impls) and order == [order[k % n] for k in range(len(order))], order


@pytest.mark.slow
@pytest.mark.skipif(not _have("dualvp_torch"), reason="needs torch")
def test_interleaved_run_survives_a_worker_that_dies(tmp_path):
    # A worker that fails while the others wait for their turn must not hang
    # the group: its exit ends its turn, the others run to the end, and the
    # failure is reported against its own job.
    from dualvp.tools.bench import driver
    from dualvp.tools.bench.inputs import make_inputs

    inp = make_inputs(8, 64, 0)
    ddir = tmp_path / "data"
    driver._save_inputs(str(ddir), inp)
    jobs = []
    impls = ["dualvp-torch-eager", "dualvp-torch-inplace-eager", "torch-eager"]
    for i, impl in enumerate(impls):
        out = tmp_path / f"out{i}"
        out.mkdir()
        data = ddir if i != 1 else tmp_path / "missing"  # the second worker fails on its inputs
        jobs.append(dict(impl=impl, T=8, V=64, dtype="float32", modes=["lp"], reps=2, warmup=0, data_dir=str(data),
                         out_dir=str(out), err_rows=8, options={}, port=None, device="cpu"))
    got = []
    errs = driver._run_jobs(jobs, str(tmp_path), 300, lambda rec, job: got.append(job["impl"]), interleave=True)
    assert sorted(got) == sorted([impls[0], impls[2]])
    assert [job["impl"] for job, _ in errs] == [impls[1]] and "missing" in errs[0][1], errs
