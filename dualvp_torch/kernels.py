"""Shard-local stages of the op: statistics (forward) and the gradient (backward).

The math is :mod:`dualvp.spec` (``shard_stats`` and ``grad_logits``), rewritten
here in plain torch so that ``torch.compile`` turns each stage into fused
single-pass kernels (C++/OpenMP on CPU, Triton on GPU) with no ``[T, V_local]``
intermediate:

* :func:`stats_impl` reads the shard once per reduction and returns the
  ``[T, 6]`` statistics (``m, s, t, mk, sk, zy``);
* :func:`grad_impl` reads the shard and writes the gradient, in the input
  dtype, computed in float32 (float64 for float64 input).

The tests hold both against the spec functions (``tests/torch/test_kernels.py``).

Compilation
-----------
Both stages are compiled lazily, on first use, once per process, with
``torch.compile(dynamic=True)``: one graph per (input dtype, mask present)
pair, reused for every ``T`` and ``V_local`` (``T == 1`` is a separate
specialisation). The temperature is passed as a 0-d tensor so that changing it
never recompiles. If compilation fails, a warning is issued once and the eager
path is used from then on.

The environment variable ``DUALVP_COMPILE`` is read **at each call**:
``DUALVP_COMPILE=0`` forces the eager path (useful without a C++ compiler, for
debugging, or to compare paths); anything else (or unset) compiles.

Eager path and its chunk bound
------------------------------
The eager path processes rows in chunks of
``max(1, min(CHUNK_ELEMENTS // V_local, T // CHUNK_FRACTION))`` rows
(``CHUNK_ELEMENTS = 2**18``, ``CHUNK_FRACTION = 256``), so its scratch memory
is at most about 10 temporaries of one chunk in the compute dtype: at most
about 10 MiB in float32 whatever ``T``, and, for ``T >= 256``, at most about
``10 * 4 / 256 < 0.16`` of the shard's float32 elements (measured at
T = 1024, V_local = 4096: 0.03-0.04 B for float32, 0.07-0.09 B for bfloat16).
The in-place gradient mode uses the same chunking with either path (the
compiled kernel on each chunk).
"""

from __future__ import annotations

import os
import threading
import types
import warnings
from typing import Callable, Optional

import torch

__all__ = [
    "CHUNK_ELEMENTS",
    "compute_dtype",
    "compile_enabled",
    "stats_impl",
    "grad_impl",
    "shard_stats",
    "shard_grad",
    "chunk_rows",
]

#: Elements per row chunk of the eager path (and of the in-place gradient).
CHUNK_ELEMENTS = 1 << 18
#: The eager chunk holds at most ``T // CHUNK_FRACTION`` rows.
CHUNK_FRACTION = 256


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 input, float32 for every 16/32-bit float."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def compile_enabled() -> bool:
    """``False`` when ``DUALVP_COMPILE=0`` (read at call time) or compile failed before."""
    if os.environ.get("DUALVP_COMPILE", "1").strip() in ("0", "false", "False", "no"):
        return False
    return not _state["failed"]


def chunk_rows(n_rows: int, v_local: int) -> int:
    """Rows per chunk of the eager path: at most ``CHUNK_ELEMENTS`` elements and
    at most ``n_rows // CHUNK_FRACTION`` rows (so the scratch stays a small
    fraction of the shard), at least one row."""
    return max(1, min(CHUNK_ELEMENTS // max(1, v_local), n_rows // CHUNK_FRACTION))


# --- the local math (plain torch; compiled or run eagerly on row chunks) -------


def _finite_or_zero(m):
    return torch.where(m == float("-inf"), torch.zeros_like(m), m)


def _accumulator(z: torch.Tensor) -> torch.dtype:
    # The CPU code that inductor generates sums a row sequentially in a few
    # vector lanes, so a float32 sum over ~1e5 columns drifts by ~sqrt(V) eps
    # (measured: entropy error 7e-6 at V = 32000, against 3e-7 for eager
    # torch's cascade summation). Accumulating in float64 costs one
    # conversion per element and keeps the sums exact to float32 output
    # precision. GPU reductions are tree-shaped and stay in float32.
    return torch.float64 if z.device.type == "cpu" else z.dtype


def stats_impl(z, local, owns, keep: Optional[torch.Tensor], tau):
    """``spec.shard_stats`` for ``z [T, V]`` (any float dtype), ``tau`` a 0-d tensor.

    Returns ``[T, 6]`` in the compute dtype (``tau.dtype``).
    """
    z = z.to(tau.dtype)
    acc = _accumulator(z)
    m = torch.amax(z, dim=-1)
    d = (z - _finite_or_zero(m)[:, None]) / tau
    e = torch.exp(d)
    s = e.sum(-1, dtype=acc).to(tau.dtype)
    t = torch.where(e > 0, e * d, torch.zeros_like(d)).sum(-1, dtype=acc).to(tau.dtype)
    cols = torch.arange(z.shape[-1], device=z.device, dtype=local.dtype)
    is_y = (cols[None, :] == local[:, None]) & owns[:, None]
    zy = torch.where(is_y, z, torch.zeros_like(z)).sum(-1)
    if keep is None:
        mk, sk = m, s
    else:
        zk = torch.where(keep | is_y, z, torch.full_like(z, float("-inf")))
        mk = torch.amax(zk, dim=-1)
        sk = torch.exp((zk - _finite_or_zero(mk)[:, None]) / tau).sum(-1, dtype=acc).to(tau.dtype)
    return torch.stack([m, s, t, mk, sk, zy], dim=-1)


def grad_impl(z, local, owns, keep: Optional[torch.Tensor], M, log_s, c, mk, log_sk, gl, ge, tau):
    """``spec.grad_logits`` for ``z [T, V]``; returns the gradient in ``z.dtype``.

    ``gl`` must already be zero on rows that are not valid; ``ge`` (and ``c``)
    are ``None`` when there is no entropy gradient, which compiles a kernel
    without the entropy term.
    """
    out_dtype = z.dtype
    z = z.to(tau.dtype)
    zero = torch.zeros_like(z)
    d = (z - _finite_or_zero(M)[:, None]) / tau
    p = torch.exp(d - log_s[:, None])
    cols = torch.arange(z.shape[-1], device=z.device, dtype=local.dtype)
    is_y = (cols[None, :] == local[:, None]) & owns[:, None]
    if keep is None:
        q = p
    else:
        zk = torch.where(keep | is_y, z, torch.full_like(z, float("-inf")))
        q = torch.exp((zk - _finite_or_zero(mk)[:, None]) / tau - log_sk[:, None])
    g = gl[:, None] * (torch.where(is_y, torch.ones_like(z), zero) - q)
    if ge is not None:
        g = g + ge[:, None] * torch.where(p > 0, p * (c[:, None] - d), zero)
    return (g / tau).to(out_dtype)


# --- lazy compilation ------------------------------------------------------------

_state: dict = {"failed": False}
_lock = threading.Lock()


def _compiled(fn: Callable, z: torch.Tensor, has_keep: bool, has_entropy: bool) -> Callable:
    # One compiled function per (stage, input dtype, mask present, entropy
    # gradient present), each over its own copy of the code object: dynamo's
    # recompile limit counts per code object, and these variants are expected,
    # not recompiles to be limited.
    key = (fn.__name__, z.dtype, has_keep, has_entropy)
    with _lock:
        compiled = _state.get(key)
        if compiled is None:
            name = (f"{fn.__name__}_{str(z.dtype).replace('torch.', '')}_{'mask' if has_keep else 'nomask'}"
                    f"{'_ent' if has_entropy else ''}")
            code = fn.__code__.replace(co_name=name)
            variant = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
            compiled = _state[key] = torch.compile(variant, dynamic=True, fullgraph=True)
        return compiled


def _run_compiled(fn: Callable, *args):
    """Run the compiled ``fn``; on failure warn once and return ``None``."""
    try:
        has_entropy = fn is grad_impl and args[10] is not None
        return _compiled(fn, args[0], args[3] is not None, has_entropy)(*args)
    except Exception as exc:  # compiler missing, inductor bug, ...
        if not _state["failed"]:
            _state["failed"] = True
            warnings.warn(
                f"dualvp_torch: torch.compile of the local kernels failed ({type(exc).__name__}: {exc}); "
                "falling back to the eager row-chunked path for the rest of the process",
                RuntimeWarning,
                stacklevel=3,
            )
        return None


def shard_stats(z, local, owns, keep, tau) -> torch.Tensor:
    """``[T, 6]`` statistics of ``z [T, V]`` (compiled, or eager in row chunks)."""
    n, v = z.shape
    if n == 0:
        return torch.zeros((0, 6), dtype=tau.dtype, device=z.device)
    if compile_enabled():
        out = _run_compiled(stats_impl, z, local, owns, keep, tau)
        if out is not None:
            return out
    out = torch.empty((n, 6), dtype=tau.dtype, device=z.device)
    step = chunk_rows(n, v)
    for i in range(0, n, step):
        sl = slice(i, min(n, i + step))
        out[sl] = stats_impl(z[sl], local[sl], owns[sl], None if keep is None else keep[sl], tau)
    return out


def shard_grad(z, local, owns, keep, M, log_s, c, mk, log_sk, gl, ge, tau, *, inplace: bool = False):
    """Gradient of the shard ``z [T, V]`` in ``z.dtype``.

    ``inplace=True`` writes it into ``z`` itself, chunk by chunk (each chunk is
    read completely before it is overwritten), and returns ``z``.
    """
    n, v = z.shape
    use_compile = compile_enabled()
    if n == 0:
        return z if inplace else torch.empty_like(z, memory_format=torch.contiguous_format)
    args_rows = (local, owns, keep, M, log_s, c, mk, log_sk, gl, ge)
    if use_compile and not inplace:
        out = _run_compiled(grad_impl, z, *args_rows, tau)
        if out is not None:
            return out
        use_compile = False
    out = z if inplace else torch.empty((n, v), dtype=z.dtype, device=z.device)
    step = chunk_rows(n, v)
    for i in range(0, n, step):
        sl = slice(i, min(n, i + step))
        rows = tuple(None if a is None else a[sl] for a in args_rows)
        g = None
        if use_compile:
            g = _run_compiled(grad_impl, z[sl], *rows, tau)
            use_compile = g is not None
        if g is None:
            g = grad_impl(z[sl], *rows, tau)
        out[sl].copy_(g)
    return out
