"""The bench's timing helper, results file and plan, with stand-ins (no GPU, no worker processes)."""

import argparse
import csv
import os
import types

import numpy as np
import pytest

from dualvp import reference
from dualvp.tools.bench import implementations as impls_mod
from dualvp.tools.bench import options, results, timing


def test_measure_syncs_around_every_timed_clock_read_and_queues_the_loop():
    # sync() before each of the 3 clock reads of the first call and of each timed call; none inside the
    # warm-up or the queued loop (one sync after the fast step's first call, one when the loop is drained);
    # the snapshot of the last timed call is taken before its clear()
    log = []
    step = (lambda: log.append("f") or len(log), lambda o: log.append("b"))
    fast = (lambda: log.append("F") or "fast", lambda o: log.append("B"))
    rec, kept = timing.measure(step, lambda: log.append("c"), 128, reps=3, warmup=2, loop=4,
                               sync=lambda: log.append("s"), peak=timing.NoPeak, fast_step=fast,
                               snapshot=lambda out: (out, log.append("k")))
    got = "".join(log)
    assert got == "sfsbsc" + "fbc" * 2 + "sfsbs" + "csfsbs" * 2 + "kc" + "FBcs" + "FBc" * 4 + "s", got
    assert kept[0] == got[: got.index("k")].rindex("f") + 1  # what fwd() returned on the last timed call
    assert rec["peak_extra_B"] is None and rec["memory_method"] == timing.NoPeak.method and rec["reps"] == 3
    for k in ("first_ms", "wall_ms", "fwd_ms", "bwd_ms", "host_us", "queued_ms"):
        assert isinstance(rec[k], float) and rec[k] >= 0, (k, rec)
    assert "kernel_ms" not in rec and "launches" not in rec  # CUDA only


def test_measure_counts_collectives_over_one_extra_call():
    class Counter:
        on = False
        n = 0

        def take(self):
            self.n += 1
            return {"count": self.n}

    rec, _ = timing.measure((lambda: 0, lambda o: None), lambda: None, 8, reps=1, loop=1, peak=timing.NoPeak,
                            counter=Counter())
    assert rec["collectives"] == {"fwd": {"count": 1}, "bwd": {"count": 2}}


@pytest.mark.slow
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
    with timing.CudaPeak(types.SimpleNamespace(cuda=cuda)) as pk:
        state["peak"], state["allocated"] = 1700, 1200  # a transient 700 B, 200 B kept (the gradient)
    assert pk.extra == 700 and pk.method == "cuda-max_memory_allocated"
    assert calls == ["sync", "allocated", "reset", "sync", "max"]


@pytest.mark.slow
def test_peak_rss_sees_an_allocation_inside_the_block():
    with timing.PeakRSS() as pk:
        x = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB, touched
        del x
    assert pk.extra >= 48 << 20, pk.extra


def test_floor_is_three_reads_and_writes_plus_the_mask_twice():
    assert timing.floor_ms(1000, 1e6) == pytest.approx(3.0)
    assert timing.floor_ms(1000, 1e6, mask_bytes=250) == pytest.approx(3.5)
    assert timing.copy_bandwidth("cpu", nbytes=1 << 22, reps=2) > 0


def test_results_file_gets_one_header_and_appended_rows(tmp_path):
    path = tmp_path / "sub" / "cpu.csv"
    env = results.environment("cpu")
    assert set(env) == {"date", "commit", "device", "versions"} and "python" in env["versions"]
    assert env["commit"] and " " not in env["commit"]
    results.append(str(path), [dict(env, impl="a", T=4, wall_ms=1.23456789, err_entropy=None)])
    results.append(str(path), [dict(env, impl="b", T=8)])
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == list(results.COLUMNS) and len(rows) == 3
    got = results.read(str(path))
    assert [r["impl"] for r in got] == ["a", "b"] and got[0]["wall_ms"] == "1.235" and got[0]["err_entropy"] == ""
    assert "| a |" in results.markdown(got)



def test_default_results_path_is_not_tracked():
    # a plain `dualvp bench` writes no tracked file: its default is an ignored folder; the tracked
    # results files are written only when --results names them
    import subprocess

    path = results.default_path("cuda")
    assert path == os.path.join("bench-results", "cuda.csv")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run(["git", "check-ignore", "-q", path], cwd=root, capture_output=True)
    if p.returncode == 128:
        pytest.skip("not a git checkout")
    assert p.returncode == 0, f"{path} is not ignored by git"


def test_an_old_results_file_gets_the_note_column(tmp_path):
    # a results file written before `note` existed: its header is widened, its rows kept as they are
    path = tmp_path / "old.csv"
    old = list(results.COLUMNS[:-1])
    path.write_text(",".join(old) + "\r\n" + ",".join("x" if c == "impl" else "" for c in old) + "\r\n")
    results.append(str(path), [dict(impl="new", note="error: E")])
    rows = results.read(str(path))
    assert [r["impl"] for r in rows] == ["x", "new"] and rows[1]["note"] == "error: E"
    assert rows[0].get("note") in (None, "")
    assert path.read_text().splitlines()[0] == ",".join(results.COLUMNS)


def test_results_columns_cover_the_issues_fields():
    need = ("date commit device versions impl op dtype mode T V_local H W wall_ms fwd_ms bwd_ms kernel_ms host_us "
            "launches peak_extra_B floor_ms tflops err_logprob err_entropy err_grad err_dh err_dW").split()
    assert set(need) <= set(results.COLUMNS)


def _args(**kw):
    base = dict(quick=False, device="cpu", sizes=None, dtypes=None, modes=None, impls=None, slime_path=None,
                reps=None, warmup=None, loop=None, worlds=None, gloo_size=None)
    return argparse.Namespace(**{**base, **kw})


def test_plan_defaults_per_device(monkeypatch):
    monkeypatch.setattr(options, "_jax_gpu_problem", lambda: None)
    cpu = options.plan(_args(quick=True))
    assert cpu.sizes == [(64, 2048)] and cpu.dtypes == ["float32"] and cpu.worlds == [2]
    # Triton's: on a CPU only when named (and then only under TRITON_INTERPRET=1)
    assert not {"dualvp-torch-triton", "liger"} & set(cpu.impls)
    assert "dualvp-torch-compiled" not in cpu.impls  # CPU: the same as dualvp-torch; run when named
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    named = options.plan(_args(quick=True, impls="dualvp-torch-triton,liger,torch-eager"))
    assert set(named.skipped) == {"dualvp-torch-triton", "liger"} and named.impls == ["torch-eager"]
    assert named.explicit and all("TRITON_INTERPRET=1" in why for why in named.skipped.values())
    assert cpu.gloo_impls[:1] == ["dualvp-torch-eager"]
    gpu = options.plan(_args(device="cuda"))
    assert gpu.sizes == [(16384, 19008), (4096, 75968), (4096, 32000)]
    assert gpu.modes == ["lp", "lp+ent+grad", "lp+ent+grad.keep"] and gpu.worlds == [] and gpu.reps == 5
    assert "dualvp-torch-compiled" in gpu.impls and "dualvp-torch-triton" not in gpu.skipped
    assert gpu.modes_of("liger") == ["lp"]
    # without --impls the paths that compile with inductor come last (the baselines' rows come first)
    n = len([i for i in gpu.impls if not impls_mod.IMPLS[i].inductor])
    assert all(impls_mod.IMPLS[i].inductor for i in gpu.impls[n:]) and "dualvp-torch" in gpu.impls[n:]
    assert gpu.per_impl_workers and not cpu.per_impl_workers
    order = options.plan(_args(device="cuda", impls="dualvp-torch,torch-eager"))
    assert order.impls == ["dualvp-torch", "torch-eager"]  # named: the order given
    assert options.plan(_args(device="cuda", sizes="none", worlds="2")).sizes == []
    w2 = options.plan(_args(device="cuda", worlds="2"))
    assert w2.worlds == [2] and "dualvp-torch" in w2.gloo_impls and "dualvp-torch-eager" not in w2.gloo_impls
    with pytest.raises(ValueError, match="unknown impl"):
        options.plan(_args(impls="dualvp-torch-hugetlb"))


def test_linear_oracle_matches_the_reference():
    torch = pytest.importorskip("torch")
    from dualvp.tools.bench import linear

    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(10, 6, generator=g), torch.randn(12, 6, generator=g)
    y, gl, ge = torch.randint(0, 12, (10,), generator=g), torch.randn(10, generator=g), torch.randn(10, generator=g)
    lp, en, dh, dw = linear.oracle(h, w, y, gl, ge, rows=4)
    hn, wn = h.double().numpy(), w.double().numpy()
    rlp, ren = reference.linear_logprob_entropy(hn, wn, y.numpy())
    rdh, rdw = reference.linear_logprob_entropy_grad(hn, wn, y.numpy(), gl.double().numpy(), ge.double().numpy())
    for x, r in ((lp, rlp), (en, ren), (dh, rdh), (dw, rdw)):
        np.testing.assert_allclose(x.numpy(), r, rtol=1e-10, atol=1e-12)


def test_round_logits_matches_the_spec_rounding():
    # the bench's fast bfloat16 rounding (uint32 bit arithmetic) equals dualvp.testing's, ties and
    # the largest finite values, infinities and NaN included
    from dualvp.testing import cases
    from dualvp.tools.bench.inputs import round_logits

    rng = np.random.default_rng(0)
    z = (rng.normal(10, 3, size=(300, 77)) * rng.choice([1e-30, 1e-3, 1, 1e3, 1e30], size=(300, 77)))
    z = z.astype(np.float32)
    ties = np.array([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0xFF7FFFFF, 0x00008000, 0x80018000], dtype=np.uint32)
    z[0, : len(ties)] = ties.view(np.float32)
    z[1, :3] = [np.inf, -np.inf, np.nan]
    got = round_logits(z, "bfloat16", chunk=64)
    want = cases.round_to_dtype(z, "bfloat16").astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32)[np.isfinite(z)], want.view(np.uint32)[np.isfinite(z)])
    assert np.isposinf(got[1, 0]) and np.isneginf(got[1, 1]) and np.isnan(got[1, 2])
    assert round_logits(z, "float32") is z
