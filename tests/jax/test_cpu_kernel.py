"""dualvp_jax.cpu_kernel: the CPU custom call for the forward's row sums, against the spec in float64.

The op's own tests (tests/jax, tests/cross) run through the kernel wherever it
takes the call (float32 and bfloat16 logits on the CPU, the default path);
tests/jax/test_jax_memory.py runs both CPU paths. Here: the kernel's sums
themselves, row by row, against ``spec.block_sums`` in float64 on the same
(rounded) inputs, at widths around its lane and block sizes, with the rows
it must flag; that the op takes it by default; and the fallback when it
cannot be built.
"""

import warnings

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import dualvp_jax  # noqa: E402
import dualvp_jax.function as fn_mod  # noqa: E402
from dualvp import reference, spec  # noqa: E402
from dualvp_jax import cpu_kernel  # noqa: E402

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="a CPU kernel")


@pytest.fixture(scope="module")
def kernel():
    if cpu_kernel._compiler() is None:
        pytest.skip("no C++ compiler on this machine (the op falls back to XLA; see test_fallback_*)")
    # With a compiler the build must succeed: a broken kernel would otherwise
    # only show as the slower path.
    assert cpu_kernel.available(), cpu_kernel.unavailable_reason()


def _f32(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def _problem(rng, n, v, dtype, masked):
    z = (rng.standard_normal((n, v)) * 3 + 10).astype(np.float32)
    keep = rng.random((n, v)) < 0.3 if masked else None
    if n >= 6 and v >= 4:
        z[0, : v // 2] = -np.inf  # banned columns
        z[1] = -np.inf  # a row of banned columns only
        z[2, 1] = np.nan
        z[3, 2] = np.inf
        z[4, 0] = 40.0  # a dominant column: e = 1 there, the rest tiny
        if masked:
            keep[5] = False  # nothing kept
            keep[4, 0] = False
    return jnp.asarray(z).astype(dtype), keep


def _oracle(z, keep, tau, with_entropy):
    with np.errstate(all="ignore"):
        return [np.asarray(x, np.float64) for x in
                spec.block_sums(np, _f32(z), keep, tau, with_entropy=with_entropy, entropy_terms="select")]


@pytest.mark.parametrize("tau", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [True, False], ids=["ent", "lp"])
@pytest.mark.parametrize("masked", [False, True], ids=["all", "keep"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("v", [1, 3, 63, 64, 65, 511, 512, 513, 1100, 5000])
def test_sums_vs_float64(kernel, v, dtype, masked, with_entropy, tau):
    """(m, s, t, sk) within a few float32 roundings of float64; the rows holding NaN or +inf flagged (NaN)."""
    rng = np.random.default_rng(v)
    n = 37
    z, keep = _problem(rng, n, v, dtype, masked)
    got = [np.asarray(x, np.float64) for x in
           jax.jit(lambda z, k: cpu_kernel.block_sums(z, k, tau, with_entropy))(z, None if keep is None else
                                                                               jnp.asarray(keep))]
    want = _oracle(z, keep, tau, with_entropy)
    zf = _f32(z)
    special = np.isnan(zf).any(-1) | np.isposinf(zf).any(-1)
    # Each term's d = (z - m) / tau is rounded to float32 first (as in every float32 evaluation of the
    # formula): e^d moves by |d| eps e, e d by (|d| + 1) eps |e d|. So the bound on a sum is a few
    # roundings of the sum plus a few of sum e |d| (s, sk) or sum e d^2 (t); the absolute term is the
    # kept terms' floor (float32's smallest normal number here, float64's in the oracle).
    eps = 2.0**-24
    with np.errstate(all="ignore"):
        d = (zf - np.where(np.isneginf(want[0]), 0.0, want[0])[:, None]) / tau
        e = np.exp(d)
        ed = np.where(e > 0, e * np.abs(d), 0.0)
        ed2 = np.where(e > 0, ed * np.abs(d), 0.0)
    kept = np.zeros_like(zf, bool) if keep is None else keep
    bound = {"s": 4 * eps * want[1] + 3 * eps * ed.sum(-1),
             "t": 4 * eps * np.abs(want[2]) + 3 * eps * ed2.sum(-1),
             "sk": 4 * eps * want[3] + 3 * eps * np.where(kept, ed, 0.0).sum(-1) + v * 2.0**-126}
    for name, g, w in zip("m s t sk".split(), got, want):
        assert np.all(np.isnan(g[special])), (name, g[special])
        g, w = g[~special], w[~special]
        if name == "m":
            assert np.array_equal(g, w), name
            continue
        tol = bound[name][~special]
        assert np.all(np.abs(g - w) <= tol), (name, np.max(np.abs(g - w) / tol))


def test_sums_many_rows_and_batch_dims(kernel):
    """Rows in every band of every thread, leading dims kept: row r is row r of the spec's result."""
    rng = np.random.default_rng(1)
    z = jnp.asarray((rng.standard_normal((3, 333, 700)) * 2).astype(np.float32))
    keep = rng.random((3, 333, 700)) < 0.5
    got = np.stack([np.asarray(x) for x in cpu_kernel.block_sums(z, jnp.asarray(keep), 1.0, True)], -1)
    want = np.stack(_oracle(z, keep, 1.0, True), -1)
    assert got.shape == (3, 333, 4)
    np.testing.assert_allclose(got, want, rtol=3e-7, atol=1e-30)


def test_sums_under_vmap(kernel):
    rng = np.random.default_rng(2)
    z = jnp.asarray(rng.standard_normal((4, 9, 130)).astype(np.float32))
    got = jax.vmap(lambda z: jnp.stack(cpu_kernel.block_sums(z, None, 0.5, True), -1))(z)
    want = np.stack(_oracle(z, None, 0.5, True), -1)
    np.testing.assert_allclose(np.asarray(got), want, rtol=3e-7, atol=1e-30)


def test_op_takes_the_kernel_by_default(kernel):
    """float32 and bfloat16 logits: the op's CPU program holds the custom call; float16 takes the chunked one."""
    def hlo(dtype, masked):
        z = jax.ShapeDtypeStruct((64, 1000), dtype)
        y = jax.ShapeDtypeStruct((64,), jnp.int32)
        k = jax.ShapeDtypeStruct((64, 1000), jnp.bool_) if masked else None
        f = jax.jit(jax.value_and_grad(lambda z, y, k: jnp.sum(sum(dualvp_jax.logprob_entropy(z, y, keep_mask=k)))))
        return f.lower(z, y, k).as_text()

    for masked in (False, True):
        assert cpu_kernel.TARGET in hlo(jnp.float32, masked)
        assert cpu_kernel.TARGET in hlo(jnp.bfloat16, masked)
        assert cpu_kernel.TARGET not in hlo(jnp.float16, masked)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_op_kernel_and_chunked_paths_agree(kernel, monkeypatch, dtype):
    """Both CPU programs, forced in turn, against the float64 oracle and within float32 rounding of each other."""
    rng = np.random.default_rng(3)
    T, V, tau = 50, 3000, 0.8
    z = jnp.asarray((rng.standard_normal((T, V)) * 4).astype(np.float32)).astype(dtype)
    y = jnp.asarray(rng.integers(0, V, T), jnp.int32)
    keep = jnp.asarray(rng.random((T, V)) < 0.2)

    def run(path):
        jax.clear_caches()
        monkeypatch.setattr(fn_mod, "_FORCE_PATH", path)

        def loss(z):
            lp, h = dualvp_jax.logprob_entropy(z, y, keep_mask=keep, temperature=tau)
            return jnp.sum(lp) + 0.5 * jnp.sum(h), (lp, h)

        (_, (lp, h)), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(z)
        return [np.asarray(x, np.float64) for x in (lp, h, g.astype(jnp.float32))]

    try:
        k_out, c_out = run("kernel"), run("chunked")
    finally:
        jax.clear_caches()
    zf = _f32(z)
    kw = dict(keep_mask=np.asarray(keep), temperature=tau)
    r_lp, r_h = reference.logprob_entropy(zf, np.asarray(y), **kw)
    r_g = reference.logprob_entropy_grad(zf, np.asarray(y), np.ones(T), 0.5 * np.ones(T), **kw)
    # the gradient is rounded to the logits' dtype last
    tols = {"logprob": 2e-6, "entropy": 2e-6, "grad": 1e-6 if dtype == "float32" else 2.0**-8}
    for i, (name, ref) in enumerate((("logprob", r_lp), ("entropy", r_h), ("grad", r_g))):
        for path, out in (("kernel", k_out), ("chunked", c_out)):
            err = np.max(np.abs(out[i] - ref) / np.maximum(np.abs(ref), 1.0))
            assert err <= tols[name], (name, path, err)


def test_fallback_without_a_compiler(monkeypatch, tmp_path):
    """No compiler: one RuntimeWarning naming why, then the chunked program (the same results)."""
    monkeypatch.setattr(cpu_kernel, "_state", {})
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("DUALVP_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        assert not cpu_kernel.available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not cpu_kernel.available()  # decided once: no second warning
        assert not cpu_kernel.eligible(jnp.float32, 1.0)
    jax.clear_caches()
    try:
        z = jax.ShapeDtypeStruct((8, 100), jnp.float32)
        y = jax.ShapeDtypeStruct((8,), jnp.int32)
        txt = jax.jit(lambda z, y: dualvp_jax.logprob_entropy(z, y)).lower(z, y).as_text()
        assert cpu_kernel.TARGET not in txt
    finally:
        jax.clear_caches()


def _op_hlo(**kw):
    z = jax.ShapeDtypeStruct((8, 100), jnp.float32)
    y = jax.ShapeDtypeStruct((8,), jnp.int32)
    return jax.jit(lambda z, y: dualvp_jax.logprob_entropy(z, y, **kw)).lower(z, y).as_text()


def test_turned_off_by_the_environment(kernel, monkeypatch):
    """``DUALVP_JAX_CPU_KERNEL=0``, read at each call: the XLA path, with no new trace needed (jit keys on it)."""
    assert cpu_kernel.TARGET in _op_hlo()
    monkeypatch.setenv("DUALVP_JAX_CPU_KERNEL", "0")
    assert not cpu_kernel.enabled()
    assert cpu_kernel.TARGET not in _op_hlo()
    monkeypatch.delenv("DUALVP_JAX_CPU_KERNEL")
    assert cpu_kernel.TARGET in _op_hlo()


def test_disabled_in_a_block(kernel):
    """``cpu_kernel.disabled()``: what is traced inside takes the XLA path, in this thread; after it, the kernel."""
    with cpu_kernel.disabled():
        assert not cpu_kernel.enabled()
        assert cpu_kernel.TARGET not in _op_hlo()
    assert cpu_kernel.enabled()
    assert cpu_kernel.TARGET in _op_hlo()


@pytest.mark.parametrize("platforms", [None, ("cpu", "cuda")])
def test_export_holds_the_xla_path(kernel, platforms):
    """``jax.export`` of a function that this process already ran through the kernel: the exported program
    holds no custom call (export would refuse it) but the sums as an XLA program, and gives the in-process
    op's values and gradients (the latter through the kernel), for one platform or several."""
    from jax import export

    z = jnp.asarray(np.random.default_rng(4).standard_normal((6, 50)).astype(np.float32))
    y = jnp.asarray(np.arange(6) * 7, jnp.int32)
    keep = jnp.asarray(np.random.default_rng(5).random((6, 50)) < 0.5)

    def f(z, y, k):
        return dualvp_jax.logprob_entropy(z, y, keep_mask=k, temperature=0.9)

    def g(z, y, k):
        return jax.grad(lambda z: (f(z, y, k)[0] * jnp.arange(6) + f(z, y, k)[1]).sum())(z)

    for fn in (f, g):
        want = jax.jit(fn)(z, y, keep)  # traced and run in process first: with the kernel
        assert cpu_kernel.TARGET in jax.jit(fn).lower(z, y, keep).as_text()
        exp = export.export(jax.jit(fn), **({} if platforms is None else {"platforms": platforms}))(z, y, keep)
        assert cpu_kernel.TARGET not in exp.mlir_module()
        # (serialize() would need the flatbuffers package, which nothing else uses)
        got = exp.call(z, y, keep)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=2e-6)


def test_build_failure_is_reported(monkeypatch, tmp_path):
    """A compiler that fails: the warning carries its exit status; nothing half-written stays in the cache."""
    fake = tmp_path / "cxx"
    fake.write_text("#!/bin/sh\necho 'fake compiler: no' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setattr(cpu_kernel, "_state", {})
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("DUALVP_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.warns(RuntimeWarning, match="exit 3"):
        assert not cpu_kernel.available()
    assert list((tmp_path / "cache").iterdir()) == []


def test_forced_kernel_refuses_other_dtypes(kernel, monkeypatch):
    jax.clear_caches()
    monkeypatch.setattr(fn_mod, "_FORCE_PATH", "kernel")
    try:
        with pytest.raises(RuntimeError, match="float16"):
            jax.jit(dualvp_jax.logprob_entropy).lower(jax.ShapeDtypeStruct((4, 10), jnp.float16),
                                                       jax.ShapeDtypeStruct((4,), jnp.int32))
    finally:
        jax.clear_caches()
