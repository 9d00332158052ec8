"""dualvp_jax under multi-controller JAX: 2 processes x 2 CPU devices joined by ``jax.distributed``.

One launch of ``_multiprocess_worker.py`` as two processes (``jax.distributed``
on 127.0.0.1, gloo CPU collectives, a ``(dp, tp) = (2, 2)`` mesh with ``dp``
across the processes), next to one single-process run of the same numeric
cases on 4 devices. Every subprocess runs under a wall-clock limit, so the
test cannot hang whatever the op does. Checked:

- a target sharded over the process-spanning ``dp`` axis, eager and under
  ``jit``: runs (no host fetch of the global target), bitwise equal to the
  single process, within the float64 oracle's tolerance; closed over under
  ``jit``, dualvp's trace-time check passes and JAX's own lowering rule
  decides (jax 0.10 refuses to close over an array spanning other processes);
- a bad target id on one process (its dp rows, or its copy of a "replicated"
  target), eager or closed over: the same ``ValueError`` on every process,
  well inside 30 s; traced, or ``validate=False``: NaN in that row, no raise;
- a temperature that differs between processes (eager, jit, the fused op,
  and through the ``process_allgather`` fallback): ``RuntimeError`` on every
  process; an argument error on one process: every process raises;
- the fused op keeps the rows sharded over ``dp`` (each process holds only
  its rows of the output) and matches the float64 oracle (values, ``dh``,
  ``dW``);
- a process that never reaches the call: the other raises after the
  agreement timeout instead of hanging.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("jax")

from dualvp import reference  # noqa: E402
from dualvp.testing import metrics  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_multiprocess_worker.py")
LIMIT_S = 150  # per subprocess; a run takes ~20-40 s on 2 loaded cores
AGREEMENT_TIMEOUT_S = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["DUALVP_JAX_AGREEMENT_TIMEOUT"] = str(AGREEMENT_TIMEOUT_S)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # each process compiles its own; no cache shared across runs
    return env


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``(results of process 0, of process 1, saved arrays of 0, of 1, of the single process)``."""
    out = str(tmp_path_factory.mktemp("jax-multiprocess"))
    single = str(tmp_path_factory.mktemp("jax-single"))
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, str(i), "2", str(port), out], env=_env(2), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    procs.append(subprocess.Popen([sys.executable, WORKER, "0", "1", "0", single], env=_env(4), cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    start, logs = time.time(), []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1.0, LIMIT_S - (time.time() - start)))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            logs.append(p.communicate()[0])
            pytest.fail(f"a worker ran past {LIMIT_S} s (a hang); its output:\n{logs[-1][-3000:]}")
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"worker {i} exited {p.returncode}:\n{log[-3000:]}"

    def load(d, i):
        with open(os.path.join(d, f"p{i}.json")) as f:
            res = json.load(f)["results"]
        arrays = dict(np.load(os.path.join(d, f"p{i}.npz")))
        return res, arrays

    (r0, a0), (r1, a1), (_, s) = load(out, 0), load(out, 1), load(single, 0)
    return r0, r1, a0, a1, s


def _merged(a0, a1, name):
    """The global array from the two processes' shards (NaN where a process holds no shard)."""
    x, y = a0[name], a1[name]
    both = ~np.isnan(x) & ~np.isnan(y)
    assert np.array_equal(x[both], y[both]), f"{name}: the processes' replicas differ"
    return np.where(np.isnan(x), y, x)


def _problem():
    """The worker's inputs, rebuilt from its seed (the same NumPy calls)."""
    T, V, H = 16, 64, 16
    rng = np.random.default_rng(0)
    z = (rng.normal(size=(T, V)) * 3).astype(np.float32)
    y = rng.integers(0, V, size=(T,)).astype(np.int32)
    y[::7] = -100
    h = rng.normal(size=(T, H)).astype(np.float32)
    w = (rng.normal(size=(V, H)) * 0.5).astype(np.float32)
    gl = rng.normal(size=(T,)).astype(np.float32)
    ge = rng.normal(size=(T,)).astype(np.float32)
    return z.astype(np.float64), y, h.astype(np.float64), w.astype(np.float64), gl.astype(np.float64), \
        ge.astype(np.float64)


def _within(x, ref, quantity):
    tol = metrics.tolerance("float32", quantity, ref if quantity in ("dh", "dW") else None)
    assert metrics.within_tolerance(x, ref, tol), f"{quantity}: max errors {metrics.max_errors(x, ref)} > {tol}"


def _raised(r, type_name, *, within_s=30.0):
    assert not r["ok"], r
    assert r["type"] == type_name, r
    assert r["seconds"] < within_s, r
    return r["message"]


def test_dp_spanning_target_eager_and_jit_match_one_process_bitwise(run):
    r0, r1, a0, a1, single = run
    for name in ("dp_target_eager", "dp_target_jit"):
        assert r0[name]["ok"] and r1[name]["ok"], (r0[name], r1[name])
        assert "dp" in r0[name]["spec"], r0[name]
    for r in (r0, r1):  # never dualvp's host fetch of the global target (the error before this fix)
        closed = r["dp_target_jit_closed_over"]
        assert closed["ok"] or "Fetching value" not in closed["message"], closed
    z, y, _, _, gl, ge = _problem()
    ref_lp, ref_h = reference.logprob_entropy(z, y, temperature=0.7)
    ref_g = reference.logprob_entropy_grad(z, y, gl, ge, temperature=0.7)
    for name, ref, quantity in (("eager_lp", ref_lp, "logprob"), ("eager_h", ref_h, "entropy"),
                                ("jit_lp", ref_lp, "logprob"), ("jit_h", ref_h, "entropy"),
                                ("jit_g", ref_g, "grad")):
        got = _merged(a0, a1, name)
        assert np.array_equal(got, single[name]), f"{name}: two processes differ from one process"
        _within(got, ref, quantity)


def test_fused_op_keeps_dp_rows_and_matches_oracle(run):
    r0, r1, a0, a1, single = run
    assert r0["fused_dp_rows"]["ok"] and r1["fused_dp_rows"]["ok"], (r0["fused_dp_rows"], r1["fused_dp_rows"])
    assert "dp" in r0["fused_dp_rows"]["spec"] and "dp" in r0["fused_dp_rows"]["dh_spec"], r0["fused_dp_rows"]
    # each process holds its own dp block of rows, not every row
    assert r0["fused_dp_rows"]["rows"] == [[0, 8]] and r1["fused_dp_rows"]["rows"] == [[8, 16]], (r0, r1)
    z, y, h, w, gl, ge = _problem()
    zz = h @ w.T
    ref_lp, ref_h = reference.logprob_entropy(zz, y, temperature=0.7)
    g = reference.logprob_entropy_grad(zz, y, gl, ge, temperature=0.7)
    for name, ref, quantity in (("fused_lp", ref_lp, "logprob"), ("fused_h", ref_h, "entropy"),
                                ("fused_dh", g @ w, "dh"), ("fused_dw", g.T @ h, "dW")):
        got = _merged(a0, a1, name)
        _within(got, ref, quantity)
        assert np.array_equal(got, single[name]), f"{name}: two processes differ from one process"


@pytest.mark.parametrize("name", ["bad_dp_target_eager", "bad_replicated_target_eager",
                                  "bad_dp_target_jit_closed_over"])
def test_bad_target_on_one_process_raises_on_every_process(run, name):
    r0, r1, *_ = run
    m0, m1 = _raised(r0[name], "ValueError"), _raised(r1[name], "ValueError")
    assert m0 == m1 and m0.startswith("target:") and "process 1: 1 id(s), e.g. [69]" in m0, (m0, m1)


@pytest.mark.parametrize("name", ["bad_dp_target_traced", "bad_dp_target_no_validate"])
def test_bad_target_traced_or_unvalidated_gives_nan_row(run, name):
    r0, r1, *_ = run
    assert r0[name]["ok"] and r1[name]["ok"], (r0[name], r1[name])
    assert r0[name]["seconds"] < 30 and r1[name]["seconds"] < 30
    assert r1[name]["nan_rows"] == [14] and r0[name]["nan_rows"] == [], (r0[name], r1[name])
    assert len(r0[name]["finite_rows"]) == 8 and len(r1[name]["finite_rows"]) == 7


@pytest.mark.parametrize("name", ["temperature_differs_jit", "temperature_differs_eager", "fused_temperature_differs",
                                  "temperature_differs_allgather_path"])
def test_differing_temperature_raises_on_every_process(run, name):
    r0, r1, *_ = run
    m0, m1 = _raised(r0[name], "RuntimeError"), _raised(r1[name], "RuntimeError")
    assert m0 == m1, (m0, m1)
    assert "processes disagree on options.temperature (process 0: 1.0, process 1: 0.7); every process raises" in m0


def test_row_temperature_sharded_over_processes(run):
    """A per-row temperature spanning both processes is checked shard by shard (never fetched whole)."""
    r0, r1, *_ = run
    for r in (r0, r1):
        assert r["row_temperature_dp"]["ok"] and r["row_temperature_dp"]["close_to_scalar"], r["row_temperature_dp"]


def test_bad_row_temperature_on_one_process_raises_on_every_process(run):
    r0, r1, *_ = run
    name = "bad_row_temperature_on_process_1"
    m0, m1 = _raised(r0[name], "RuntimeError"), _raised(r1[name], "RuntimeError")
    assert m0 == m1, (m0, m1)
    assert "argument validation failed on process 1" in m0 and "temperature: expected finite values > 0" in m0, m0


def test_argument_error_on_one_process_raises_on_every_process_then_calls_work(run):
    r0, r1, *_ = run
    # the same RuntimeError on both (on process 1 chained from its own ValueError), naming process 1's error
    m0 = _raised(r0["validation_fails_on_process_1"], "RuntimeError")
    m1 = _raised(r1["validation_fails_on_process_1"], "RuntimeError")
    assert m0 == m1 and "argument validation failed on process 1: ValueError: target: expected shape" in m0, m0
    # every error above was raised by every process together: the next call agrees and runs
    assert r0["valid_after_errors"] == dict(r0["valid_after_errors"], ok=True, equal_to_first=True)
    assert r1["valid_after_errors"] == dict(r1["valid_after_errors"], ok=True, equal_to_first=True)


def test_process_that_never_arrives_gives_error_not_hang(run):
    r0, r1, *_ = run
    assert r1["process_1_never_arrives"]["type"] == "KeyError"
    m0 = _raised(r0["process_1_never_arrives"], "RuntimeError")
    assert "not every process" in m0 and r0["process_1_never_arrives"]["seconds"] >= AGREEMENT_TIMEOUT_S, m0
