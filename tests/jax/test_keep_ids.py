"""``keep_ids`` (the kept set as global token ids) in dualvp_jax, against the float64 oracle.

The oracle turns the ids into a mask itself (``dualvp.reference.mask_from_ids``,
a loop over ids), so each check is "keep_ids equals the keep mask built from
the same ids". The fast tier runs a few cases; the whole table
(:data:`dualvp.testing.cases.KEEP_IDS_CASES`) at W = 1 or 4 and the fused
op's table are slow.
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import dualvp_jax  # noqa: E402
from dualvp import reference, testing  # noqa: E402
from dualvp.testing import backends, cases  # noqa: E402
from dualvp_jax import function as jfunction  # noqa: E402
from dualvp_jax._tuning import Tuning  # noqa: E402

from ._helpers import mesh_1d  # noqa: E402

FAST = ("drop_target_ids", "everything_ids")


def _check(problem, out):
    bad = testing.failures(problem, {"jax": out})
    assert not bad, bad


# drop_target_ids in the slow tier (the fast tier's keep_ids: everything_ids here, and the tests below)
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "everything_ids" else pytest.mark.slow)
                                  for n in FAST])
def test_keep_ids_vs_oracle_fast(name):
    c = cases.case(name)
    p = cases.make(c)
    assert p.keep_mask is None and p.keep_ids is not None
    _check(p, backends.run("jax", p, 2))


# Every case once, at W = 1 (no axis) or W = 4 (several shards, ids in each) alternating over the table
# (each W with ids masks of several kinds); W = 2 and 8 take the W = 4 path (the fast sample above runs
# W = 2, test_keep_ids_match_the_backends_own_mask_result W = 4).
_TABLE = [pytest.param(c, 4 if i % 2 else 1, id=f"{c.name}-W{4 if i % 2 else 1}")
          for i, c in enumerate(cases.KEEP_IDS_CASES)]


@pytest.mark.slow
@pytest.mark.parametrize("c,world", _TABLE)
def test_keep_ids_whole_table(c, world):
    assert world in c.worlds, (c.name, c.worlds)
    p = cases.make(c)
    _check(p, backends.run("jax", p, world))


@pytest.mark.slow
def test_keep_ids_match_the_backends_own_mask_result():
    """The op with ids and the op with the mask made from them agree within TOLERANCES (W = 4)."""
    c = cases.case("random_mask_temp_ids")
    p = cases.make(c)
    with_ids = backends.run("jax", p, 4)
    mask = reference.mask_from_ids(p.keep_ids, c.vocab)
    masked = cases.Problem(cases.case("random_mask_temp"), p.logits, p.target, mask, p.grad_logprob, p.grad_entropy)
    with_mask = backends.run("jax", masked, 4)
    for q in ("logprob", "entropy", "grad"):
        assert testing.within_tolerance(getattr(with_ids, q), getattr(with_mask, q), testing.tolerance(c.dtype, q)), q


def _problem_with_ids(ids, name="nucleus"):
    p = cases.make(cases.case(name))
    return cases.Problem(cases.case(name + "_ids"), p.logits, p.target, None, p.grad_logprob, p.grad_entropy,
                         keep_ids=np.asarray(ids))


def test_empty_k_keeps_only_the_target():
    """``K = 0``: the kept set is the target alone (log-prob 0 on valid rows)."""
    p = _problem_with_ids(np.zeros((6, 0), np.int64))
    out = backends.run("jax", p, 2)
    _check(p, out)
    np.testing.assert_array_equal(out.logprob, 0.0)


def test_unvalidated_out_of_range_ids_are_ignored():
    """validate=False: ids outside [0, V) lie in no shard: the result is that of the in-range ids, no NaN."""
    p = cases.make(cases.case("nucleus_ids"))
    v = p.case.vocab
    ids = np.concatenate([p.keep_ids, np.array([[v, -5, 10 * v, -1]] * p.keep_ids.shape[0])], axis=-1)
    mesh = mesh_1d(2)
    z, y = jnp.asarray(p.logits, jnp.float32), jnp.asarray(p.target)
    lp, h = dualvp_jax.sharded_logprob_entropy(z, y, mesh, "tp", keep_ids=jnp.asarray(ids), validate=False)
    want, _ = reference.logprob_entropy(p.logits, p.target, keep_mask=reference.mask_from_ids(p.keep_ids, v))
    assert np.isfinite(np.asarray(lp)).all()
    assert testing.within_tolerance(np.asarray(lp, np.float64), want, testing.tolerance("float32", "logprob"))
    with pytest.raises(ValueError, match=r"keep_ids:.*expected ids in \[0, 64\)"):
        dualvp_jax.sharded_logprob_entropy(z, y, mesh, "tp", keep_ids=jnp.asarray(ids))
    with pytest.raises(ValueError, match=r"keep_ids:"):
        dualvp_jax.logprob_entropy(z, y, keep_ids=jnp.asarray(ids))


@pytest.mark.slow
def test_traced_ids_skip_the_range_check():
    """Under jit the ids are traced: no host check, out-of-range ids ignored (as validate=False)."""
    p = cases.make(cases.case("drop_target_ids"))
    v = p.case.vocab
    ids = np.concatenate([p.keep_ids, np.full((p.keep_ids.shape[0], 1), v + 3)], axis=-1)
    z, y = jnp.asarray(p.logits, jnp.float32), jnp.asarray(p.target)
    # the logits and target passed in too: closed over, XLA would constant-fold the whole forward
    lp, _ = jax.jit(lambda z, y, k: dualvp_jax.logprob_entropy(z, y, keep_ids=k))(z, y, jnp.asarray(ids))
    want, _ = reference.logprob_entropy(p.logits, p.target, keep_ids=p.keep_ids)
    assert testing.within_tolerance(np.asarray(lp, np.float64), want, testing.tolerance("float32", "logprob"))


@pytest.mark.parametrize("with_entropy,entropy_grad",
                         [(False, False), pytest.param(True, False, marks=pytest.mark.slow)])
def test_modes_without_the_entropy_gradient(with_entropy, entropy_grad):
    p = cases.make(cases.case("everything_ids"))
    c = p.case
    z, y = jnp.asarray(p.logits, jnp.float32), jnp.asarray(p.target)
    k = jnp.asarray(p.keep_ids)

    def f(z):
        lp, h = dualvp_jax.sharded_logprob_entropy(z, y, mesh_1d(2, "auto"), "tp", keep_ids=k,
                                                   temperature=c.temperature, ignore_index=c.ignore_index,
                                                   with_entropy=with_entropy, entropy_grad=entropy_grad)
        return jnp.sum(lp * jnp.asarray(p.grad_logprob, jnp.float32)) + (
            jnp.sum(h * jnp.asarray(p.grad_entropy, jnp.float32)) if with_entropy else 0.0)

    g = jax.grad(f)(z)
    want = testing.oracle(p, entropy_grad=False)
    assert testing.within_tolerance(np.asarray(g, np.float64), want.grad, testing.tolerance("float32", "grad"))


@pytest.mark.slow
@pytest.mark.parametrize("path", ["chunked", "whole"])
def test_forward_paths_and_column_blocks(path):
    """The chunked forward (small chunks, column blocks) and the whole-shard one give the oracle's answer."""
    p = cases.make(cases.case("confident_lm_bf16_ids"))
    c = p.case
    tuning = Tuning(path=path, chunk_bytes=4 * 16 * 4, column_block=48)
    z = jnp.asarray(p.logits.astype(np.float32)).astype(jnp.bfloat16)
    y, k = jnp.asarray(p.target), jnp.asarray(p.keep_ids)

    def f(z):
        return jfunction._logprob_entropy(z, y, None, None, c.temperature, True, True, c.ignore_index, tuning,
                                          keep_ids=k)

    (lp, h), vjp = jax.vjp(f, z)
    (g,) = vjp((jnp.asarray(p.grad_logprob, jnp.float32), jnp.asarray(p.grad_entropy, jnp.float32)))
    out = testing.Outputs(*(np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (lp, h, g)))
    _check(p, out)


@pytest.mark.slow
def test_fused_op_small_blocks_fast():
    """The fused LM-head op with keep_ids, vocab and token blocks smaller than the shard (loops), W = 2."""
    c = cases.case("drop_target_ids", lead=(7,))
    p = cases.make_linear(c, 16)
    mesh = mesh_1d(2)
    h, w = jnp.asarray(p.hidden, jnp.float32), jnp.asarray(p.weight, jnp.float32)
    y, k = jnp.asarray(p.target), jnp.asarray(p.keep_ids)

    @jax.jit  # forward and backward one program (eager: each its own, and the reshards)
    def run(h, w, y, k, gl, ge):
        def f(h, w):
            return dualvp_jax.sharded_linear_logprob_entropy(h, w, y, mesh, "tp", keep_ids=k,
                                                             temperature=c.temperature, token_block=3, vocab_block=5)

        (lp, en), vjp = jax.vjp(f, h, w)
        return (lp, en) + vjp((gl, ge))

    lp, en, dh, dw = run(h, w, y, k, jnp.asarray(p.grad_logprob, jnp.float32), jnp.asarray(p.grad_entropy, jnp.float32))
    out = testing.LinearOutputs(*(np.asarray(x, np.float64) for x in (lp, en, dh, dw)))
    bad = testing.failures(p, {"jax": out})
    assert not bad, bad


# Every case through the fused op once, W = 2 and 1 (no axis) alternating over the table, the other way
# round from test_keep_ids_whole_table: each case sharded in one of the two ops and unsharded in the
# other (W = 2 with small blocks: test_fused_op_small_blocks_fast).
_FUSED = [pytest.param(c, 2 - i % 2, id=f"{c.name}-W{2 - i % 2}") for i, c in enumerate(cases.KEEP_IDS_CASES)]


@pytest.mark.slow
@pytest.mark.parametrize("c,world", _FUSED)
def test_fused_op_whole_table(c, world):
    p = cases.make_linear(c, 16)
    bad = testing.failures(p, {"jax": backends.run("jax", p, world)})
    assert not bad, (world, bad)


def test_keep_ids_with_keep_mask_is_refused():
    z = jnp.zeros((4, 8), jnp.float32)
    y = jnp.zeros((4,), jnp.int32)
    with pytest.raises(ValueError, match="keep_ids:.*keep_mask"):
        dualvp_jax.logprob_entropy(z, y, keep_mask=jnp.ones((4, 8), bool), keep_ids=jnp.zeros((4, 2), jnp.int32))
    with pytest.raises(ValueError, match="keep_ids:.*keep_mask"):
        dualvp_jax.linear_logprob_entropy(jnp.zeros((4, 3)), jnp.zeros((8, 3)), y, keep_mask=jnp.ones((4, 8), bool),
                                          keep_ids=jnp.zeros((4, 2), jnp.int32))
    with pytest.raises(ValueError, match="keep_ids:.*expected ids"):
        dualvp_jax.linear_logprob_entropy(jnp.zeros((4, 3)), jnp.zeros((8, 3)), y,
                                          keep_ids=jnp.full((4, 2), 8, jnp.int32))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_scratch_at_the_bench_size(dtype):
    """jit(value_and_grad) at T = 2048, V_local = 32000, K = 64 (XLA's memory analysis, nothing run).

    float32: a few MiB of scratch beyond the arguments and the gradient (no
    [T, V_local] mask or copy). bfloat16 on XLA:CPU: the kept columns are
    written as uint16 bits (a 16-bit float scatter there upcasts the whole
    operand, 2 B), and the final bitcast back to bfloat16 is a copy: 1 B
    of scratch, pinned here so that it cannot grow unnoticed.
    """
    T, V, K = 2048, 32000, 64
    dt = jnp.dtype(dtype)
    z = jax.ShapeDtypeStruct((T, V), dt)
    y = jax.ShapeDtypeStruct((T,), jnp.int32)
    k = jax.ShapeDtypeStruct((T, K), jnp.int32)

    def loss(z, y, k):
        lp, h = dualvp_jax.logprob_entropy(z, y, keep_ids=k)
        return jnp.sum(lp) + 0.5 * jnp.sum(h)

    ma = jax.jit(jax.value_and_grad(loss)).lower(z, y, k).compile().memory_analysis()
    B = T * V * dt.itemsize
    bound = 0.05 * B if dtype == "float32" else 1.05 * B
    assert ma.temp_size_in_bytes <= bound, ma.temp_size_in_bytes / B
    assert ma.output_size_in_bytes <= 1.001 * B


def test_no_rows():
    """T = 0 (ids ``[0, K]``): empty outputs and gradients, as without ids."""
    y, k = jnp.zeros((0,), jnp.int32), jnp.zeros((0, 3), jnp.int32)
    g = jax.grad(lambda z: dualvp_jax.logprob_entropy(z, y, keep_ids=k)[0].sum())(jnp.zeros((0, 8)))
    assert g.shape == (0, 8)
    dh = jax.grad(lambda h: dualvp_jax.linear_logprob_entropy(h, jnp.ones((8, 4)), y, keep_ids=k)[0].sum())(
        jnp.zeros((0, 4)))
    assert dh.shape == (0, 4)


@pytest.mark.slow
def test_batch_invariance():
    """A row's log-prob and gradient row with keep_ids: bitwise the same alone, in 7 rows and in 257.

    At V = 1000, where the op without ids is invariant on XLA:CPU (at V = 300
    its entropy and gradient rows are not, ids or not: left to the batch
    invariance work).
    """
    rng = np.random.default_rng(0)
    T, V, K = 257, 1000, 16
    z = rng.normal(size=(T, V)).astype(np.float32) * 3
    y, ids = rng.integers(0, V, T), rng.integers(-1, V, (T, K))

    @jax.jit  # one program a row count, forward and backward (eager, each is its own program)
    def value_and_grad_rows(x, t, k):
        (lp, h), vjp = jax.vjp(lambda x: dualvp_jax.logprob_entropy(x, t, keep_ids=k), x)
        return lp, vjp((jnp.ones_like(lp), jnp.ones_like(h)))[0]

    def run(rows):
        k, t = jnp.asarray(ids[rows], jnp.int32), jnp.asarray(y[rows], jnp.int32)
        return tuple(np.asarray(a) for a in value_and_grad_rows(jnp.asarray(z[rows]), t, k))

    lp_all, g_all = run(slice(0, T))
    for i, rows in ((0, slice(0, 1)), (256, slice(256, 257)), (256, slice(250, 257))):
        lp, g = run(rows)
        j = i - rows.start
        assert np.array_equal(lp[j], lp_all[i]) and np.array_equal(g[j], g_all[i]), (i, rows)


@pytest.mark.parametrize("extra", ["multi_target", "with_sum_p2", "temperature"])
def test_keep_ids_with_an_extended_option_is_refused(extra):
    # The extended op (K targets, a temperature tensor, sum p^2) has no id path:
    # refused at check time, naming both options, rather than computed without the ids.
    z = jnp.zeros((4, 8), jnp.float32)
    y = jnp.zeros((4, 2) if extra == "multi_target" else (4,), jnp.int32)
    kw = {"temperature": jnp.ones((4,), jnp.float32)} if extra == "temperature" else {extra: True}
    with pytest.raises(NotImplementedError, match="keep_ids.*(multi_target|with_sum_p2|temperature)"):
        dualvp_jax.logprob_entropy(z, y, keep_ids=jnp.zeros((4, 2), jnp.int32), **kw)
    with pytest.raises(NotImplementedError, match="keep_ids.*(multi_target|with_sum_p2|temperature)"):
        dualvp_jax.sharded_logprob_entropy(z, y, mesh_1d(1), "tp", keep_ids=jnp.zeros((4, 2), jnp.int32), **kw)
