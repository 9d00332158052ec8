"""Batch invariance and determinism of every engine on the CPU.

A row's log-prob, entropy and gradient row must be bitwise the same whether
the row is computed alone (T = 1) or inside a call of T = 7, 64 and, on the wider tables, a
few hundred rows (torch: 200; JAX: several row chunks, the last overlapping) at a random
position among random other rows, and the same from run to run (docs/decisions.md,
"Batch invariance: one reduction order per row"). The reference is the engine
itself on the row alone: bitwise equality to another formulation is not the
property (agreement with the float64 oracle is checked elsewhere, within
TOLERANCES). The gradient is taken with a random upstream gradient per row, so
it depends on the entropy's statistics as well.

Tables: V_local = 300 and 1000 float32 without a mask, and V_local = 4099 bfloat16
with a keep mask, one of whose checked rows keeps no column within
``spec.KEPT_GAP`` of its max (the CPU's masked statistics recompute that row:
``redo_marked_rows`` in torch, the ``lax.cond`` pass in JAX); temperatures
0.7 and 1.3.
"""

from __future__ import annotations

import numpy as np
import pytest

from dualvp import spec

CHECKED = 3  #: rows checked per table: computed alone, then placed at random positions
N_OTHER = 1000  #: other rows the calls draw from
TS = (7, 64, 1000)

TABLES = {
    # V_local = 300: a 13-row [T, 300] block is below XLA:CPU's 4096-element switch to its YNNPACK reduction,
    # a 16-row one above it (JAX's former failure: gradient 1 ulp apart, T = 64 vs alone)
    "V300-f32": dict(v=300, dtype="float32", keep=False, tau=0.7),
    "V1000-f32": dict(v=1000, dtype="float32", keep=False, tau=0.7),
    "V4099-bf16-keep": dict(v=4099, dtype="bfloat16", keep=True, tau=1.3),
}


def _round_bf16(x: np.ndarray) -> np.ndarray:
    # float32 values exactly representable in bfloat16 (round to nearest even), so every backend gets the same input
    b = x.astype(np.float32).view(np.uint32)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.view(np.float32)


def make_table(v: int, dtype: str, keep: bool, tau: float, n_other: int = N_OTHER, seed: int = 49) -> dict:
    rng = np.random.default_rng(seed)
    n = CHECKED + n_other
    z = (rng.standard_normal((n, v)) * 3).astype(np.float32)
    y = rng.integers(0, v, n).astype(np.int64)
    k = None
    if keep:
        k = rng.random((n, v)) < 0.5
        # row 0 keeps nothing within KEPT_GAP temperature units of its max: a marked row
        c = (int(y[0]) + 1) % v
        z[0, c] = 3 * spec.KEPT_GAP * tau
        k[0, c] = False
    if dtype == "bfloat16":
        z = _round_bf16(z)
    gl = rng.standard_normal(n).astype(np.float32)
    ge = rng.standard_normal(n).astype(np.float32)
    return dict(z=z, y=y, keep=k, gl=gl, ge=ge, tau=tau, dtype=dtype, v=v, n_other=n_other)


def placement(T: int, rng, n_other: int = N_OTHER) -> tuple[np.ndarray, np.ndarray]:
    """Rows of a T-row call: the checked rows at random positions ``pos``, random other rows elsewhere."""
    idx = CHECKED + rng.choice(n_other, size=T, replace=False)
    pos = rng.choice(T, size=min(T, CHECKED), replace=False)
    idx[pos] = np.arange(len(pos))
    return idx, pos


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.float32)
    return a.view(np.uint32)


def _describe(a: np.ndarray, b: np.ndarray) -> str:
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return f"max |diff| {d.max():.3g} at {np.unravel_index(int(d.argmax()), d.shape)}"


NAMES = ("log-prob", "entropy", "gradient row")


def check_invariance(run, table: dict, ts=TS, seed: int = 0, again: bool = True) -> None:
    """``run(idx) -> (logprob [T], entropy [T], grad [T, V])`` as float32 NumPy arrays (exact conversions).

    ``again``: also run the last call a second time and compare every row (run-to-run determinism)."""
    rng = np.random.default_rng(seed)
    alone = [run(np.array([r])) for r in range(CHECKED)]
    for T in ts:
        idx, pos = placement(T, rng, table["n_other"])
        out = run(idx)
        for r, p in enumerate(pos):
            for name, a, b in zip(NAMES, alone[r], out):
                assert np.array_equal(_bits(a[0]), _bits(b[p])), (
                    f"row {r} alone vs at position {p} of T={T}: {name} differs, {_describe(a[0], b[p])}")
    if not again:
        return
    again = run(idx)
    for name, a, b in zip(NAMES, out, again):
        assert np.array_equal(_bits(a), _bits(b)), f"two runs at T={ts[-1]}: {name} differs, {_describe(a, b)}"


# --- torch -------------------------------------------------------------------------------


def _torch_runner(table: dict, impl: str):
    import torch

    from dualvp_torch import logprob_entropy

    dt = getattr(torch, table["dtype"])
    z_all = torch.from_numpy(table["z"]).to(dt)
    k_all = None if table["keep"] is None else torch.from_numpy(table["keep"])
    y_all, gl_all, ge_all = (torch.from_numpy(table[k]) for k in ("y", "gl", "ge"))

    def run(idx):
        i = torch.from_numpy(idx)
        z = z_all[i].clone().requires_grad_(True)
        lp, h = logprob_entropy(z, y_all[i], keep_mask=None if k_all is None else k_all[i],
                                temperature=table["tau"], impl=impl)
        torch.autograd.backward([lp, h], [gl_all[i], ge_all[i]])
        return lp.detach().float().numpy(), h.detach().float().numpy(), z.grad.float().numpy()

    return run


# torch: T = 200 rather than the 1000 rows once run. On the eager engine it reaches what T = 1000 did: a shard above
# eager.SMALL_SHARD_ELEMENTS, cut by the budget into multi-row chunks at non-zero offsets (float32: 7-row
# statistics and 4-row gradient chunks; bfloat16: 3-row statistics chunks, one holding the marked row that
# redo_marked_rows recomputes), at a fraction of the CPU (a bfloat16 call: 1.6 s at T = 200, 3.9 s at
# T = 1000, its 500 two-row gradient chunks; float32: 0.25 s and 1.7 s). T = 64 in bfloat16 runs one-row
# chunks; T = 7, and T = 64 in float32, one chunk. The bfloat16 table's T = 200 is slow; float32's stays.
TORCH_TS = [pytest.param("V1000-f32", (7, 64, 200), id="V1000-f32-T7-64-200"),
            pytest.param("V4099-bf16-keep", (7, 64), id="V4099-bf16-keep-T7-64", marks=pytest.mark.slow),
            pytest.param("V4099-bf16-keep", (200,), id="V4099-bf16-keep-T200", marks=pytest.mark.slow)]


@pytest.mark.parametrize("table_id, ts", TORCH_TS)
@pytest.mark.parametrize("impl", [pytest.param("compiled", marks=pytest.mark.slow), "eager"])
def test_torch_logits_op_batch_invariant(impl, table_id, ts):
    table = make_table(**TABLES[table_id])
    check_invariance(_torch_runner(table, impl), table, ts)


# Rows wider than ATen's parallel grain (32768 elements): a reduction over a few such rows on several
# intra-op threads splits each row between them (the eager path's former failure: entropy 1-2 ulp apart).
WIDE = dict(v=40000, dtype="float32", keep=False, tau=0.7, n_other=64)


@pytest.mark.parametrize("impl", [pytest.param("compiled", marks=pytest.mark.slow), "eager"])
def test_torch_wide_rows_batch_invariant(impl):
    table = make_table(**WIDE)
    check_invariance(_torch_runner(table, impl), table, (7, 64))


# Under the interpreter each row costs one program per column split and block (V = 4099 bfloat16: 17 + 17),
# so these stay small, in the slow tier: T = 7 at V = 1000 float32 (4 splits, no mask) and on the bfloat16
# masked table (17 splits, its marked row). T = 64 (one whole merge block) in both dtypes and T = 130 (several
# merge programs) are pinned by tests/torch/test_triton_logits.py::test_batch_invariance_bitwise (V = 320, keep
# mask, slow), at a fraction of the programs; the split plan reads V alone (test_splits_from_the_vocabulary_alone).
# (Here before: V1000-f32 at T = 1000, 153 s CPU; then at T = 7 and 64, 28 s; the bfloat16 table at T = 64, 78 s.)
@pytest.mark.parametrize(
    "table_id, ts",
    # (the fast tier's Triton check: tests/torch/test_triton_logits.py::test_batch_invariance_bitwise, T = 7)
    [pytest.param("V1000-f32", (7,), id="V1000-f32-T7", marks=pytest.mark.slow),
     pytest.param("V4099-bf16-keep", (7,), id="V4099-bf16-keep-T7", marks=pytest.mark.slow)])
def test_torch_triton_batch_invariant(table_id, ts):
    pytest.importorskip("triton")
    table = make_table(**TABLES[table_id])
    # No second run of the last call: the interpreter executes the kernels in NumPy, in program order (one
    # result per input by construction), and the checked rows are already compared bitwise across separate
    # calls; the second run was ~40 % of this test's programs.
    check_invariance(_torch_runner(table, "triton"), table, ts, again=False)


def test_torch_eager_workers_single_threaded():
    # The eager path's property rests on its worker threads running each op
    # on one thread (a row then is summed in one order); OpenMP's lazy
    # per-thread init once undid that setting (docs/decisions.md, "Batch
    # invariance: one reduction order per row").
    import torch

    from dualvp_torch import eager

    assert eager._executor(2).submit(lambda: (torch.ones(4, 1 << 16).sum(-1), torch.get_num_threads())[1]).result() == 1


# --- JAX ---------------------------------------------------------------------------------


def _jax_runner(table: dict, world: int = 1):
    import jax
    import jax.numpy as jnp

    import dualvp_jax

    dt = getattr(jnp, table["dtype"])
    kw = dict(temperature=table["tau"])
    if world > 1:
        from tests.jax._helpers import mesh_1d

        mesh = mesh_1d(world)
        v = table["v"]

        def op(z, y, k):  # the table's V_local columns are shard 0's; the other shards are its copies, shifted
            zg = jnp.concatenate([z] + [z - 1.0 * s for s in range(1, world)], axis=-1)
            kg = None if k is None else jnp.concatenate([k] * world, axis=-1)
            return dualvp_jax.sharded_logprob_entropy(zg, y + v * (y % world), mesh, keep_mask=kg, **kw)
    else:
        def op(z, y, k):
            return dualvp_jax.logprob_entropy(z, y, keep_mask=k, **kw)

    @jax.jit
    def value_and_grad(z, y, k, gl, ge):
        (lp, h), vjp = jax.vjp(lambda z_: op(z_, y, k), z)
        (g,) = vjp((gl, ge))
        return lp, h, g

    def run(idx):
        k = None if table["keep"] is None else jnp.asarray(table["keep"][idx])
        lp, h, g = value_and_grad(jnp.asarray(table["z"][idx], dt), jnp.asarray(table["y"][idx], jnp.int32), k,
                                  jnp.asarray(table["gl"][idx]), jnp.asarray(table["ge"][idx]))
        return (np.asarray(lp, np.float32), np.asarray(h, np.float32), np.asarray(g.astype(jnp.float32)))

    return run


# Sharded and not: T = 7 and 64 (past XLA:CPU's 4096-element switch on every table), and on the two wider
# tables a T that runs several row chunks with an overlapping last one (chunks.chunk_rows, the same unsharded
# and under shard_map: 524 rows at V_local = 1000, 124 at 4099, from the width alone): 600 and 300 rows reach
# what T = 1000 did there at a fraction of the rows (V_local = 300's chunk holds 1744 rows: T = 1000 was one
# chunk, like T = 64).
JAX_TS = {"V300-f32": (7, 64), "V1000-f32": (7, 64, 600), "V4099-bf16-keep": (7, 64, 300)}


@pytest.mark.slow
@pytest.mark.parametrize("table_id", list(TABLES))
def test_jax_logprob_entropy_batch_invariant(table_id):
    pytest.importorskip("jax")
    table = make_table(**TABLES[table_id])
    check_invariance(_jax_runner(table), table, JAX_TS[table_id])


@pytest.mark.slow
@pytest.mark.parametrize("table_id", list(TABLES))
def test_jax_sharded_batch_invariant(table_id):
    pytest.importorskip("jax")
    table = make_table(**TABLES[table_id])
    check_invariance(_jax_runner(table, world=2), table, JAX_TS[table_id])


# --- the fused LM-head op ------------------------------------------------------------------
#
# torch: tests/torch/test_linear_batch_invariance.py (every engine; the table this file once held
# here, H=64, V=4099, float32, passes there and did here once unskipped). JAX's fused op is not
# batch-invariant on the CPU (XLA's dot blocking follows the row count: up to 4.1e-6 apart at
# H=64, V=4099, T=7/64/1000 against T=1); README, "Guarantees".
