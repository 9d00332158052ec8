"""dualvp_jax.chunks and the op's two forwards (chunked, whole shard) against the float64 oracle.

The op's forward is a static :class:`dualvp_jax._tuning.Tuning`: ``"auto"`` (the
chunked program on the CPU, the whole shard elsewhere), ``"chunked"`` or ``"whole"``,
with the chunk budget and the column block. The public functions use the default; the
tests here pass other instances through the private entry points, so that one CPU
process checks both forwards, with 4-row chunks (most cases then have an overlapping
last chunk) and with rows in column blocks. Each tuning is its own trace: nothing here
clears JAX's caches.
"""


import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import dualvp_jax.function as fn_mod  # noqa: E402
from dualvp.testing import cases  # noqa: E402
from dualvp_jax import chunks  # noqa: E402
from dualvp_jax._tuning import DEFAULT, Tuning  # noqa: E402
from ._helpers import check_close, inputs, reference_of, row_stats, sharded_runner, x64_for  # noqa: E402

#: The chunked forward with 4 rows per chunk (``chunk_rows``' minimum), whatever the width.
FOUR_ROWS = Tuning(path="chunked", chunk_bytes=1)
WHOLE = Tuning(path="whole")


def _op(z, y, tuning, **kw):
    """``dualvp_jax.logprob_entropy`` (unsharded) with an explicit tuning."""
    kw = {"keep_mask": None, "temperature": 1.0, "with_entropy": True, "entropy_grad": True,
          "ignore_index": -100, **kw}
    return fn_mod._logprob_entropy(z, y, None, kw["keep_mask"], kw["temperature"], kw["with_entropy"],
                                   kw["entropy_grad"], kw["ignore_index"], tuning)


# --- dualvp_jax.chunks by itself ------------------------------------------------


@pytest.mark.parametrize("n,rows", [pytest.param(n, r, marks=() if (n, r) in ((7, 3), (5, 8)) else pytest.mark.slow)
                                    for n, r in [(1, 1), (7, 1), (7, 3), (8, 4), (9, 4), (10, 9), (5, 5), (5, 8)]])
def test_chunks_rows_in_order(n, rows):
    """Every row once, in order, including the overlapping last chunk; equal to the unchunked call."""
    rng = np.random.default_rng(n * 10 + rows)
    z = jnp.asarray(rng.standard_normal((n, 5)).astype(np.float32)).astype(jnp.bfloat16)
    k = jnp.asarray(rng.random((n, 5)) < 0.5)
    ids = jnp.arange(n, dtype=jnp.int32)

    def f(z, k, ids):
        return row_stats(z, k), ids * 2

    (st, got_ids) = jax.jit(lambda *a: chunks.map_row_chunks(f, a, rows))(z, k, ids)
    np.testing.assert_array_equal(np.asarray(got_ids), 2 * np.arange(n))
    zf = np.asarray(z, np.float32)
    np.testing.assert_array_equal(np.asarray(st[:, 0]), zf.max(-1))
    np.testing.assert_array_equal(np.asarray(st[:, 2]), np.where(np.asarray(k), zf, -np.inf).max(-1))
    np.testing.assert_allclose(np.asarray(st[:, 1]), np.exp(zf - zf.max(-1, keepdims=True)).sum(-1), rtol=1e-6)


def test_chunk_rows_budget():
    assert chunks.chunk_rows(32000, budget=2 << 20) == 16
    assert chunks.chunk_rows(25000, budget=2 << 20) == 20  # 20.97 -> a multiple of 4
    assert chunks.chunk_rows(152064, budget=2 << 20) == 4  # 3.4 -> at least 4
    assert chunks.chunk_rows(10 ** 7, budget=2 << 20) == 4
    assert chunks.chunk_rows(300) == 1744  # from the width alone: no row count to cap it


def test_short_call_runs_as_one_block():
    """A call of fewer rows than a block gives ``fn`` one block of exactly ``rows`` rows (batch invariance)."""
    seen = []

    def f(z):
        seen.append(z.shape)
        return z.sum(-1)

    z = jnp.arange(15, dtype=jnp.float32).reshape(3, 5)
    out = chunks.map_row_chunks(f, (z,), 8)
    assert seen == [(8, 5)]
    np.testing.assert_array_equal(np.asarray(out), np.arange(15, dtype=np.float32).reshape(3, 5).sum(-1))
    seen.clear()
    chunks.map_row_chunks(f, (jnp.zeros((20, 5)),), 8)
    assert seen == [(8, 5)]  # the scan's body: every block 8 rows


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



# --- the tuning -----------------------------------------------------------------


def test_tuning_rejects_unknown_values():
    for bad in (dict(path="kernel"), dict(chunk_bytes=0), dict(column_block=True), dict(column_block=2.5)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Tuning(**bad)
    assert hash(DEFAULT) == hash(Tuning()) and DEFAULT == Tuning()  # a static jit argument


def test_tuning_picks_the_forward():
    """The lowered op: a loop of 4-row chunks, column blocks, or one whole-shard call, as the tuning says."""
    z = jnp.zeros((16, 64), jnp.float32)
    y = jnp.zeros((16,), jnp.int32)

    def text(tuning):
        return jax.jit(lambda z, y: _op(z, y, tuning)).lower(z, y).as_text()

    four = text(FOUR_ROWS)
    assert "stablehlo.while" in four and "tensor<4x64xf32>" in four
    assert "stablehlo.while" not in text(WHOLE)
    blocks = text(Tuning(path="chunked", column_block=16, chunk_bytes=16 * 64 * 4))  # one 16-row chunk, 4 column blocks
    assert "stablehlo.while" not in blocks and "tensor<16x16xf32>" in blocks
    # the default budget's block (8192 rows of 64): 16 rows run as one padded block
    padded = text(Tuning(path="chunked"))
    assert "stablehlo.while" not in padded and "tensor<8192x64xf32>" in padded
    # on the CPU the default takes the chunked program
    if jax.default_backend() == "cpu":
        assert "stablehlo.while" in text(Tuning(chunk_bytes=1))


# --- values of the chunked and the whole-shard forward ----------------------------

# Chunks are cut inside a shard: W changes only the shard's width and the combine across shards (every
# case on JAX's default path at W = 2 and 8: tests/cross/test_cross_backends.py). Every case runs once,
# in one chunk layout, the two alternating over the table: whole-row chunks at W = 2, column blocks at
# W = 4 (uneven thirds of 16 columns; at W = 1, the fast sample below). Each layout gets every kind of
# case (masked, ignored rows, extreme and -inf logits, float64 / bfloat16 / float16, batch dims), and
# each program compiles once (a program per case and layout was most of this file's time).
_LAYOUT_WORLDS = {"rows": 2, "rows_and_columns": 4}
_PARAMS = [pytest.param(c, w, b, id=f"{b}-{c.name}-W{w}")
           for i, c in enumerate(cases.CASES)
           for b, w in [list(_LAYOUT_WORLDS.items())[i % 2]] if w in c.worlds]
assert len(_PARAMS) == len(cases.CASES)  # every case once


def _check_case(case, world, tuning):
    """The global-array API on a jax.make_mesh mesh (explicit axes): values, gradients, dtypes, shapes."""
    prob = cases.make(case)
    refs = reference_of(prob)
    with x64_for(case.dtype):
        z, y, k, gl, ge = inputs(prob)
        run = sharded_runner(world, "explicit", case.temperature, case.ignore_index, k is not None, tuning=tuning)
        out = run(z, y, k, gl, ge)
        lp, h, g = out
        assert lp.dtype == h.dtype == (jnp.float64 if case.dtype == "float64" else jnp.float32)
        assert g.dtype == z.dtype and g.shape == z.shape
        for name, x, ref in zip(("logprob", "entropy", "grad"), out, refs):
            check_close(case.name, x, ref, case.dtype, name)


@pytest.mark.slow
@pytest.mark.parametrize("case,world,blocks", _PARAMS)
def test_chunked_vs_reference(case, world, blocks):
    """Every shared case through the chunked forward with 4 rows per chunk, with whole rows (W = 2) or
    with every row in three column blocks (W = 4) (uneven where V_local is not a multiple of 3; the
    path of shards wider than ``chunks.COLUMN_BLOCK``). A case whose shapes, dtype, options and tuning
    repeat an earlier one's reuses that compiled program."""
    width = case.vocab // world
    tuning = FOUR_ROWS if blocks == "rows" else Tuning(path="chunked", chunk_bytes=1,
                                                       column_block=max(1, -(-width // 3)))
    _check_case(case, world, tuning)


@pytest.mark.parametrize("name,world", [("neg_inf_masked", 1)])
def test_chunked_vs_reference_fast(name, world):
    """The fast tier's sample of the above: a masked case with banned columns, rows in 4-row
    chunks and three column blocks."""
    case = cases.case(name)
    width = case.vocab // world
    _check_case(case, world, Tuning(path="chunked", chunk_bytes=1, column_block=max(1, -(-width // 3))))


@pytest.mark.parametrize("name", [
    pytest.param("basic", marks=pytest.mark.slow), pytest.param("bfloat16", marks=pytest.mark.slow),
    pytest.param("everything", marks=pytest.mark.slow), pytest.param("neg_inf_masked"),
    pytest.param("float64", marks=pytest.mark.slow)])
def test_whole_shard_vs_reference(name):
    """The forward that platforms other than the CPU take."""
    case = cases.case(name)
    _check_case(case, max(w for w in case.worlds if w <= 4), WHOLE)


@pytest.mark.slow
def test_chunked_under_vmap():
    """vmap over a batch of problems, 4-row chunks inside: values and gradients as the oracle."""
    from dualvp import reference

    probs = [cases.make(cases.case("random_mask_temp", seed=s)) for s in (1, 2, 3)]
    z = jnp.stack([inputs(p)[0] for p in probs])
    y = jnp.stack([inputs(p)[1] for p in probs])
    k = jnp.stack([inputs(p)[2] for p in probs])

    def loss(z, y, k):
        lp, h = _op(z, y, FOUR_ROWS, keep_mask=k, temperature=0.7)
        return jnp.sum(lp) + 0.5 * jnp.sum(h), (lp, h)

    (_, (lp, h)), g = jax.jit(jax.vmap(jax.value_and_grad(loss, has_aux=True)))(z, y, k)
    for i, p in enumerate(probs):
        kw = dict(keep_mask=p.keep_mask, temperature=0.7)
        r_lp, r_h = reference.logprob_entropy(p.logits, p.target, **kw)
        n = p.target.shape
        r_g = reference.logprob_entropy_grad(p.logits, p.target, np.ones(n), 0.5 * np.ones(n), **kw)
        check_close("vmap", lp[i], r_lp, "float32", "logprob")
        check_close("vmap", h[i], r_h, "float32", "entropy")
        check_close("vmap", g[i], r_g, "float32", "grad")


@pytest.mark.slow
@pytest.mark.parametrize("tuning", [FOUR_ROWS, Tuning(path="chunked", chunk_bytes=1, column_block=16), WHOLE],
                         ids=["chunked", "chunked_column_blocks", "whole"])
def test_masked_rows_far_below_the_max(tuning):
    """A masked row whose kept sum, shifted by the overall max, underflows is computed again with the kept max.

    Row 5 keeps only columns 120 temperature units below its (dropped) max: in float32 each of their
    e^((z - m) / tau) is 0, so the chunked forward's ``kept_shift="max"`` marks the row and ``lax.cond``
    computes the shard's chunks again with ``"kept"``. With rows in column blocks of 16 only the first
    block holds the max and is marked, and the mark must survive the merge of the blocks. The whole-shard
    forward shifts by the kept max from the start. Values and gradients as the float64 oracle.
    """
    from dualvp import reference
    rng = np.random.default_rng(7)
    T, V, tau = 16, 64, 0.5
    z = (rng.standard_normal((T, V)) * 3).astype(np.float32)
    keep = rng.random((T, V)) < 0.4
    y = rng.integers(1, V, T)
    keep[np.arange(T), y] = True
    z[5, 0], keep[5, 0] = 30.0, False
    z[5, 1:] = np.minimum(z[5, 1:], 30.0 - tau * 120.0)
    assert np.all(np.exp((z[5, 1:].astype(np.float32) - np.float32(30.0)) / np.float32(tau)) == 0)

    def loss(z, y, keep):  # target and mask arguments, not constants XLA would fold
        lp, h = _op(z, y, tuning, keep_mask=keep, temperature=tau)
        return jnp.sum(lp) + 0.5 * jnp.sum(h), (lp, h)

    (_, (lp, h)), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(jnp.asarray(z), jnp.asarray(y, jnp.int32),
                                                                      jnp.asarray(keep))
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
    lp2, h2 = _op(jnp.asarray(z2), jnp.asarray(y, jnp.int32), tuning, keep_mask=jnp.asarray(keep2), temperature=tau)
    others = np.arange(T) != 5
    np.testing.assert_array_equal(np.asarray(lp)[others], np.asarray(lp2)[others])
    np.testing.assert_array_equal(np.asarray(h)[others], np.asarray(h2)[others])
