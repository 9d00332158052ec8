"""Helpers shared by the JAX tests: meshes, input conversion, a jitted value+gradient runner."""

from __future__ import annotations

import collections
import contextlib
import functools

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import dualvp_jax
from dualvp_jax import sharded
from dualvp import testing
from dualvp.testing import cases

JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16, "float64": jnp.float64}


def row_stats(z, keep):
    """A stand-in for the op's statistics (chunk-map tests): float32 work on every element, row reductions."""
    zf = z.astype(jnp.float32)
    m = jnp.max(zf, axis=-1)
    s = jnp.sum(jnp.exp(zf - m[:, None]), axis=-1)
    mk = jnp.max(jnp.where(keep, zf, -jnp.inf), axis=-1)
    return jnp.stack([m, s, mk], axis=-1)


@functools.lru_cache(maxsize=None)
def mesh_1d(world: int, kind: str = "explicit"):
    """A 1-D ("tp",) mesh: from ``jax.make_mesh`` (explicit axes) or ``Mesh`` (auto axes)."""
    if kind == "explicit":
        return jax.make_mesh((world,), ("tp",))
    return Mesh(np.array(jax.devices()[:world]), ("tp",))


@functools.lru_cache(maxsize=None)
def mesh_2d(dp: int, tp: int, kind: str = "explicit"):
    if kind == "explicit":
        return jax.make_mesh((dp, tp), ("dp", "tp"))
    return Mesh(np.array(jax.devices()[: dp * tp]).reshape(dp, tp), ("dp", "tp"))


def x64_for(dtype: str):
    """Float64 inputs need jax_enable_x64; scope it to the test (no leak)."""
    return jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext()


def put(x, dtype=None):
    """``x`` (NumPy, any dtype) on the device, converted on the host to ``dtype``.

    ``jnp.asarray`` and ``.astype`` compile a small XLA program for every new shape and dtype (a trace, a
    lowering and a compile each); ``jax.device_put`` of a NumPy array of the final dtype compiles nothing.
    The 16-bit floats convert through ml_dtypes (round to nearest even, as XLA's convert). Integers
    follow JAX's default (int32 without jax_enable_x64).
    """
    x = np.asarray(x)
    if dtype is not None:
        x = x.astype(jnp.dtype(dtype))
    return jax.device_put(x)


def inputs(prob: cases.Problem, dtype: str | None = None):
    """JAX arrays of a problem: logits in the case dtype (exact: already rounded), target, mask, cotangents."""
    dtype = dtype or prob.case.dtype
    z = put(prob.logits.astype(np.float32) if dtype != "float64" else prob.logits, JNP_DTYPES[dtype])
    y = put(prob.target)
    k = None if prob.keep_mask is None else put(prob.keep_mask)
    cdt = jnp.float64 if dtype == "float64" else jnp.float32
    gl = put(prob.grad_logprob, cdt)
    ge = put(prob.grad_entropy, cdt)
    return z, y, k, gl, ge


def reference_of(prob: cases.Problem, *, entropy_grad: bool = True):
    """``(logprob, entropy, grad)`` of :func:`dualvp.testing.oracle`."""
    return tuple(testing.oracle(prob, entropy_grad=entropy_grad))


_RUNNERS: dict = {}

#: Traces of the runners below, by kind ("sharded", "shard_map"): a jitted
#: runner's Python body runs once per trace, so a test can tell whether its
#: call traced anew or reused a program compiled before.
TRACES: collections.Counter = collections.Counter()


def sharded_runner(world: int, kind: str, tau: float, ignore_index: int, has_mask: bool,
                   with_entropy: bool = True, entropy_grad: bool = True, jit: bool = True, tuning=None):
    """``f(z, y, k, gl, ge) -> (logprob, entropy, grad)`` through the global-array API.

    ``tuning``: a :class:`dualvp_jax._tuning.Tuning` for the private entry point, or ``None`` (the public
    function, its default tuning).
    """
    key = (world, kind, tau, ignore_index, has_mask, with_entropy, entropy_grad, jit, tuning)
    if key in _RUNNERS:
        return _RUNNERS[key]
    mesh = mesh_1d(world, kind)

    def run(z, y, k, gl, ge):
        TRACES["sharded"] += 1

        def f(z):
            keep = k if has_mask else None
            if tuning is not None:
                return sharded._sharded_logprob_entropy(z, y, mesh, "tp", keep, tau, with_entropy, entropy_grad,
                                                        ignore_index, tuning)
            return dualvp_jax.sharded_logprob_entropy(
                z, y, mesh, "tp", keep_mask=keep, temperature=tau,
                with_entropy=with_entropy, entropy_grad=entropy_grad, ignore_index=ignore_index)

        (lp, h), vjp = jax.vjp(f, z)
        (g,) = vjp((gl, ge if with_entropy else None))
        return lp, h, g

    fn = jax.jit(run) if jit else run
    _RUNNERS[key] = fn
    return fn


def shard_map_runner(world: int, kind: str, tau: float, ignore_index: int, has_mask: bool):
    """Same through a user-written ``jax.shard_map`` around :func:`dualvp_jax.logprob_entropy`."""
    key = ("shard_map", world, kind, tau, ignore_index, has_mask)
    if key in _RUNNERS:
        return _RUNNERS[key]
    mesh = mesh_1d(world, kind)
    zs = P(None, "tp")

    def body(z, y, *k):
        return dualvp_jax.logprob_entropy(z, y, axis_name="tp", keep_mask=k[0] if has_mask else None,
                                          temperature=tau, ignore_index=ignore_index)

    def run(z, y, k, gl, ge):
        TRACES["shard_map"] += 1
        lead = z.ndim - 1
        zspec = P(*([None] * lead), "tp")
        tspec = P(*([None] * lead))
        in_specs = (zspec, tspec) + ((zspec,) if has_mask else ())
        sm = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(tspec, tspec))
        args = (y,) + ((k,) if has_mask else ())
        if kind == "explicit":
            z = jax.reshard(z, NamedSharding(mesh, zspec))
            args = tuple(jax.reshard(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs[1:]))
        (lp, h), vjp = jax.vjp(lambda z: sm(z, *args), z)
        (g,) = vjp((gl, ge))
        return lp, h, g

    del zs
    fn = jax.jit(run)
    _RUNNERS[key] = fn
    return fn


def check_close(name, x, ref, dtype, quantity):
    """``x`` (a JAX array) within the shared tolerance of ``ref`` for ``dtype`` / ``quantity``."""
    x = np.asarray(x).astype(np.float64)  # on the host: exact from any float dtype, no XLA program
    tol = testing.tolerance(dtype, quantity)
    ok = testing.within_tolerance(x, ref, tol)
    assert ok, f"{name} {quantity}: max errors (abs, rel) {testing.max_errors(x, ref)} > {tol}"
