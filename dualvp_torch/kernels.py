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
The eager path (``_stats_eager``, ``_grad_eager``; same math as the compiled
functions, held against the spec by the same tests) processes rows in chunks
of ``max(1, min(CHUNK_ELEMENTS // V_local, T * itemsize // CHUNK_DIVISOR))``
rows (``CHUNK_ELEMENTS = 2**20``, ``CHUNK_DIVISOR = 512``, ``itemsize`` of the
logits' dtype). Each chunk runs in-place passes over at most two compute-dtype
scratch buffers allocated once per call and reused for every chunk (the
backward writes into the output chunk directly when the dtypes allow); the
target logit is a ``gather`` on the O(T) index, ``0 * -inf`` is avoided by
clamping ``-inf`` shifted logits to ``-sqrt(finfo.max)`` after the
exponential, and the row sums accumulate in float64 on CPU like the compiled
path (``sum(dtype=float64)`` makes one transient float64 copy of a chunk).
Peak scratch is at most ``SCRATCH_BYTES = 16`` bytes per chunk element, i.e.
at most 16 MiB whatever ``T`` and at most ``16 / 512 = 1/32`` of the shard's
bytes in every dtype. The in-place gradient mode always uses these eager
chunks, writing each gradient chunk into ``z`` after its last read.
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
CHUNK_ELEMENTS = 1 << 20
#: Peak scratch bytes per chunk element of the eager path: two float32 buffers
#: plus the float64 copy that ``sum(dtype=float64)`` makes on CPU.
SCRATCH_BYTES = 16
#: The eager chunk holds at most ``T * itemsize // CHUNK_DIVISOR`` rows, so its
#: scratch is at most ``SCRATCH_BYTES / CHUNK_DIVISOR`` of the shard's bytes.
CHUNK_DIVISOR = 512


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 input, float32 for every 16/32-bit float."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def compile_enabled() -> bool:
    """``False`` when ``DUALVP_COMPILE=0`` (read at call time) or compile failed before."""
    if os.environ.get("DUALVP_COMPILE", "1").strip() in ("0", "false", "False", "no"):
        return False
    return not _state["failed"]


def chunk_rows(n_rows: int, v_local: int, itemsize: int = 4) -> int:
    """Rows per chunk of the eager path: at most ``CHUNK_ELEMENTS`` elements and
    at most ``n_rows * itemsize // CHUNK_DIVISOR`` rows (so the scratch stays a
    small fraction ``<= SCRATCH_BYTES / CHUNK_DIVISOR`` of the shard's
    ``n_rows * v_local * itemsize`` bytes), at least one row."""
    return max(1, min(CHUNK_ELEMENTS // max(1, v_local), n_rows * itemsize // CHUNK_DIVISOR))


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


# --- the eager path: in-place passes over one or two float32 scratch chunks -------


def _guard(dtype: torch.dtype) -> float:
    # ``-inf`` shifted logits are clamped to ``-sqrt(finfo.max)`` once their
    # exponential is known: the probability there is exactly 0 and any finite
    # value times 0 is 0, so this replaces the spec's ``where`` guards against
    # ``0 * -inf`` without a temporary. sqrt keeps ``gH (c - d)`` finite.
    return -(torch.finfo(dtype).max ** 0.5)


def _scaled(tau: torch.Tensor) -> bool:
    # Skip the division when tau == 1 (read without a device sync on CPU only).
    return not (tau.device.type == "cpu" and float(tau) == 1.0)


def _shift(dst: torch.Tensor, zc: torch.Tensor, shift: torch.Tensor, tau: torch.Tensor, scaled: bool) -> None:
    """``dst = (zc - shift[:, None]) / tau`` in the compute dtype, no temporary."""
    if zc.dtype == dst.dtype:
        torch.sub(zc, shift[:, None], out=dst)
    else:  # a mixed-dtype out= would allocate a converted temporary
        dst.copy_(zc)
        dst.sub_(shift[:, None])
    if scaled:
        dst.div_(tau)


def _apply_keep(buf: torch.Tensor, keep: torch.Tensor, loc: torch.Tensor, owns: torch.Tensor, fill: torch.Tensor):
    """``buf[~(keep | is_y)] = fill`` in place (the target column is always kept)."""
    at_y = buf.gather(1, loc)
    torch.where(keep, buf, fill, out=buf)
    buf.scatter_(1, loc, torch.where(owns[:, None], at_y, buf.gather(1, loc)))


def _stats_eager(z, local, owns, keep, tau) -> torch.Tensor:
    n, v = z.shape
    cdt = tau.dtype
    acc = _accumulator(z)
    scaled = _scaled(tau)
    guard = _guard(cdt)
    neg_inf = torch.full((), float("-inf"), dtype=cdt, device=z.device)
    out = torch.empty((n, 6), dtype=cdt, device=z.device)
    loc_all = local[:, None]
    zy = z.gather(1, loc_all)[:, 0].to(cdt)
    out[:, 5] = torch.where(owns, zy, torch.zeros_like(zy))
    step = chunk_rows(n, v, z.element_size())
    buf = torch.empty((min(step, n), v), dtype=cdt, device=z.device)
    buf2 = torch.empty_like(buf)
    for i in range(0, n, step):
        j = min(n, i + step)
        zc, b, e = z[i:j], buf[: j - i], buf2[: j - i]
        m = torch.amax(zc, dim=-1).to(cdt)
        _shift(b, zc, _finite_or_zero(m), tau, scaled)  # d
        torch.exp(b, out=e)
        out[i:j, 0] = m
        out[i:j, 1] = e.sum(-1, dtype=acc)
        b.clamp_(min=guard)
        out[i:j, 2] = e.mul_(b).sum(-1, dtype=acc)
        if keep is None:
            continue
        b.copy_(zc)
        _apply_keep(b, keep[i:j], loc_all[i:j], owns[i:j], neg_inf)  # zk
        mk = torch.amax(b, dim=-1)
        b.sub_(_finite_or_zero(mk)[:, None])
        if scaled:
            b.div_(tau)
        out[i:j, 3] = mk
        out[i:j, 4] = b.exp_().sum(-1, dtype=acc)
    if keep is None:
        out[:, 3] = out[:, 0]
        out[:, 4] = out[:, 1]
    return out


def _grad_eager(z, local, owns, keep, M, log_s, c, mk, log_sk, gl, ge, tau, out) -> None:
    """``grad_impl`` row chunk by row chunk into ``out`` (which may be ``z`` itself)."""
    n, v = z.shape
    cdt = tau.dtype
    scaled = _scaled(tau)
    guard = _guard(cdt)
    zero = torch.zeros((), dtype=cdt, device=z.device)
    loc_all = local[:, None]
    glt = gl / tau  # the 1/tau folded into the O(T) factors
    ngl = (-glt)[:, None]
    gy = torch.where(owns, glt, torch.zeros_like(glt))[:, None]
    get = None if ge is None else (ge / tau)[:, None]
    Mf = _finite_or_zero(M)
    mkf = None if keep is None else _finite_or_zero(mk)
    # The first working buffer can be the output chunk itself when it has the
    # compute dtype, unless it aliases z and z must be read again (mask).
    direct = out.dtype == cdt and (out.data_ptr() != z.data_ptr() or keep is None)
    step = chunk_rows(n, v, z.element_size())
    rows = min(step, n)
    buf = None if direct else torch.empty((rows, v), dtype=cdt, device=z.device)
    buf2 = None if ge is None else torch.empty((rows, v), dtype=cdt, device=z.device)
    for i in range(0, n, step):
        j = min(n, i + step)
        zc = z[i:j]
        loc, own = loc_all[i:j], owns[i:j]
        b = out[i:j] if direct else buf[: j - i]
        if ge is not None:
            p = buf2[: j - i]
            _shift(b, zc, Mf[i:j], tau, scaled)  # d
            torch.sub(b, log_s[i:j, None], out=p).exp_()  # p
            b.clamp_(min=guard)
            torch.sub(c[i:j, None], b, out=b)  # c - d
            if keep is None:
                # (gH (c - d) - gL) p / tau, plus gL / tau at the target
                torch.addcmul(ngl[i:j], b, get[i:j], out=b).mul_(p)
            else:
                b.mul_(get[i:j]).mul_(p)  # gH p (c - d) / tau
                q = p
                _shift(q, zc, mkf[i:j], tau, scaled)
                q.sub_(log_sk[i:j, None]).exp_()
                _apply_keep(q, keep[i:j], loc, own, zero)
                b.addcmul_(q, ngl[i:j])
        else:
            if keep is None:
                _shift(b, zc, Mf[i:j], tau, scaled)
                b.sub_(log_s[i:j, None])
            else:
                _shift(b, zc, mkf[i:j], tau, scaled)
                b.sub_(log_sk[i:j, None])
            b.exp_()
            if keep is not None:
                _apply_keep(b, keep[i:j], loc, own, zero)
            b.mul_(ngl[i:j])
        b.scatter_add_(1, loc, gy[i:j])
        if not direct:
            out[i:j].copy_(b)


def shard_stats(z, local, owns, keep, tau) -> torch.Tensor:
    """``[T, 6]`` statistics of ``z [T, V]`` (compiled, or eager in row chunks)."""
    n, v = z.shape
    if n == 0:
        return torch.zeros((0, 6), dtype=tau.dtype, device=z.device)
    if compile_enabled():
        out = _run_compiled(stats_impl, z, local, owns, keep, tau)
        if out is not None:
            return out
    return _stats_eager(z, local, owns, keep, tau)


def shard_grad(z, local, owns, keep, M, log_s, c, mk, log_sk, gl, ge, tau, *, inplace: bool = False):
    """Gradient of the shard ``z [T, V]`` in ``z.dtype``.

    ``inplace=True`` writes it into ``z`` itself, chunk by chunk (each chunk is
    read completely before it is overwritten), and returns ``z``.
    """
    n, v = z.shape
    if n == 0:
        return z if inplace else torch.empty_like(z, memory_format=torch.contiguous_format)
    args_rows = (local, owns, keep, M, log_s, c, mk, log_sk, gl, ge)
    if compile_enabled() and not inplace:
        out = _run_compiled(grad_impl, z, *args_rows, tau)
        if out is not None:
            return out
    out = z if inplace else torch.empty((n, v), dtype=z.dtype, device=z.device)
    _grad_eager(z, *args_rows, tau, out)
    return out
