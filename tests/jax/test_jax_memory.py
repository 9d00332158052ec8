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

The forward that the op takes by default on the CPU, the compiled row sums of
:mod:`dualvp_jax.cpu_kernel`, writes nothing of the logits' size; the scratch
test runs on both CPU paths (``cpu_path``), the chunk pitfalls on the chunked
one, which is what the op falls back to without the kernel.

The second half checks the chunked path's values: every shared case at
W = 1, 2, 4 with 4 rows per chunk (so most have an overlapping last chunk)
through the global-array API against the float64 oracle (the JAX backend's
check of the whole scenario table; tests/cross runs the same API on every
case at W = 2 and 8 with the default chunks, one chunk at these sizes), and
the whole-shard path (the one other platforms take) on a subset.
"""

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import dualvp_jax  # noqa: E402
import dualvp_jax.function as fn_mod  # noqa: E402
from dualvp.testing import cases  # noqa: E402
from dualvp_jax import chunks, cpu_kernel  # noqa: E402
from ._helpers import (  # noqa: E402
    TRACES, check_close, inputs, mesh_1d, reference_of, sharded_runner, x64_for,
)

T, V = 2048, 32000  # rows, columns per shard (the bench size)
V_WIDE = 152064  # the bench's wide shard: more columns than chunks.COLUMN_BLOCK
MODES = {"lp": (False, False), "ent": (True, False), "keep": (True, True)}  # (with entropy, masked)
SCRATCH_VG = 0.05  # value_and_grad: scratch beyond arguments and the gradient output, in B
SCRATCH_FWD = 0.1  # forward alone

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the chunked path is the CPU one")


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


def _gathers(compiled) -> int:
    return len(re.findall(r"\ball-gather(?:-start)?\(", compiled.as_text()))


@pytest.mark.parametrize("cpu_path", ["kernel", "chunked"], indirect=True)
@pytest.mark.parametrize("v", [V, V_WIDE])
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_value_and_grad_scratch(dtype, mode, world, v, cpu_path):
    """jit(value_and_grad): the gradient (1 B) and a few MiB of chunk scratch, no [T, V_local] copy.

    Both CPU forwards: the kernel's row sums (with the chunked program for marked rows under a
    mask) and the chunked program alone. ``V_WIDE`` columns per shard go through column blocks as
    well (5 at 152064).
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
    fw = jax.jit(outs).lower(z, y, k).compile()
    assert fw.memory_analysis().temp_size_in_bytes <= SCRATCH_FWD * B, fw.memory_analysis().temp_size_in_bytes / B
    # one all-gather of O(T) statistics per call (forward), none in the backward
    assert _gathers(vg) == _gathers(fw) == (1 if world > 1 else 0)


def _widest_reduction(compiled) -> int:
    """The most elements any ``reduce`` in the compiled HLO folds into one (its reduced dimensions' product)."""
    txt = compiled.as_text()
    shapes = dict(re.findall(r"(%[\w.-]+) = \w+\[([\d,]*)\]", txt))
    widest = 0
    for operand, dims in re.findall(r" reduce\((%[\w.-]+),[^\n]*?dimensions=\{([\d,]*)\}", txt):
        shape = [int(d) for d in shapes[operand].split(",") if d]
        widest = max(widest, int(np.prod([shape[int(d)] for d in dims.split(",") if d])))
    return widest


@pytest.mark.parametrize("cpu_path", ["chunked"], indirect=True)
@pytest.mark.parametrize("mode", ["lp", "ent"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_wide_rows_reduce_in_column_blocks(dtype, mode, cpu_path):
    """At V_local > chunks.COLUMN_BLOCK no reduction of the forward spans more than COLUMN_BLOCK columns.

    XLA:CPU's reduction library runs a row reduction over more than 2**15 columns
    on about one core (chunks.COLUMN_BLOCK); the op reduces such rows in column
    blocks, merged like shards. Without them (checked) the widest is V_WIDE.
    With a keep mask the rows stay whole (dualvp_jax.function._shard_stats).
    """
    with_ent, masked = MODES[mode]
    mesh, z, y, k = _specs(jnp.dtype(dtype), 1, masked, V_WIDE)
    fw = jax.jit(_outputs_fn(mesh, with_ent, masked)).lower(z, y, k).compile()
    assert 1000 < _widest_reduction(fw) <= chunks.COLUMN_BLOCK, _widest_reduction(fw)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("mode", ["lp", "ent"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gradient_loop_has_no_compare_with_the_target_column(dtype, mode, world):
    """No [T, V_local] compare in jit(value_and_grad) without a keep mask: the indicator is integer arithmetic.

    ``spec.block_grad(indicator="arith")``: with the compare of the column
    index against the target's, XLA:CPU's unmasked backward took 1.35-1.71x the
    time (benchmarks/grad_indicator_T2048_V*.txt); with ``fn_mod._INDICATOR = "compare"`` this
    finds it (checked). The forward's compares are on chunks of rows.
    """
    with_ent, masked = MODES[mode]
    mesh, z, y, k = _specs(jnp.dtype(dtype), world, masked)
    vg = jax.jit(jax.value_and_grad(_loss_fn(_outputs_fn(mesh, with_ent, masked)))).lower(z, y, k).compile()
    assert not re.findall(rf"pred\[{T},{V}\]\S* compare\(", vg.as_text())


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_donated_logits_take_the_gradient(dtype, mode, world):
    """jit(value_and_grad, donate_argnums=0): XLA writes the gradient into the logits' own buffer.

    The JAX counterpart of the torch op's ``inplace_grad=True`` (README, JAX): the
    aliased bytes are the whole logits shard, so the call allocates no [T, V_local]
    buffer. Measured at this size (dualvp bench, dualvp-jax-donated): 0.00-0.05 B
    of peak extra memory against 1.00-1.05 B undonated.
    """
    with_ent, masked = MODES[mode]
    mesh, z, y, k = _specs(jnp.dtype(dtype), world, masked)
    B = T * V * jnp.dtype(dtype).itemsize
    vg = jax.jit(jax.value_and_grad(_loss_fn(_outputs_fn(mesh, with_ent, masked))), donate_argnums=0)
    ma = vg.lower(z, y, k).compile().memory_analysis()
    assert ma.alias_size_in_bytes == B, (ma.alias_size_in_bytes / B, "B aliased")  # per device: one shard
    assert ma.temp_size_in_bytes <= SCRATCH_VG * B, (ma.temp_size_in_bytes / B, "B of scratch")


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backward_alone_is_one_pass_without_collective(dtype):
    """The vjp closure compiled by itself (2 shards, keep mask): the gradient buffer only, no all-gather."""
    mesh, z, y, k = _specs(jnp.dtype(dtype), 2, True)
    B = T * V * jnp.dtype(dtype).itemsize
    outs = _outputs_fn(mesh, True, True)
    zz = jnp.zeros(z.shape, z.dtype, device=z.sharding)
    yy = jnp.zeros(y.shape, y.dtype, device=y.sharding)
    kk = jnp.ones(k.shape, k.dtype, device=k.sharding)
    _, vjp = jax.vjp(lambda z: outs(z, yy, kk), zz)
    ct = (jnp.ones((T,), jnp.float32, device=y.sharding),) * 2
    bwd = jax.jit(lambda f, ct: f(ct)).lower(vjp, ct).compile()
    assert _gathers(bwd) == 0
    assert bwd.memory_analysis().temp_size_in_bytes <= SCRATCH_VG * B, bwd.memory_analysis().temp_size_in_bytes / B
    del zz, kk, vjp


# --- dualvp_jax.chunks by itself ------------------------------------------------


def _row_stats(z, keep):
    # A stand-in for the op's statistics: float32 work on every element, row reductions.
    zf = z.astype(jnp.float32)
    m = jnp.max(zf, axis=-1)
    s = jnp.sum(jnp.exp(zf - m[:, None]), axis=-1)
    mk = jnp.max(jnp.where(keep, zf, -jnp.inf), axis=-1)
    return jnp.stack([m, s, mk], axis=-1)


@pytest.mark.parametrize("n", [T, T - 5])  # a multiple of the chunk rows, and one with a remainder
def test_chunks_bf16_no_whole_upcast(n):
    """bfloat16 rows: no hoisted float32 copy of the array, no padded remainder."""
    z = jax.ShapeDtypeStruct((n, V), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((n, V), jnp.bool_)
    rows = chunks.chunk_rows(n, V)
    assert 1 < rows < n and (n % rows == 0) == (n == T), rows
    f = jax.jit(lambda z, k: chunks.map_row_chunks(_row_stats, (z, k), rows)).lower(z, k).compile()
    B = n * V * 2
    assert f.memory_analysis().temp_size_in_bytes <= SCRATCH_FWD * B, f.memory_analysis().temp_size_in_bytes / B


def test_chunks_under_shard_map():
    """Inside shard_map (check_vma on) over 2 devices: traces, and the scratch stays per chunk."""
    mesh = mesh_1d(2)
    z = jax.ShapeDtypeStruct((T, 2 * V), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "tp")))
    k = jax.ShapeDtypeStruct((T, 2 * V), jnp.bool_, sharding=NamedSharding(mesh, P(None, "tp")))

    def body(z, k):
        st = chunks.map_row_chunks(_row_stats, (z, k), chunks.chunk_rows(T, V))
        return lax.all_gather(st, "tp", axis=0, to="invarying").sum(0)

    sm = jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp")), out_specs=P())
    f = jax.jit(sm).lower(z, k).compile()
    assert f.memory_analysis().temp_size_in_bytes <= SCRATCH_FWD * T * V * 2


@pytest.mark.parametrize("n,rows", [(1, 1), (7, 1), (7, 3), (8, 4), (9, 4), (10, 9), (5, 5), (5, 8)])
def test_chunks_rows_in_order(n, rows):
    """Every row once, in order, including the overlapping last chunk; equal to the unchunked call."""
    rng = np.random.default_rng(n * 10 + rows)
    z = jnp.asarray(rng.standard_normal((n, 5)).astype(np.float32)).astype(jnp.bfloat16)
    k = jnp.asarray(rng.random((n, 5)) < 0.5)
    ids = jnp.arange(n, dtype=jnp.int32)

    def f(z, k, ids):
        return _row_stats(z, k), ids * 2

    (st, got_ids) = jax.jit(lambda *a: chunks.map_row_chunks(f, a, rows))(z, k, ids)
    np.testing.assert_array_equal(np.asarray(got_ids), 2 * np.arange(n))
    zf = np.asarray(z, np.float32)
    np.testing.assert_array_equal(np.asarray(st[:, 0]), zf.max(-1))
    np.testing.assert_array_equal(np.asarray(st[:, 2]), np.where(np.asarray(k), zf, -np.inf).max(-1))
    np.testing.assert_allclose(np.asarray(st[:, 1]), np.exp(zf - zf.max(-1, keepdims=True)).sum(-1), rtol=1e-6)


def test_chunk_rows_budget():
    assert chunks.chunk_rows(2048, 32000, budget=2 << 20) == 16
    assert chunks.chunk_rows(2048, 25000, budget=2 << 20) == 20  # 20.97 -> a multiple of 4
    assert chunks.chunk_rows(2048, 152064, budget=2 << 20) == 4  # 3.4 -> at least 4
    assert chunks.chunk_rows(10, 32000, budget=2 << 20) == 10  # capped at the rows there are
    assert chunks.chunk_rows(3, 10 ** 7, budget=2 << 20) == 3
    assert chunks.chunk_rows(0, 32000) == 1


@pytest.mark.parametrize("width,max_width,n", [
    (1, 8, 1), (8, 8, 1), (9, 8, 2), (0, 8, 1), (10, 3, 4), (2, 1, 2),
    (152064, None, 5), (32768, None, 1), (32769, None, 2),
])
def test_column_blocks(width, max_width, n):
    """The fewest blocks within max_width, contiguous from 0 to width, widths within one of each other."""
    blocks = chunks.column_blocks(width, max_width)
    assert len(blocks) == n, blocks
    assert blocks[0][0] == 0 and blocks[-1][1] == width
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:])), blocks
    widths = [b - a for a, b in blocks]
    assert max(widths) <= (chunks.COLUMN_BLOCK if max_width is None else max_width)
    assert max(widths) - min(widths) <= 1, widths


def test_column_blocks_bad_width():
    with pytest.raises(ValueError, match="max_width"):
        chunks.column_blocks(10, 0)


# --- values of the chunked (and the whole-shard) path ----------------------------


@pytest.fixture
def rows_per_chunk(monkeypatch):
    """Traces made here use 4 rows per chunk; jit caches are cleared before and after."""
    jax.clear_caches()
    calls = []

    def four(n, width, budget=None):
        calls.append(n)
        return max(1, min(4, n))

    monkeypatch.setattr(chunks, "chunk_rows", four)
    yield calls
    jax.clear_caches()


@pytest.fixture
def cpu_path(request, monkeypatch):
    """Traces made here take the CPU forward ``request.param`` ("kernel" or "chunked"); jit caches cleared.

    (The op's own ``jit`` caches its trace, which holds the path: without the clears a later test would
    reuse this one's program.)
    """
    path = request.param
    if path == "kernel" and not cpu_kernel.available():
        pytest.skip(f"no CPU kernel: {cpu_kernel.unavailable_reason()}")
    jax.clear_caches()
    monkeypatch.setattr(fn_mod, "_FORCE_PATH", path)
    yield path
    jax.clear_caches()


@pytest.fixture
def whole_shard(monkeypatch):
    """Traces made here take the whole-shard forward (the non-CPU path)."""
    jax.clear_caches()
    monkeypatch.setattr(fn_mod, "_FORCE_PATH", "whole")
    yield
    jax.clear_caches()


_CHUNK_PARAMS = [pytest.param(c, w, id=f"{c.name}-W{w}") for c in cases.CASES for w in (1, 2, 4) if w in c.worlds]


def _check_case(case, world):
    """The global-array API on a jax.make_mesh mesh (explicit axes): values, gradients, dtypes, shapes."""
    prob = cases.make(case)
    refs = reference_of(prob)
    with x64_for(case.dtype):
        z, y, k, gl, ge = inputs(prob)
        out = sharded_runner(world, "explicit", case.temperature, case.ignore_index, k is not None)(z, y, k, gl, ge)
        lp, h, g = out
        assert lp.dtype == h.dtype == (jnp.float64 if case.dtype == "float64" else jnp.float32)
        assert g.dtype == z.dtype and g.shape == z.shape
        for name, x, ref in zip(("logprob", "entropy", "grad"), out, refs):
            check_close(case.name, x, ref, case.dtype, name)


class TestChunked:
    """Every shared case at W = 1, 2, 4 through the chunked path with 4 rows per chunk (so most have an
    overlapping last chunk), once with whole rows and once with every row of the unmasked cases in three
    column blocks (uneven where V_local is not a multiple of 3; the path of unmasked shards wider than
    chunks.COLUMN_BLOCK). The jit
    caches are cleared before and after each of the two, and ``chunk_rows`` (and ``column_blocks``) are
    patched throughout it: every program run here was traced here, chunked. A case whose shapes, dtype and
    options repeat an earlier one's reuses that compiled program (42 compilations for 72 cases) instead of
    compiling it again."""

    @pytest.fixture(scope="class", params=["rows", "rows_and_columns"])
    def four_row_chunks(self, request):
        jax.clear_caches()
        calls, widths = [], []
        column_blocks = chunks.column_blocks

        def four(n, width, budget=None):
            calls.append(n)
            return max(1, min(4, n))

        def three(width, max_width=None):
            widths.append(width)
            return column_blocks(width, max(1, -(-width // 3)))

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fn_mod, "_FORCE_PATH", "chunked")
            mp.setattr(chunks, "chunk_rows", four)
            if request.param == "rows_and_columns":
                mp.setattr(chunks, "column_blocks", three)
            yield calls, widths
        jax.clear_caches()

    @pytest.mark.parametrize("case,world", _CHUNK_PARAMS)
    def test_vs_reference(self, case, world, four_row_chunks, request):
        rows, widths = four_row_chunks
        traces, calls, blocked = TRACES["sharded"], len(rows), len(widths)
        _check_case(case, world)
        new = rows[calls:]
        if TRACES["sharded"] > traces:
            # traced here, through the chunked path (the primal and the vjp forward)
            assert new and set(new) == {int(np.prod(case.lead))}, new
            if "rows_and_columns" in request.node.callspec.id:
                # masked and unmasked shards alike are split into column blocks
                assert set(widths[blocked:]) == {case.vocab // world}, widths[blocked:]
        else:
            # the program of an earlier case of this class (same shapes and options), checked there
            assert not new, new


@pytest.mark.parametrize("name", ["basic", "bfloat16", "everything", "neg_inf_masked", "float64"])
def test_whole_shard_path_vs_reference(name, whole_shard):
    case = cases.case(name)
    _check_case(case, max(w for w in case.worlds if w <= 4))


@pytest.mark.parametrize("cpu_path", ["chunked", "kernel"], indirect=True)
def test_chunked_under_vmap(cpu_path, rows_per_chunk):
    """vmap over a batch of problems, 4-row chunks (or the kernel) inside: values and gradients as the oracle."""
    from dualvp import reference

    probs = [cases.make(cases.case("random_mask_temp", seed=s)) for s in (1, 2, 3)]
    z = jnp.stack([inputs(p)[0] for p in probs])
    y = jnp.stack([inputs(p)[1] for p in probs])
    k = jnp.stack([inputs(p)[2] for p in probs])

    def loss(z, y, k):
        lp, h = dualvp_jax.logprob_entropy(z, y, keep_mask=k, temperature=0.7)
        return jnp.sum(lp) + 0.5 * jnp.sum(h), (lp, h)

    (_, (lp, h)), g = jax.jit(jax.vmap(jax.value_and_grad(loss, has_aux=True)))(z, y, k)
    assert rows_per_chunk  # traced here (with the kernel: the chunked redo of marked rows)
    for i, p in enumerate(probs):
        kw = dict(keep_mask=p.keep_mask, temperature=0.7)
        r_lp, r_h = reference.logprob_entropy(p.logits, p.target, **kw)
        n = p.target.shape
        r_g = reference.logprob_entropy_grad(p.logits, p.target, np.ones(n), 0.5 * np.ones(n), **kw)
        check_close("vmap", lp[i], r_lp, "float32", "logprob")
        check_close("vmap", h[i], r_h, "float32", "entropy")
        check_close("vmap", g[i], r_g, "float32", "grad")


@pytest.mark.parametrize("column_block", [None, 16], ids=["whole_rows", "column_blocks"])
@pytest.mark.parametrize("cpu_path,kept_shift,redo", [
    ("chunked", "max", "shard"), ("chunked", "max", "chunk"), ("chunked", "kept", "shard"),
    ("chunked", "kept", "chunk"), ("kernel", "max", "shard")], indirect=["cpu_path"])
def test_chunked_masked_rows_far_below_the_max(cpu_path, rows_per_chunk, monkeypatch, kept_shift, column_block, redo):
    """A masked chunk whose kept sum, shifted by the overall max, underflows is computed again with the kept max.

    Row 5 keeps only columns 120 temperature units below its (dropped) max: in float32 each of their
    e^((z - m) / tau) is 0, so ``kept_shift="max"`` marks the row and ``lax.cond`` computes the shard's
    chunks again with ``"kept"`` (``function._REDO_MARKED = "shard"``) or only its 4-row chunk
    (``"chunk"``). Values and gradients as the
    float64 oracle, with either setting of ``function._KEPT_SHIFT``, with whole rows and with rows in
    column blocks of 16 (``chunks.COLUMN_BLOCK``): there only the first block holds the max and is marked,
    and the mark must survive the merge of the blocks so that the chunk is computed again. With the CPU
    kernel (``cpu_path="kernel"``) the kernel's sums mark the row, and the chunked program (in column blocks
    of 16 or not) computes the shard again with ``"kept"``.
    """
    from dualvp import reference
    monkeypatch.setattr(fn_mod, "_KEPT_SHIFT", kept_shift)
    monkeypatch.setattr(fn_mod, "_REDO_MARKED", redo)
    if column_block is not None:
        monkeypatch.setattr(chunks, "COLUMN_BLOCK", column_block)
    rng = np.random.default_rng(7)
    T, V, tau = 16, 64, 0.5
    z = (rng.standard_normal((T, V)) * 3).astype(np.float32)
    keep = rng.random((T, V)) < 0.4
    y = rng.integers(1, V, T)
    keep[np.arange(T), y] = True
    z[5, 0], keep[5, 0] = 30.0, False
    z[5, 1:] = np.minimum(z[5, 1:], 30.0 - tau * 120.0)
    assert np.all(np.exp((z[5, 1:].astype(np.float32) - np.float32(30.0)) / np.float32(tau)) == 0)

    def loss(z):
        lp, h = dualvp_jax.logprob_entropy(z, jnp.asarray(y, jnp.int32), keep_mask=jnp.asarray(keep),
                                           temperature=tau)
        return jnp.sum(lp) + 0.5 * jnp.sum(h), (lp, h)

    (_, (lp, h)), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(jnp.asarray(z))
    assert rows_per_chunk  # traced here, in 4-row chunks
    kw = dict(keep_mask=keep, temperature=tau)
    r_lp, r_h = reference.logprob_entropy(z, y, **kw)
    r_g = reference.logprob_entropy_grad(z, y, np.ones(T), 0.5 * np.ones(T), **kw)
    assert np.isfinite(r_lp[5]) and r_lp[5] > -10  # the kept set's own distribution, not e^-120
    check_close("far kept row", lp, r_lp, "float32", "logprob")
    check_close("far kept row", h, r_h, "float32", "entropy")
    check_close("far kept row", g, r_g, "float32", "grad")
    # Only the marked row is computed again: the other rows come out bit for bit as in a call where
    # no row is marked (row 5 replaced by an ordinary row).
    z2, keep2 = z.copy(), keep.copy()
    z2[5], keep2[5] = z[4], keep[4] | (np.arange(V) == y[5])
    lp2, h2 = dualvp_jax.logprob_entropy(jnp.asarray(z2), jnp.asarray(y, jnp.int32), keep_mask=jnp.asarray(keep2),
                                         temperature=tau)
    others = np.arange(T) != 5
    np.testing.assert_array_equal(np.asarray(lp)[others], np.asarray(lp2)[others])
    np.testing.assert_array_equal(np.asarray(h)[others], np.asarray(h2)[others])
