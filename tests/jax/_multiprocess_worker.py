"""One process of tests/jax/test_multiprocess.py: dualvp_jax under ``jax.distributed``, 2 devices a process.

``python _multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR``: with
``NUM_PROCESSES`` 2 it joins ``jax.distributed`` on ``127.0.0.1:PORT`` (gloo
CPU collectives, jax's default) and runs every case; with 1 (no
``jax.distributed``, 4 host devices) it runs only the numeric cases, the
single-process baseline. The mesh is ``(dp, tp) = (2, 2)`` over the devices in
``jax.devices()`` order: with two processes ``dp`` spans the processes and
``tp`` stays within one. Each process writes ``OUT_DIR/p{id}.json`` (one entry
per case: ``ok``, or the exception's type and message, and the seconds it
took) and ``OUT_DIR/p{id}.npz`` (the outputs it holds, global shape, NaN where
it holds no shard). Every case is self-contained and ends in a result: an
exception in one is recorded and the next runs, except where noted.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np

PROCESS, NUM, PORT, OUT = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

import jax  # noqa: E402

if NUM > 1:
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{PORT}", num_processes=NUM, process_id=PROCESS,
                               initialization_timeout=60, heartbeat_timeout_seconds=10)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import dualvp_jax  # noqa: E402
from dualvp_jax import multiprocess  # noqa: E402

T, V, H = 16, 64, 16  # global rows, vocabulary (V_local = 32 at tp = 2), hidden size
TAU = 0.7
rng = np.random.default_rng(0)
Z = (rng.normal(size=(T, V)) * 3).astype(np.float32)
Y = rng.integers(0, V, size=(T,)).astype(np.int32)
Y[::7] = -100
HID = rng.normal(size=(T, H)).astype(np.float32)
W = (rng.normal(size=(V, H)) * 0.5).astype(np.float32)
GL = rng.normal(size=(T,)).astype(np.float32)
GE = rng.normal(size=(T,)).astype(np.float32)

MESH = Mesh(np.array(jax.devices()).reshape(2, 2), ("dp", "tp"), axis_types=(AxisType.Explicit,) * 2)
results: dict = {}
saved: dict = {}


def put(x, spec, data_of=None):
    """A global array of ``x`` with ``spec`` on MESH; ``data_of(process, x)`` may change this process's copy."""
    local = x if data_of is None else data_of(jax.process_index(), x)
    return jax.make_array_from_callback(x.shape, NamedSharding(MESH, spec), lambda idx: local[idx])


def held(a):
    """The global array with this process's shards filled in, NaN elsewhere."""
    out = np.full(a.shape, np.nan, np.float64)
    for s in a.addressable_shards:
        out[s.index] = np.asarray(s.data, np.float64)
    return out


def case(name, fn):
    t0 = time.time()
    try:
        info = fn() or {}
        results[name] = dict(ok=True, **info)
    except Exception as e:  # noqa: BLE001 - recorded for the test to judge
        results[name] = dict(ok=False, type=type(e).__name__, message=str(e)[:2000],
                             where=traceback.format_exc(limit=3)[-800:])
    results[name]["seconds"] = time.time() - t0


def loss(z, y, gl, ge, temperature=TAU):
    lp, h = dualvp_jax.sharded_logprob_entropy(z, y, MESH, "tp", temperature=temperature)
    return jnp.sum(lp * gl) + jnp.sum(h * ge), (lp, h)


def nan_rows(a):
    """Rows of the 1-D global ``a`` that this process holds, split into NaN and finite."""
    rows = {}
    for s in a.addressable_shards:
        start = s.index[0].start or 0
        for i, v in enumerate(np.asarray(s.data)):
            rows[start + i] = bool(np.isnan(v))
    return dict(nan_rows=sorted(i for i, n in rows.items() if n),
                finite_rows=sorted(i for i, n in rows.items() if not n))


with jax.set_mesh(MESH):
    Z_A, Y_A = put(Z, P("dp", "tp")), put(Y, P("dp"))
    GL_A, GE_A = put(GL, P("dp")), put(GE, P("dp"))

    def dp_target_eager():
        lp, h = dualvp_jax.sharded_logprob_entropy(Z_A, Y_A, MESH, "tp", temperature=TAU)
        saved["eager_lp"], saved["eager_h"] = held(lp), held(h)
        return dict(spec=str(lp.sharding.spec))

    def dp_target_jit():
        (_, (lp, h)), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(Z_A, Y_A, GL_A, GE_A)
        saved["jit_lp"], saved["jit_h"], saved["jit_g"] = held(lp), held(h), held(g)
        return dict(spec=str(lp.sharding.spec))

    def dp_target_jit_closed_over():
        # a closed-over concrete target is checked at trace time on the addressable shards; the
        # lowering may then refuse a closed-over array spanning other processes (JAX's own rule)
        lp, _ = jax.jit(lambda z: dualvp_jax.sharded_logprob_entropy(z, Y_A, MESH, "tp", temperature=TAU))(Z_A)
        saved["jit_closed_lp"] = held(lp)

    def fused_dp_rows():
        h_a, w_a = put(HID, P("dp", None)), put(W, P(None, None))
        lp, ent = dualvp_jax.sharded_linear_logprob_entropy(h_a, w_a, Y_A, MESH, "tp", temperature=TAU)
        rows = sorted({(s.index[0].start or 0, s.index[0].stop or T) for s in lp.addressable_shards})
        saved["fused_lp"], saved["fused_h"] = held(lp), held(ent)

        def f(hh, ww, y, gl, ge):
            lp, ent = dualvp_jax.sharded_linear_logprob_entropy(hh, ww, y, MESH, "tp", temperature=TAU)
            return jnp.sum(lp * gl) + jnp.sum(ent * ge)

        dh, dw = jax.jit(jax.grad(f, argnums=(0, 1)))(h_a, w_a, Y_A, GL_A, GE_A)
        saved["fused_dh"], saved["fused_dw"] = held(dh), held(dw)
        return dict(spec=str(lp.sharding.spec), rows=rows, dh_spec=str(dh.sharding.spec))

    case("dp_target_eager", dp_target_eager)
    case("dp_target_jit", dp_target_jit)
    case("dp_target_jit_closed_over", dp_target_jit_closed_over)
    case("fused_dp_rows", fused_dp_rows)

    if NUM > 1:
        def bad_on_process_1(p, y):
            y = y.copy()
            if p == 1:
                y[T - 2] = V + 5  # a row that process 1 holds (dp block 1) / its copy of a replicated target
            return y

        def bad_dp_target_eager():
            dualvp_jax.sharded_logprob_entropy(Z_A, put(Y, P("dp"), bad_on_process_1), MESH, "tp", temperature=TAU)

        def bad_replicated_target_eager():
            # JAX does not check that the copies of a replicated array agree; the processes still must
            dualvp_jax.sharded_logprob_entropy(Z_A, put(Y, P(None), bad_on_process_1), MESH, "tp", temperature=TAU)

        def bad_dp_target_jit_closed_over():
            y = put(Y, P("dp"), bad_on_process_1)
            jax.jit(lambda z: dualvp_jax.sharded_logprob_entropy(z, y, MESH, "tp", temperature=TAU))(Z_A)

        def bad_dp_target_traced():
            # a traced target cannot raise: NaN rows, computed alike on every process
            (_, (lp, h)) = jax.jit(loss)(Z_A, put(Y, P("dp"), bad_on_process_1), GL_A, GE_A)
            return nan_rows(lp)

        def bad_dp_target_no_validate():
            lp, _ = dualvp_jax.sharded_logprob_entropy(Z_A, put(Y, P("dp"), bad_on_process_1), MESH, "tp",
                                                       temperature=TAU, validate=False)
            return nan_rows(lp)

        def temperature_differs_jit():
            tau = 1.0 if jax.process_index() == 0 else 0.7
            jax.jit(lambda z, y, gl, ge: loss(z, y, gl, ge, temperature=tau))(Z_A, Y_A, GL_A, GE_A)

        def temperature_differs_eager():
            tau = 1.0 if jax.process_index() == 0 else 0.7
            dualvp_jax.sharded_logprob_entropy(Z_A, Y_A, MESH, "tp", temperature=tau)

        def fused_temperature_differs():
            tau = 1.0 if jax.process_index() == 0 else 0.7
            dualvp_jax.sharded_linear_logprob_entropy(put(HID, P("dp", None)), put(W, P(None, None)), Y_A, MESH,
                                                      "tp", temperature=tau)

        def validation_fails_on_process_1():
            # a local argument error on one process: the others raise too instead of entering the op
            y = Y_A if jax.process_index() == 0 else jnp.zeros((T, 2), jnp.int32)
            dualvp_jax.sharded_logprob_entropy(Z_A, y, MESH, "tp", temperature=TAU)

        def valid_after_errors():
            lp, _ = dualvp_jax.sharded_logprob_entropy(Z_A, Y_A, MESH, "tp", temperature=TAU)
            return dict(equal_to_first=bool(np.array_equal(held(lp), saved["eager_lp"], equal_nan=True)))

        def temperature_differs_allgather_path():
            # no coordinator client (as on a runtime without jax.distributed.initialize): process_allgather
            client = multiprocess._client
            multiprocess._client = lambda: None
            try:
                temperature_differs_jit()
            finally:
                multiprocess._client = client

        def row_temperature_dp():
            # a per-row temperature sharded over dp like the rows: each process checks only its own rows
            tau = put(np.full((T,), TAU, np.float32), P("dp"))
            lp, _ = dualvp_jax.sharded_logprob_entropy(Z_A, Y_A, MESH, "tp", temperature=tau)
            return dict(close_to_scalar=bool(np.allclose(held(lp), saved["eager_lp"], rtol=1e-6, atol=1e-6,
                                                         equal_nan=True)))

        def bad_row_temperature_on_process_1():
            def nan_on_1(p, t):
                t = t.copy()
                if p == 1:
                    t[T - 1] = np.nan  # a row process 1 holds
                return t
            tau = put(np.full((T,), TAU, np.float32), P("dp"), nan_on_1)
            dualvp_jax.sharded_logprob_entropy(Z_A, Y_A, MESH, "tp", temperature=tau)

        def process_1_never_arrives():
            # process 1 raises in its own code before the call; process 0 must not hang in the op
            if jax.process_index() == 1:
                raise KeyError("process 1 stops before the call")
            dualvp_jax.sharded_logprob_entropy(Z_A, Y_A, MESH, "tp", temperature=TAU)

        for fn in (bad_dp_target_eager, bad_replicated_target_eager, bad_dp_target_jit_closed_over,
                   bad_dp_target_traced, bad_dp_target_no_validate, temperature_differs_jit,
                   temperature_differs_eager, fused_temperature_differs, validation_fails_on_process_1,
                   valid_after_errors, temperature_differs_allgather_path, row_temperature_dp,
                   bad_row_temperature_on_process_1,
                   process_1_never_arrives):  # last: it leaves the agreement sequence out of step
            case(fn.__name__, fn)

np.savez(os.path.join(OUT, f"p{PROCESS}.npz"), **saved)
with open(os.path.join(OUT, f"p{PROCESS}.json"), "w") as f:
    json.dump(dict(results=results, agreement_timeout=multiprocess.timeout_s()), f, indent=1)
print(f"process {PROCESS}: done", flush=True)
# Stay until every process has written its results (a process that leaves early looks dead to the
# coordinator's heartbeat, which would end the others), then skip jax.distributed's shutdown barrier.
deadline = time.time() + 30
while time.time() < deadline and not all(os.path.exists(os.path.join(OUT, f"p{i}.json")) for i in range(NUM)):
    time.sleep(0.1)
time.sleep(0.5)
os._exit(0)  # skip jax.distributed's shutdown barrier: the test reads the files, and a peer may be gone
