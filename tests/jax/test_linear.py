"""dualvp_jax.linear_logprob_entropy (fused LM head) against an independent float64 formulation.

The judge: ``z64 = h64 @ W64^T`` in float64 from the dtype-rounded inputs, then
the float64 oracle ``dualvp.reference`` on the full logits, and the chain rule
``dh = G @ W``, ``dW = G^T h`` in float64 (``G``: the oracle's logits gradient).
"""


import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import dualvp_jax  # noqa: E402
from dualvp import reference  # noqa: E402
from dualvp.testing import cases, metrics  # noqa: E402
from ._helpers import put  # noqa: E402

_JNP = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float64": jnp.float64}
_H = 24
_V_LOCAL = 1001  # divides no block size
_BLOCKS = dict(token_block=16, vocab_block=256)  # T = 37 or 36: a short last chunk; 1001 = 3 * 256 + 233


def _oracle(h, w, target, gl, ge, *, keep=None, temperature=1.0, ignore_index=-100):
    """Float64 log-prob, entropy, dh, dW of the full problem (h [T, H], w [V, H] float64)."""
    z = h @ w.T
    kw = dict(keep_mask=keep, temperature=temperature, ignore_index=ignore_index)
    lp, ent = reference.logprob_entropy(z, target, **kw)
    g = reference.logprob_entropy_grad(z, target, gl, ge, **kw)
    return lp, ent, g @ w, g.T @ h


def _problem(T, world, dtype, *, mask=False, ignore=False, seed=0, lead=None):
    """Rounded float64 inputs, the full vocab ``world * 1001``, cotangents."""
    rng = np.random.default_rng(seed)
    V = world * _V_LOCAL
    shape = lead if lead is not None else (T,)
    h = cases.round_to_dtype(rng.normal(size=shape + (_H,)), dtype)
    # logits of std ~ 2.5 with some confident rows
    w = cases.round_to_dtype(rng.normal(scale=0.5, size=(V, _H)), dtype)
    y = rng.integers(0, V, size=shape)
    if ignore:
        y = np.where(rng.random(shape) < 0.3, -100, y)
        y.reshape(-1)[0] = -100
    keep = rng.random(shape + (V,)) < 0.4 if mask else None
    gl = rng.normal(size=shape)
    ge = rng.normal(size=shape)
    return h, w, y, keep, gl, ge


def _check(name, x, ref, dtype, quantity):
    x = np.asarray(x).astype(np.float64)  # on the host (exact), no XLA program
    assert x.shape == ref.shape, (name, x.shape, ref.shape)
    tol = metrics.tolerance(dtype, quantity)
    assert metrics.within_tolerance(x, ref, tol), f"{name}: max errors (abs, rel) {metrics.max_errors(x, ref)} > {tol}"


def _check_all(out, ref, dtype, with_entropy=True):
    lp, ent, dh, dw = out
    rlp, rent, rdh, rdw = ref
    _check("logprob", lp, rlp, dtype, "logprob")
    if with_entropy:
        _check("entropy", ent, rent, dtype, "entropy")
    else:
        assert ent is None
    _check("dh", dh, rdh, dtype, "grad")
    _check("dW", dw, rdw, dtype, "grad")


def _jx(x, dtype):
    """Already rounded to ``dtype``: converted on the host (device_put compiles nothing)."""
    return put(x if dtype == "float64" else np.asarray(x, np.float32), _JNP[dtype])


# --- unsharded -------------------------------------------------------------------

_SCENARIOS = {
    "plain": dict(),
    "mask_temp": dict(mask=True, temperature=0.7),
    "ignore_no_entropy_grad": dict(ignore=True, entropy_grad=False, temperature=1.6),
    "no_entropy_mask": dict(mask=True, ignore=True, with_entropy=False),
}


@functools.partial(jax.jit, static_argnames=("temperature", "with_entropy", "entropy_grad", "blocks"))
def _unsharded_vjp(h, w, y, keep, gl, ge, *, temperature, with_entropy, entropy_grad, blocks):
    """Forward and backward in one program (eager, each would be its own); every array an argument."""
    def f(h, w):
        return dualvp_jax.linear_logprob_entropy(h, w, y, keep_mask=keep, temperature=temperature,
                                                 with_entropy=with_entropy, entropy_grad=entropy_grad, **dict(blocks))

    (lp, ent), vjp = jax.vjp(f, h, w)
    return (lp, ent) + vjp((gl, ge if with_entropy else None))


def _run_unsharded(h, w, y, keep, gl, ge, dtype, *, temperature=1.0, with_entropy=True, entropy_grad=True,
                   blocks=_BLOCKS):
    hj, wj = _jx(h, dtype), _jx(w, dtype)
    cdt = np.float64 if dtype == "float64" else np.float32
    lp, ent, dh, dw = _unsharded_vjp(hj, wj, put(y), None if keep is None else put(keep), put(gl, cdt), put(ge, cdt),
                                     temperature=temperature, with_entropy=with_entropy, entropy_grad=entropy_grad,
                                     blocks=tuple(sorted(blocks.items())))
    assert lp.dtype == cdt and dh.dtype == hj.dtype and dw.dtype == wj.dtype
    return lp, ent, dh, dw


# Each scenario once, the dtypes alternating: bfloat16 with and without the entropy (a masked scenario
# each), float32 in the other two (float32 with a mask: test_block_sizes_and_batch_dims).
_UNSHARDED = [("plain", "float32"), ("mask_temp", "bfloat16"), ("ignore_no_entropy_grad", "float32"),
              ("no_entropy_mask", "bfloat16")]


@pytest.mark.slow
@pytest.mark.parametrize("scenario,dtype", _UNSHARDED, ids=[f"{s}-{d}" for s, d in _UNSHARDED])
def test_unsharded_vs_float64(scenario, dtype):
    """Each scenario against the float64 formulation; "plain" with targets in the last vocab block and in the
    last column: counted once (no overlapping block)."""
    sc = dict(_SCENARIOS[scenario])
    h, w, y, keep, gl, ge = _problem(37, 1, dtype, mask=sc.pop("mask", False), ignore=sc.pop("ignore", False))
    if scenario == "plain":
        y[::2] = _V_LOCAL - 1  # the last column
        y[1::4] = 770  # in the short last block [768, 1001)
    out = _run_unsharded(h, w, y, keep, gl, ge, dtype, **sc)
    ge_ref = ge if sc.get("with_entropy", True) and sc.get("entropy_grad", True) else None
    ref = _oracle(h, w, y, gl, ge_ref, keep=keep, temperature=sc.get("temperature", 1.0))
    _check_all(out, ref, dtype, with_entropy=sc.get("with_entropy", True))


@pytest.mark.parametrize("blocks", [dict(), pytest.param(dict(token_block=5, vocab_block=1000), marks=pytest.mark.slow),
                                    pytest.param(dict(token_block=64, vocab_block=7), marks=pytest.mark.slow)],
                         ids=["default", "vocab_1000", "vocab_7"])
def test_block_sizes_and_batch_dims(blocks):
    """Default (one block), a last block of one column, many small blocks; leading dims [2, 3]."""
    h, w, y, keep, gl, ge = _problem(None, 1, "float32", mask=True, lead=(2, 3), seed=3)
    out = _run_unsharded(h, w, y, keep, gl, ge, "float32", temperature=0.5, blocks=blocks)
    ref = _oracle(h.reshape(6, _H), w, y.reshape(6), gl.reshape(6), ge.reshape(6), keep=keep.reshape(6, -1),
                  temperature=0.5)
    ref = (ref[0].reshape(2, 3), ref[1].reshape(2, 3), ref[2].reshape(2, 3, _H), ref[3])
    _check_all(out, ref, "float32")


@pytest.mark.slow
def test_float64_under_x64():
    """float64 inputs compute in float64 (jax_enable_x64, scoped to the test)."""
    h, w, y, keep, gl, ge = _problem(37, 1, "float64", mask=True, ignore=True, seed=6)
    with jax.enable_x64(True):
        lp, ent, dh, dw = _run_unsharded(h, w, y, keep, gl, ge, "float64", temperature=0.3)
        assert lp.dtype == dh.dtype == dw.dtype == jnp.float64
        out = [np.asarray(x) for x in (lp, ent, dh, dw)]
    ref = _oracle(h, w, y, gl, ge, keep=keep, temperature=0.3)
    for name, x, r, q in zip(("logprob", "entropy", "dh", "dW"), out, ref, ("logprob", "entropy", "grad", "grad")):
        tol = metrics.tolerance("float64", q)
        assert metrics.within_tolerance(x, r, tol), f"{name}: {metrics.max_errors(x, r)} > {tol}"


# --- shard_map over host devices ---------------------------------------------------


def _mesh(world):
    return Mesh(np.array(jax.devices()[:world]), ("tp",))


def _run_shard_map(h, w, y, keep, gl, ge, dtype, world, *, temperature=1.0, mode="replicated"):
    """Per-shard op inside a user shard_map; ``mode``: replicated | partial | pcast | sequence_parallel."""
    mesh = _mesh(world)
    has_mask = keep is not None
    kw = dict(temperature=temperature, **_BLOCKS)

    def body(h, w, y, *k):
        opts = dict(kw, axis_name="tp", keep_mask=k[0] if has_mask else None)
        if mode == "partial":
            opts["reduce_hidden_grad"] = False
        if mode == "pcast":
            h = lax.pcast(h, "tp", to="varying")
            opts["reduce_hidden_grad"] = False
        if mode == "sequence_parallel":
            opts["sequence_parallel"] = True
        return dualvp_jax.linear_logprob_entropy(h, w, y, **opts)

    h_spec = P("tp") if mode in ("partial", "sequence_parallel") else P()
    in_specs = (h_spec, P("tp"), P()) + ((P(None, "tp"),) if has_mask else ())
    sm = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(P(), P()), check_vma=True)
    if mode == "partial":  # every shard gets its own copy of h, so each returns its partial dh
        h = np.tile(h, (world, 1))
    hj = _jx(h, dtype)
    extra = (put(keep),) if has_mask else ()

    # every array an argument: closed over, it would be a constant that XLA folds (seconds of compile)
    @jax.jit
    def run(hj, wj, yj, extra, glj, gej):
        (lp, ent), vjp = jax.vjp(lambda a, b: sm(a, b, yj, *extra), hj, wj)
        dh, dw = vjp((glj, gej))
        return lp, ent, dh, dw

    return run(hj, _jx(w, dtype), put(y), extra, put(gl, np.float32), put(ge, np.float32))


# W = 2 in float32 through the same per-shard op in the library's shard_map:
# test_sharded_global_form[auto-2-False] (and test_sharded_global_form_keeps_data_parallel_rows[True] with
# sequence_parallel).
@pytest.mark.slow
@pytest.mark.parametrize("world,dtype", [(4, "bfloat16")])
def test_shard_map_vs_float64(world, dtype):
    h, w, y, keep, gl, ge = _problem(37, world, dtype, mask=True, ignore=True, seed=world)
    out = _run_shard_map(h, w, y, keep, gl, ge, dtype, world, temperature=0.7)
    _check_all(out, _oracle(h, w, y, gl, ge, keep=keep, temperature=0.7), dtype)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2])
def test_partial_hidden_grad_sums_to_full(world):
    """reduce_hidden_grad=False: each shard's dh is partial (not the total); their sum is."""
    h, w, y, keep, gl, ge = _problem(37, world, "float32", seed=10 + world)
    lp, ent, dh_stack, dw = _run_shard_map(h, w, y, None, gl, ge, "float32", world, mode="partial")
    ref = _oracle(h, w, y, gl, ge)
    parts = np.asarray(dh_stack, np.float64).reshape(world, 37, _H)
    # a partial is the contribution of one shard's vocab rows: far from the total
    assert not metrics.within_tolerance(parts[0], ref[2], metrics.tolerance("float32", "grad"))
    _check_all((lp, ent, parts.sum(axis=0), dw), ref, "float32")


@pytest.mark.slow
def test_pcast_hidden_with_partial_grad():
    """The Megatron pattern: hidden made varying by the caller (whose transpose sums), op reduces nothing."""
    h, w, y, keep, gl, ge = _problem(37, 2, "float32", mask=True, seed=20)
    out = _run_shard_map(h, w, y, keep, gl, ge, "float32", 2, mode="pcast")
    _check_all(out, _oracle(h, w, y, gl, ge, keep=keep), "float32")


@pytest.mark.slow
@pytest.mark.parametrize("world,dtype", [(4, "bfloat16")])
def test_sequence_parallel_vs_float64(world, dtype):
    h, w, y, keep, gl, ge = _problem(36, world, dtype, mask=True, ignore=True, seed=30 + world)
    out = _run_shard_map(h, w, y, keep, gl, ge, dtype, world, temperature=1.3, mode="sequence_parallel")
    _check_all(out, _oracle(h, w, y, gl, ge, keep=keep, temperature=1.3), dtype)


# --- global arrays on a mesh --------------------------------------------------------


def _args(y, keep, gl, ge):
    """Target, keep mask and cotangents as arguments of the jitted program (not constants XLA would fold)."""
    return put(y), put(keep), put(gl, np.float32), put(ge, np.float32)


# sequence_parallel on an explicit mesh (tp = 2, rows over dp): test_sharded_global_form_keeps_data_parallel_rows.
@pytest.mark.slow
@pytest.mark.parametrize("kind,world,sp", [("explicit", 4, False), ("auto", 2, False)])
def test_sharded_global_form(kind, world, sp):
    h, w, y, keep, gl, ge = _problem(36, world, "float32", mask=True, ignore=True, seed=40 + world)
    mesh = jax.make_mesh((world,), ("tp",)) if kind == "explicit" else _mesh(world)

    @jax.jit
    def run(hj, wj, yj, kj, glj, gej):
        def f(hj, wj):
            return dualvp_jax.sharded_linear_logprob_entropy(hj, wj, yj, mesh, "tp", keep_mask=kj, temperature=0.8,
                                                             sequence_parallel=sp, **_BLOCKS)

        (lp, ent), vjp = jax.vjp(f, hj, wj)
        return (lp, ent) + vjp((glj, gej))

    with jax.set_mesh(mesh):
        out = run(_jx(h, "float32"), _jx(w, "float32"), *_args(y, keep, gl, ge))
    _check_all(out, _oracle(h, w, y, gl, ge, keep=keep, temperature=0.8), "float32")


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True])
def test_sharded_global_form_keeps_data_parallel_rows(sp):
    """On an explicit ``(dp, tp)`` mesh the rows stay split over ``dp``: each replica computes its own rows.

    Before, hidden and target were resharded to replicated, and the outputs
    came back replicated (every dp replica computed every row); the
    gradients still match the float64 oracle (``dW`` summed over ``dp``).
    """
    h, w, y, keep, gl, ge = _problem(36, 2, "float32", mask=True, ignore=True, seed=47)
    mesh = jax.make_mesh((2, 2), ("dp", "tp"))

    @jax.jit
    def run(hj, wj, yj, kj, glj, gej):
        def f(hj, wj):
            return dualvp_jax.sharded_linear_logprob_entropy(hj, wj, yj, mesh, "tp", keep_mask=kj, temperature=0.8,
                                                             sequence_parallel=sp, **_BLOCKS)

        (lp, ent), vjp = jax.vjp(f, hj, wj)
        return (lp, ent) + vjp((glj, gej))

    with jax.set_mesh(mesh):
        # from the host: resharding a device array would compile a program
        hj = jax.device_put(np.asarray(h, np.float32), jax.sharding.NamedSharding(mesh, P("dp", None)))
        yj, kj, _, _ = _args(y, keep, gl, ge)
        # the cotangents sharded as the outputs they go with (rows over dp)
        glj, gej = (jax.device_put(np.asarray(a, np.float32), jax.sharding.NamedSharding(mesh, P("dp")))
                    for a in (gl, ge))
        out = run(hj, _jx(w, "float32"), yj, kj, glj, gej)
    for x in out[:3]:  # log-prob, entropy and dh: rows split over dp, not replicated
        assert tuple(x.sharding.spec)[:1] == ("dp",), x.sharding.spec
    _check_all(out, _oracle(h, w, y, gl, ge, keep=keep, temperature=0.8), "float32")


# --- bad inputs ------------------------------------------------------------------


def _base():
    rng = np.random.default_rng(0)
    return dict(hidden=jnp.asarray(rng.normal(size=(4, 8)), jnp.float32),
                weight=jnp.asarray(rng.normal(size=(10, 8)), jnp.float32),
                target=jnp.asarray([0, 3, 9, -100]))


_BAD = [
    ("h_mismatch", dict(weight=jnp.zeros((10, 7), jnp.float32)), ValueError, "weight"),
    ("weight_1d", dict(weight=jnp.zeros((10,), jnp.float32)), ValueError, "weight"),
    ("weight_dtype", dict(weight=jnp.zeros((10, 8), jnp.bfloat16)), TypeError, "weight"),
    ("hidden_int", dict(hidden=jnp.zeros((4, 8), jnp.int32)), TypeError, "hidden"),
    ("hidden_list", dict(hidden=[[0.0] * 8] * 4), TypeError, "hidden"),
    ("target_rows", dict(target=jnp.zeros((5,), jnp.int32)), ValueError, "target"),
    ("target_range", dict(target=jnp.asarray([0, 3, 10, 1])), ValueError, "target"),
    ("keep_mask_shape", dict(keep_mask=jnp.ones((4, 9), bool)), ValueError, "keep_mask"),
    ("keep_mask_dtype", dict(keep_mask=jnp.ones((4, 10), jnp.float32)), TypeError, "keep_mask"),
    ("temperature_zero", dict(temperature=0.0), ValueError, "temperature"),
    ("reduce_flag", dict(reduce_hidden_grad=1), TypeError, "reduce_hidden_grad"),
    ("sp_without_axis", dict(sequence_parallel=True), ValueError, "sequence_parallel"),
    ("token_block_zero", dict(token_block=0), ValueError, "token_block"),
    ("vocab_block_float", dict(vocab_block=2.0), TypeError, "vocab_block"),
    ("budget_negative", dict(memory_budget=-1), ValueError, "memory_budget"),
    ("axis_unbound", dict(axis_name="tp"), ValueError, "axis_name"),
]


@pytest.mark.parametrize("changes,error,arg", [b[1:] for b in _BAD], ids=[b[0] for b in _BAD])
def test_bad_input_raises(changes, error, arg):
    kw = _base()
    kw.update(changes)
    with pytest.raises(error) as info:
        dualvp_jax.linear_logprob_entropy(kw.pop("hidden"), kw.pop("weight"), kw.pop("target"), **kw)
    msg = str(info.value)
    assert msg.startswith(f"{arg}:") and "expected" in msg, msg


def test_base_is_valid():
    kw = _base()
    lp, ent = dualvp_jax.linear_logprob_entropy(kw["hidden"], kw["weight"], kw["target"])
    assert lp.shape == ent.shape == (4,)


def _shard_map_error(body, in_specs, args, world=2):
    sm = jax.shard_map(body, mesh=_mesh(world), in_specs=in_specs, out_specs=P(), check_vma=True)
    with pytest.raises(ValueError) as info:
        jax.jit(sm)(*args)
    return str(info.value)


def test_sequence_parallel_rows_not_dividing():
    rng = np.random.default_rng(1)
    h, w = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32), jnp.asarray(rng.normal(size=(20, 8)), jnp.float32)
    # per shard: 2 rows of hidden; target's 5 rows do not divide over the 2 shards (the shared message of
    # dualvp.validation.check_linear_args names sequence_parallel), target's 6 rows are 3 per shard, not 2
    for n, arg in ((5, "sequence_parallel"), (6, "hidden")):
        msg = _shard_map_error(
            lambda h, w, y: dualvp_jax.linear_logprob_entropy(h, w, y, axis_name="tp", sequence_parallel=True)[0],
            (P("tp"), P("tp"), P()), (h, w, jnp.zeros((n,), jnp.int32)))
        assert msg.startswith(f"{arg}:") and "expected" in msg, msg
    # global form: T = 5 rows do not divide over 2 shards
    with pytest.raises(ValueError) as info:
        dualvp_jax.sharded_linear_logprob_entropy(jnp.zeros((5, 8)), w, jnp.zeros((5,), jnp.int32), _mesh(2), "tp",
                                                  sequence_parallel=True)
    assert str(info.value).startswith("hidden:"), str(info.value)
    with pytest.raises(ValueError) as info:
        dualvp_jax.sharded_linear_logprob_entropy(h, jnp.zeros((21, 8)), jnp.zeros((4,), jnp.int32), _mesh(2), "tp")
    assert str(info.value).startswith("weight:"), str(info.value)


def test_varying_types_must_fit_the_flags():
    """A replicated hidden with reduce_hidden_grad=False, or a varying one with True, would scale dh: refused."""
    rng = np.random.default_rng(2)
    h, w = jnp.asarray(rng.normal(size=(4, 8)), jnp.float32), jnp.asarray(rng.normal(size=(20, 8)), jnp.float32)
    y = jnp.zeros((4,), jnp.int32)
    msg = _shard_map_error(
        lambda h, w, y: dualvp_jax.linear_logprob_entropy(h, w, y, axis_name="tp", reduce_hidden_grad=False)[0],
        (P(), P("tp"), P()), (h, w, y))
    assert msg.startswith("reduce_hidden_grad:"), msg
    msg = _shard_map_error(
        lambda h, w, y: dualvp_jax.linear_logprob_entropy(lax.pcast(h, "tp", to="varying"), w, y, axis_name="tp")[0],
        (P(), P("tp"), P()), (h, w, y))
    assert msg.startswith("hidden:"), msg
    msg = _shard_map_error(
        lambda h, w, y: dualvp_jax.linear_logprob_entropy(h, w, y, axis_name="tp")[0],
        (P(), P(), P()), (h, w, y))
    assert msg.startswith("weight:"), msg


# --- memory ------------------------------------------------------------------------


def _temp_bytes(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_no_logits_sized_buffer(dtype):
    """Forward + backward scratch stays far below one [T, V_local] float32 buffer; the unfused path does not."""
    T, H, V = 512, 64, 8192
    rng = np.random.default_rng(5)
    h = put(rng.normal(size=(T, H)), _JNP[dtype])
    w = put(rng.normal(size=(V, H)) * 0.1, _JNP[dtype])
    y = put(rng.integers(0, V, T))
    logits_f32 = T * V * 4

    def fused(h, w):
        lp, ent = dualvp_jax.linear_logprob_entropy(h, w, y, vocab_block=512)
        return jnp.sum(lp) + jnp.sum(ent)

    def unfused(h, w):
        lp, ent = dualvp_jax.logprob_entropy(h @ w.T, y)
        return jnp.sum(lp) + jnp.sum(ent)

    fused_b = _temp_bytes(jax.value_and_grad(fused, argnums=(0, 1)), h, w)
    unfused_b = _temp_bytes(jax.value_and_grad(unfused, argnums=(0, 1)), h, w)
    assert unfused_b >= T * V * jnp.dtype(_JNP[dtype]).itemsize  # the measurement sees a logits buffer
    assert fused_b < 0.25 * logits_f32, (fused_b, logits_f32)


# --- frozen weight / frozen hidden: the dead GEMM is not compiled -------------------


def _dot_kinds(fn, args, T, V_local, H, blocks):
    """``(counts, compiled)``: output shapes of the dot/convolution ops of the compiled ``fn``, as
    ``{"logits", "dh", "dW"}`` counts, and the compiled ``fn`` itself (to run the program that was counted).

    The sizes are chosen disjoint: token blocks (rows), vocab blocks (columns) and H never coincide, so a
    dot ``[rows, H]`` is a ``dh`` GEMM, ``[cols, H]`` a ``dW`` GEMM and ``[rows, cols]`` a logits block.
    """
    import re

    tb, vb = blocks["token_block"], blocks["vocab_block"]
    rows = {tb, T % tb} - {0}
    cols = {vb, V_local % vb} - {0}
    assert not (rows & cols) and H not in rows | cols
    compiled = jax.jit(fn).lower(*args).compile()
    text = compiled.as_text()
    kinds = {"logits": 0, "dh": 0, "dW": 0}
    for shape in re.findall(r"= \w+\[(\d+),(\d+)\]\S* (?:dot|convolution)\(", text):
        a, b = map(int, shape)
        kind = "logits" if (a in rows and b in cols) else "dh" if (a in rows and b == H) else \
            "dW" if (a in cols and b == H) else None
        assert kind is not None, (a, b)
        kinds[kind] += 1
    return kinds, compiled


@pytest.mark.slow
@pytest.mark.parametrize("world", [2])  # inside shard_map: the same block loops as W = 1, and the psum of dh
def test_frozen_input_skips_its_gemm(world):
    """jax.grad w.r.t. hidden only (frozen weight) compiles no dW GEMM, w.r.t. weight only no dh GEMM.

    XLA's dead-code elimination drops the unused accumulator of the custom_vjp's backward loops (and, for a
    frozen hidden, its psum over the axis); this pins it, counted in the compiled HLO.
    """
    h, w, y, keep, gl, ge = _problem(37, world, "float32", mask=True, seed=50)
    hj, wj, yj, kj = _jx(h, "float32"), _jx(w, "float32"), put(y), put(keep)

    def op(h, w, y, k, **kw):
        return dualvp_jax.linear_logprob_entropy(h, w, y, keep_mask=k, temperature=0.9, **_BLOCKS, **kw)

    if world == 1:
        f = op
    else:
        f = jax.shard_map(lambda a, b, y, k: op(a, b, y, k, axis_name="tp"), mesh=_mesh(world),
                          in_specs=(P(), P("tp"), P(), P(None, "tp")), out_specs=(P(), P()), check_vma=True)

    def loss(a, b, y, k, gl, ge):  # y, k and the cotangents arguments: no constants for XLA to fold
        lp, ent = f(a, b, y, k)
        return jnp.sum(lp * gl) + jnp.sum(ent * ge)

    args = (hj, wj, yj, kj, put(gl, np.float32), put(ge, np.float32))
    count = lambda argnums: _dot_kinds(jax.grad(loss, argnums), args, 37, _V_LOCAL, _H, _BLOCKS)  # noqa: E731
    (dh_only, dh_prog), (dw_only, dw_prog) = count(0), count(1)
    # each program has the GEMMs of its own gradient (the count sees them) and none of the other's
    assert dh_only["dW"] == 0 and dh_only["dh"] > 0 and dh_only["logits"] > 0, dh_only
    assert dw_only["dh"] == 0 and dw_only["dW"] > 0 and dw_only["logits"] > 0, dw_only
    # the gradient asked for is still right (the very programs counted above, not a second compilation)
    ref = _oracle(h, w, y, gl, ge, keep=keep, temperature=0.9)
    _check("dh", dh_prog(*args), ref[2], "float32", "grad")
    _check("dW", dw_prog(*args), ref[3], "float32", "grad")
