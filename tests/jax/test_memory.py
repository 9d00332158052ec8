"""Memory of dualvp_jax on XLA:CPU, and the row-chunked forward that keeps it small.

The byte counts come from the compiled programs (``memory_analysis()`` of
``jax.jit(...).lower(...).compile()``): nothing is run, so the real bench size
(T = 2048, V_local = 32000) costs only compile time. ``B`` is the bytes of one
logits shard. The scratch bounds below are about twice what the chunked
forward needs and far below one full-size copy, so each of the pitfalls of
:mod:`dualvp_jax.chunks` makes a test fail if it comes back:

- the float32 upcast of the whole bfloat16 array hoisted out of the loop
  (``optimization_barrier`` removed): +2 B;
- a padded / concatenated remainder chunk (``lax.map(batch_size=...)``): +1 B;
- the whole-shard forward (no chunks): up to +6 B in bfloat16 with a mask.

The accumulator pitfall (a carry built with ``jnp.zeros`` under ``shard_map``)
is a trace-time error: the shard_map cases would not compile.

The second half pins the same for dualvp_jax.chunks by itself; tests/jax/test_chunks.py
checks the chunked forward's values against the float64 oracle.
"""

import functools
import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import dualvp_jax  # noqa: E402
from dualvp_jax import chunks  # noqa: E402
from ._helpers import mesh_1d, row_stats  # noqa: E402

T, V = 2048, 32000  # rows, columns per shard (the bench size)
V_WIDE = 152064  # the bench's wide shard: more columns than chunks.COLUMN_BLOCK
MODES = {"lp": (False, False), "ent": (True, False), "keep": (True, True)}  # (with entropy, masked)
SCRATCH_VG = 0.05  # value_and_grad: scratch beyond arguments and the gradient output, in B
SCRATCH_FWD = 0.1  # forward alone

# Every test here compiles the op at the bench size (T = 2048, up to 152064 columns): all slow.
pytestmark = [pytest.mark.skipif(jax.default_backend() != "cpu", reason="the chunked path is the CPU one"),
              pytest.mark.slow]


def _specs(dtype, world, masked, v=V):
    mesh = mesh_1d(world) if world > 1 else None
    sh = (lambda s: NamedSharding(mesh, s)) if mesh else (lambda s: None)
    z = jax.ShapeDtypeStruct((T, world * v), dtype, sharding=sh(P(None, "tp")))
    y = jax.ShapeDtypeStruct((T,), jnp.int32, sharding=sh(P(None)))
    k = jax.ShapeDtypeStruct((T, world * v), jnp.bool_, sharding=sh(P(None, "tp"))) if masked else None
    return mesh, z, y, k


def _outputs_fn(mesh, with_ent, masked):
    """``(z, y, k) -> (logprob, entropy)``, unsharded or inside a check_vma shard_map."""

    def body(z, y, *k):
        lp, h = dualvp_jax.logprob_entropy(z, y, axis_name="tp" if mesh else None,
                                           keep_mask=k[0] if k else None, with_entropy=with_ent)
        return lp, (h if with_ent else jnp.zeros_like(lp))

    def outs(z, y, k):
        extra = (k,) if masked else ()
        if mesh is None:
            return body(z, y, *extra)
        in_specs = (P(None, "tp"), P(None)) + ((P(None, "tp"),) if masked else ())
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(P(None), P(None)))(z, y, *extra)

    return outs


def _loss_fn(outs):
    def loss(z, y, k):
        lp, h = outs(z, y, k)
        return jnp.sum(lp) + 0.5 * jnp.sum(h)

    return loss


@functools.lru_cache(maxsize=None)
def _forward(dtype, world, mode, v):
    """The forward alone, compiled at the bench size; one program per (dtype, W, mode, V) for the whole module
    (test_value_and_grad_scratch and test_wide_rows_reduce_in_column_blocks read the same ones)."""
    with_ent, masked = MODES[mode]
    mesh, z, y, k = _specs(jnp.dtype(dtype), world, masked, v)
    return jax.jit(_outputs_fn(mesh, with_ent, masked)).lower(z, y, k).compile()


def _gathers(compiled) -> int:
    return len(re.findall(r"\ball-gather(?:-start)?\(", compiled.as_text()))


# Each (dtype, mode) once at V, W covering every (dtype, W) and (mode, W) pair (W = 1 and 2 run the same
# per-shard program, W = 2 adds the gather), the masked mode in bfloat16 on 2 shards, the largest scratch;
# at V_WIDE a covering sample likewise: its forward at W = 1 in every dtype and mode is
# test_wide_rows_reduce_in_column_blocks's program. Every program compiled here is also searched for the
# backward's compare (no keep mask: test_value_and_grad_scratch's ``compare`` assertion).
_VG_GRID = [("float32", "lp", 1, V), ("float32", "ent", 2, V), ("float32", "keep", 1, V),
            ("bfloat16", "lp", 2, V), ("bfloat16", "ent", 1, V), ("bfloat16", "keep", 2, V),
            ("bfloat16", "keep", 2, V_WIDE), ("float32", "lp", 1, V_WIDE), ("float32", "ent", 2, V_WIDE),
            ("bfloat16", "ent", 1, V_WIDE)]


@pytest.mark.parametrize("dtype,mode,world,v", _VG_GRID, ids=["-".join(map(str, p)) for p in _VG_GRID])
def test_value_and_grad_scratch(dtype, mode, world, v):
    """jit(value_and_grad): the gradient (1 B) and a few MiB of chunk scratch, no [T, V_local] copy.

    ``V_WIDE`` columns per shard go through column blocks as well (5 at 152064).

    No [T, V_local] compare in the program without a keep mask: the indicator is integer arithmetic.
    ``spec.block_grad(indicator="arith")`` (dualvp_jax._tuning.INDICATOR): the compare of the column
    index against the target's would keep XLA:CPU from vectorising the backward's loop; with
    ``indicator="compare"`` this test finds it. The forward's compares are on chunks of rows.
    """
    with_ent, masked = MODES[mode]
    mesh, z, y, k = _specs(jnp.dtype(dtype), world, masked, v)
    B = T * v * jnp.dtype(dtype).itemsize
    outs = _outputs_fn(mesh, with_ent, masked)
    vg = jax.jit(jax.value_and_grad(_loss_fn(outs))).lower(z, y, k).compile()
    ma = vg.memory_analysis()
    assert ma.temp_size_in_bytes <= SCRATCH_VG * B, (ma.temp_size_in_bytes / B, "B of scratch")
    # the outputs are the loss and the gradient shard, nothing saved on the side
    assert ma.output_size_in_bytes <= 1.001 * B, ma.output_size_in_bytes / B
    fw = _forward(dtype, world, mode, v)
    assert fw.memory_analysis().temp_size_in_bytes <= SCRATCH_FWD * B, fw.memory_analysis().temp_size_in_bytes / B
    # one all-gather of O(T) statistics per call (forward), none in the backward
    assert _gathers(vg) == _gathers(fw) == (1 if world > 1 else 0)
    if not masked:
        assert not re.findall(rf"pred\[{T},{v}\]\S* compare\(", vg.as_text())


def _widest_reduction(compiled) -> int:
    """The most elements any ``reduce`` in the compiled HLO folds into one (its reduced dimensions' product)."""
    txt = compiled.as_text()
    shapes = dict(re.findall(r"(%[\w.-]+) = \w+\[([\d,]*)\]", txt))
    widest = 0
    for operand, dims in re.findall(r" reduce\((%[\w.-]+),[^\n]*?dimensions=\{([\d,]*)\}", txt):
        shape = [int(d) for d in shapes[operand].split(",") if d]
        widest = max(widest, int(np.prod([shape[int(d)] for d in dims.split(",") if d])))
    return widest


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_wide_rows_reduce_in_column_blocks(dtype, mode):
    """At V_local > chunks.COLUMN_BLOCK no reduction of the forward spans more than COLUMN_BLOCK columns.

    XLA:CPU's reduction library runs a row reduction over more than 2**15 columns
    on about one core (chunks.COLUMN_BLOCK); the op reduces such rows in column
    blocks, merged like shards, masked or not. Without them the widest is V_WIDE.
    """
    fw = _forward(dtype, 1, mode, V_WIDE)
    assert 1000 < _widest_reduction(fw) <= chunks.COLUMN_BLOCK, _widest_reduction(fw)


# Donation aliases one argument whatever the op computes: each dtype, mode and W once (the scratch bounds
# without donation: test_value_and_grad_scratch).
_DONATE_GRID = [("float32", "keep", 2), ("bfloat16", "lp", 1), ("bfloat16", "ent", 2)]


@pytest.mark.parametrize("dtype,mode,world", _DONATE_GRID, ids=["-".join(map(str, p)) for p in _DONATE_GRID])
def test_donated_logits_take_the_gradient(dtype, mode, world):
    """jit(value_and_grad, donate_argnums=0): XLA writes the gradient into the logits' own buffer.

    The JAX counterpart of the torch op's ``inplace_grad=True`` (README, JAX): the
    aliased bytes are the whole logits shard, so the call allocates no [T, V_local]
    buffer.
    """
    with_ent, masked = MODES[mode]
    mesh, z, y, k = _specs(jnp.dtype(dtype), world, masked)
    B = T * V * jnp.dtype(dtype).itemsize
    vg = jax.jit(jax.value_and_grad(_loss_fn(_outputs_fn(mesh, with_ent, masked))), donate_argnums=0)
    ma = vg.lower(z, y, k).compile().memory_analysis()
    assert ma.alias_size_in_bytes == B, (ma.alias_size_in_bytes / B, "B aliased")  # per device: one shard
    assert ma.temp_size_in_bytes <= SCRATCH_VG * B, (ma.temp_size_in_bytes / B, "B of scratch")


@pytest.mark.parametrize("dtype,mode,world", _DONATE_GRID, ids=["-".join(map(str, p)) for p in _DONATE_GRID])
def test_previous_gradient_buffer_takes_the_next_gradient(dtype, mode, world):
    """Donating the last step's gradient (unused, ``keep_unused=True``): XLA writes the new one into it.

    For logits that must outlive the step (README, JAX): the gradient then needs no
    fresh [T, V_local] buffer and its pages are already faulted in. Without
    ``keep_unused`` jit drops the unused argument, and with it the donation.
    """
    with_ent, masked = MODES[mode]
    mesh, z, y, k = _specs(jnp.dtype(dtype), world, masked)
    B = T * V * jnp.dtype(dtype).itemsize
    vg = jax.value_and_grad(_loss_fn(_outputs_fn(mesh, with_ent, masked)))
    step = jax.jit(lambda z, y, k, old: vg(z, y, k), donate_argnums=3, keep_unused=True)
    ma = step.lower(z, y, k, z).compile().memory_analysis()
    assert ma.alias_size_in_bytes == B, (ma.alias_size_in_bytes / B, "B aliased")  # per device: one shard
    assert ma.temp_size_in_bytes <= SCRATCH_VG * B, (ma.temp_size_in_bytes / B, "B of scratch")


def test_recycled_gradient_buffer_holds_the_same_gradient():
    """The donated-buffer step returns the fresh step's gradient bit for bit, call after call."""
    z = jax.random.normal(jax.random.PRNGKey(0), (64, 1000), jnp.float32) * 3
    y = jax.random.randint(jax.random.PRNGKey(1), (64,), 0, 1000)
    vg = jax.value_and_grad(_loss_fn(_outputs_fn(None, True, False)))
    want = jax.jit(vg)(z, y, None)[1]
    step = jax.jit(lambda z, y, old: vg(z, y, None), donate_argnums=2, keep_unused=True)
    g = jnp.full_like(z, jnp.nan)
    for _ in range(2):
        old = g
        _, g = step(z, y, old)
        assert old.is_deleted()  # its buffer was taken
        np.testing.assert_array_equal(np.asarray(g), np.asarray(want))


def test_logits_made_in_the_same_jit_share_their_gradient_buffer():
    """Logits computed inside the jit (h @ W^T): they and their gradient take one [T, V] buffer, no donation.

    float32 only: XLA:CPU has no bfloat16 GEMM, and a bfloat16 ``h @ W^T`` makes a
    float32 product first (3.1 B of scratch at this size, most of it the matmul's).
    """
    dtype, H = "float32", 64
    h = jax.ShapeDtypeStruct((T, H), jnp.dtype(dtype))
    w = jax.ShapeDtypeStruct((V, H), jnp.dtype(dtype))
    y = jax.ShapeDtypeStruct((T,), jnp.int32)
    B = T * V * jnp.dtype(dtype).itemsize

    def loss(h, w, y):
        lp, ent = dualvp_jax.logprob_entropy(h @ w.T, y)
        return jnp.sum(lp) + 0.5 * jnp.sum(ent)

    vg = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(h, w, y).compile()
    temp = vg.memory_analysis().temp_size_in_bytes
    assert temp <= (1 + SCRATCH_VG) * B, (temp / B, "B of scratch: logits and gradient in separate buffers?")


# bfloat16 (the upcast a hoisted copy would make); float32's backward within the whole jit(value_and_grad),
# with no gather beyond the forward's: test_value_and_grad_scratch.
@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_backward_alone_is_one_pass_without_collective(dtype):
    """The vjp closure compiled by itself (2 shards, keep mask): the gradient buffer only, no all-gather."""
    mesh, z, y, k = _specs(jnp.dtype(dtype), 2, True)
    B = T * V * jnp.dtype(dtype).itemsize
    outs = _outputs_fn(mesh, True, True)
    zz = jnp.zeros(z.shape, z.dtype, device=z.sharding)
    yy = jnp.zeros(y.shape, y.dtype, device=y.sharding)
    kk = jnp.ones(k.shape, k.dtype, device=k.sharding)
    # the forward under jit (one program; eager, it dispatches op by op), its vjp closure returned; the
    # target and mask arguments (closed over, they would be constants of the program)
    _, vjp = jax.jit(lambda z, y, k: jax.vjp(lambda z: outs(z, y, k), z))(zz, yy, kk)
    ct = (jnp.ones((T,), jnp.float32, device=y.sharding),) * 2
    bwd = jax.jit(lambda f, ct: f(ct)).lower(vjp, ct).compile()
    assert _gathers(bwd) == 0
    assert bwd.memory_analysis().temp_size_in_bytes <= SCRATCH_VG * B, bwd.memory_analysis().temp_size_in_bytes / B
    del zz, vjp


# --- dualvp_jax.chunks by itself ------------------------------------------------


@pytest.mark.parametrize("n", [T, T - 5])  # a multiple of the chunk rows, and one with a remainder
def test_chunks_bf16_no_whole_upcast(n):
    """bfloat16 rows: no hoisted float32 copy of the array, no padded remainder."""
    z = jax.ShapeDtypeStruct((n, V), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((n, V), jnp.bool_)
    rows = chunks.chunk_rows(V)
    assert 1 < rows < n and (n % rows == 0) == (n == T), rows
    f = jax.jit(lambda z, k: chunks.map_row_chunks(row_stats, (z, k), rows)).lower(z, k).compile()
    B = n * V * 2
    assert f.memory_analysis().temp_size_in_bytes <= SCRATCH_FWD * B, f.memory_analysis().temp_size_in_bytes / B


def test_chunks_under_shard_map():
    """Inside shard_map (check_vma on) over 2 devices: traces, and the scratch stays per chunk."""
    mesh = mesh_1d(2)
    z = jax.ShapeDtypeStruct((T, 2 * V), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "tp")))
    k = jax.ShapeDtypeStruct((T, 2 * V), jnp.bool_, sharding=NamedSharding(mesh, P(None, "tp")))

    def body(z, k):
        st = chunks.map_row_chunks(row_stats, (z, k), chunks.chunk_rows(V))
        return lax.all_gather(st, "tp", axis=0, to="invarying").sum(0)

    sm = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp")), out_specs=P())
    f = jax.jit(sm).lower(z, k).compile()
    assert f.memory_analysis().temp_size_in_bytes <= SCRATCH_FWD * T * V * 2
