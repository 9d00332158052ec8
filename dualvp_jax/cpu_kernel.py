"""The forward's row sums on the CPU as a compiled XLA FFI custom call, built at first use.

XLA:CPU runs each row reduction as a library call over a materialised input,
so :func:`dualvp.spec.block_sums` over a chunk of rows makes up to four passes
over the logits and writes up to three float32 buffers of the chunk's size
(``dualvp_jax.chunks``; docs/measurements.md). ``cpu_stats.cc`` computes the
same sums in two passes per row that write nothing of the logits' size (a
max, then one exponential per element feeding every sum), on XLA's own
intra-op thread pool. :func:`block_sums` calls it; the op's CPU forward takes
it where :func:`eligible` says so and falls back to the chunked XLA program
otherwise (``dualvp_jax.function._shard_stats``).

Building: like torch's inductor on the CPU, this needs a C++17 compiler at
run time (``$CXX``, else ``g++`` or ``c++`` on ``PATH``) and compiles with
jaxlib's FFI headers (``jax.ffi.include_dir()``), ``-O3 -march=native``, once
per source / jaxlib / compiler / CPU, into a cache directory
(``$DUALVP_CACHE_DIR``, else ``$XDG_CACHE_HOME/dualvp``, else
``~/.cache/dualvp``; about 2 s). Without a compiler, or if the build or the
load fails, a warning says why (once) and the op uses the XLA path: the same
results up to float32 rounding, slower. ``DUALVP_JAX_CPU_KERNEL=0`` in the
environment turns the kernel off (nothing is built), and so does
:func:`disabled` for the calls traced inside it.

``jax.export`` refuses custom calls without a compatibility guarantee, so the
sums are a primitive of their own whose CPU lowering is the custom call in a
program compiled in this process and an XLA program over row chunks
(:func:`_xla_sums`, the spec's ``block_sums``) in a program lowered for
export, or for another platform: an exported op needs nothing of this
module where it runs. Both switches are read when the op is called (traced),
not when a program runs: the op's jit caches key on them.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from functools import partial
from typing import Optional

import numpy as np

import jax
import jax.extend
import jax.numpy as jnp
from jax.interpreters import batching, mlir

__all__ = ["TARGET", "available", "block_sums", "disabled", "eligible", "enabled", "unavailable_reason"]

#: Name of the FFI target (platform ``cpu``).
TARGET = "dualvp_cpu_stats"

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_stats.cc")
_FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC", "-std=c++17")
# Input dtypes the kernel reads (16-bit float16 and float64 take the XLA path).
_DTYPES = ("float32", "bfloat16")

_lock = threading.Lock()
_state: dict = {}  # "ok": bool, "why": str, "lib": the loaded library (kept alive)
_local = threading.local()  # .off: depth of disabled() in this thread


def _cache_dir() -> str:
    d = os.environ.get("DUALVP_CACHE_DIR")
    if not d:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "dualvp")
    return d


def _cpu_signature() -> str:
    # -march=native: a library built on one CPU may not run on another that
    # shares the cache directory (a home on NFS), so the CPU is in the key.
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor() or platform.machine()


def _compiler() -> Optional[str]:
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx) or (cxx if os.path.isfile(cxx) else None)
    return shutil.which("g++") or shutil.which("c++")


def _build() -> str:
    """The path of the compiled library (built into the cache if missing); raises with the reason."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler ($CXX, g++ or c++ on PATH)")
    with open(_SOURCE, "rb") as f:
        source = f.read()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(b"\0".join([source, jax.__version__.encode(), version.encode(), cxx.encode(),
                                     " ".join(_FLAGS).encode(), _cpu_signature().encode()])).hexdigest()[:20]
    cache = _cache_dir()
    path = os.path.join(cache, f"cpu_stats_{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(cache, exist_ok=True)
    # Built under a temporary name and renamed: concurrent processes (pytest
    # workers, ranks) never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        r = subprocess.run([cxx, *_FLAGS, "-I", jax.ffi.include_dir(), _SOURCE, "-o", tmp],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"{cxx} failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def enabled() -> bool:
    """Whether the op may take the kernel now: not turned off by ``DUALVP_JAX_CPU_KERNEL=0`` or :func:`disabled`."""
    if getattr(_local, "off", 0):
        return False
    return os.environ.get("DUALVP_JAX_CPU_KERNEL", "1").strip().lower() not in ("0", "false", "no", "off")


@contextlib.contextmanager
def disabled():
    """Calls of the op traced in this block (this thread) take the XLA path (``jax.export`` needs no such block).

    Only what is *traced* inside the block: a function that ``jax.jit`` traced
    before keeps its cached trace (with the kernel), so export a function not
    traced yet, or call ``jax.clear_caches()`` first.
    """
    _local.off = getattr(_local, "off", 0) + 1
    try:
        yield
    finally:
        _local.off -= 1


def available() -> bool:
    """Whether the kernel is built, loaded and registered (builds it on the first call; thread-safe)."""
    if "ok" in _state:
        return _state["ok"]
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        try:
            lib = ctypes.cdll.LoadLibrary(_build())
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.DualvpCpuStats), platform="cpu")
        except Exception as exc:  # noqa: BLE001 - any failure means: use the XLA path
            _state.update(ok=False, why=f"{type(exc).__name__}: {exc}")
            warnings.warn(f"dualvp_jax: the CPU statistics kernel is unavailable ({_state['why']}); "
                          "using the XLA path (same results, slower on the CPU)", RuntimeWarning, stacklevel=2)
            return False
        _state.update(ok=True, why="", lib=lib)
        return True


def unavailable_reason() -> str:
    """Why :func:`available` is false ("" when it is true or was not asked yet)."""
    return _state.get("why", "")


def eligible(dtype, temperature) -> bool:
    """Whether :func:`block_sums` takes logits of ``dtype`` at this temperature, and the kernel is available.

    The temperature must be a static Python number (an attribute of the call).
    Does not read :func:`enabled` (the op reads that when called).
    """
    return (jnp.dtype(dtype).name in _DTYPES and isinstance(temperature, (int, float, np.floating))
            and not isinstance(temperature, bool) and available())


def block_sums(z: jax.Array, keep: Optional[jax.Array], temperature: float, with_entropy: bool):
    """``spec.block_sums(jnp, z, keep, temperature, dtype=float32, with_entropy=...)`` on the CPU kernel.

    Args:
      z: ``[..., n]`` float32 or bfloat16 logits.
      keep: ``[..., n]`` bool or ``None``.
      temperature: a Python number > 0.
      with_entropy: as in the spec (``t``, and under a mask ``s``, are 0 without it).

    Returns:
      ``(m, s, t, sk)``, each ``[...]`` float32; rows holding NaN or ``+inf``
      get NaN in all four (the spec's own sums are NaN in ``s`` and, with a
      mask, ``sk`` for them; :func:`dualvp.spec.stats_from_sums` marks such
      masked rows for the ``kept_shift="kept"`` pass). Call it where the
      platform is known to be the CPU: a program lowered for export
      (``jax.export``) or for another platform holds the same sums as an XLA
      program over row chunks instead of the custom call (:func:`_xla_sums`).
    """
    k = jnp.zeros((0,), jnp.bool_) if keep is None else keep
    out = _sums_p.bind(z, k, has_keep=keep is not None, with_entropy=bool(with_entropy), tau=float(temperature))
    return tuple(out[..., i] for i in range(4))


def _ffi_sums(z, k, *, has_keep: bool, with_entropy: bool, tau: float):
    if not available():  # builds and registers it on first use
        raise RuntimeError(f"dualvp_jax: the CPU statistics kernel is unavailable ({unavailable_reason()})")
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(z.shape[:-1] + (4,), jnp.float32))(
        z, k, has_keep=has_keep, with_entropy=with_entropy, tau=np.float32(tau))


def _xla_sums(z, k, *, has_keep: bool, with_entropy: bool, tau: float):
    """The kernel's sums as an XLA program over bounded row chunks (for export and other platforms)."""
    from dualvp import spec

    from . import chunks

    n = z.shape[-1]
    rows = int(np.prod(z.shape[:-1], dtype=np.int64))
    flat = [z.reshape(rows, n), k.reshape(rows, n) if has_keep else None]

    def sums(z, k):
        return jnp.stack(spec.block_sums(jnp, z, k, np.float32(tau), dtype=jnp.float32, with_entropy=with_entropy),
                         axis=-1)

    out = chunks.map_row_chunks(sums, flat, chunks.chunk_rows(rows, n)) if rows else jnp.zeros((0, 4), jnp.float32)
    return out.reshape(z.shape[:-1] + (4,))


# A primitive of its own rather than a bare ffi_call, so that its lowering can
# tell a program lowered for export (which must not hold a custom call without
# a compatibility guarantee) from one compiled in this process.
_sums_p = jax.extend.core.Primitive("dualvp_cpu_block_sums")


def _abstract(z, k, **params):
    return jax.core.ShapedArray(z.shape[:-1] + (4,), jnp.float32)


def _lower_cpu(ctx, z, k, **params):
    fn = _xla_sums if ctx.module_context.lowering_parameters.for_export else _ffi_sums
    return mlir.lower_fun(partial(fn, **params), multiple_results=False)(ctx, z, k)


def _batch(args, dims, **params):
    # Batch dimensions to the front (broadcast where unbatched): the kernel
    # takes any leading dimensions. The dummy keep (no mask) stays as it is.
    z, k = args
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)

    def front(x, d):
        return jnp.broadcast_to(x, (size,) + x.shape) if d is None else jnp.moveaxis(x, d, 0)

    z = front(z, dims[0])
    k = front(k, dims[1]) if params["has_keep"] else k
    return _sums_p.bind(z, k, **params), 0


# Eager calls: one compiled program per (shapes, params), cached by jit (a
# fresh jit of a fresh partial per call would trace and compile every time).
_ffi_sums_jit = jax.jit(_ffi_sums, static_argnames=("has_keep", "with_entropy", "tau"))
_sums_p.def_impl(lambda z, k, **params: _ffi_sums_jit(z, k, **params))
_sums_p.def_abstract_eval(_abstract)
mlir.register_lowering(_sums_p, mlir.lower_fun(_xla_sums, multiple_results=False))
mlir.register_lowering(_sums_p, _lower_cpu, platform="cpu")
batching.primitive_batchers[_sums_p] = _batch
