"""Device helpers shared by the logits op's kernels (stats, merge, grad).

``exp2``: ``2^x``; on the GPU (``FAST``) one ``ex2.approx.ftz.f32`` (``tl.exp``
and ``tl.exp2`` lower to the non-``ftz`` form, which wraps each ``MUFU.EX2``
in a compare and two predicated multiplies for subnormal arguments). The
kernels fold ``log2(e)`` into their per-row scale, so ``e^d`` costs one
instruction: ``d`` is kept in base-2 units ``u = (z - m) log2(e) / tau`` and
converted back (``d = u ln 2``) only in per-row sums. ``ftz`` flushes results
below ``2^-126`` to 0: an absolute error under ``1.2e-38`` per term.

``outputs``: :func:`dualvp.spec.finalize` and :func:`dualvp.spec.outputs` of
one row's merged statistics, in float64, the same code for the merge kernel
and for the statistics kernel when it writes the outputs itself (``W = 1``,
one column split).
"""

import triton
import triton.language as tl

__all__ = ["const", "exp2", "outputs", "store_outputs"]

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# Triton materialises a Python float constant as float32: float64 code takes these as float32 pairs hi + lo
LOG2E_HI = tl.constexpr(1.4426950216293335)
LOG2E_LO = tl.constexpr(1.925963033500011e-08)
LN2_HI = tl.constexpr(0.6931471824645996)
LN2_LO = tl.constexpr(-1.9046542121259336e-09)


@triton.jit
def const(hi, lo, DT: tl.constexpr):
    """The constant ``hi + lo`` in ``DT``: float64 from its float32 pair, else ``hi``."""
    if DT == tl.float64:
        c = tl.cast(hi, tl.float64) + tl.cast(lo, tl.float64)
    else:
        c = tl.cast(hi, DT)
    return c


@triton.jit
def exp2(x, FAST: tl.constexpr):
    if FAST:
        y = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        y = tl.exp2(x)
    return y


@triton.jit
def outputs(M, S, Tm, Mk, Sk, zy, valid, inv_tau):
    """``(logprob, entropy, log S, c = Tm / S, log Sk)`` of merged float64 statistics (``spec.finalize``)."""
    log_s = tl.log(S)
    c = Tm / S
    log_sk = tl.log(Sk)
    logprob = tl.where(valid, (zy - Mk) * inv_tau - log_sk, 0.0)
    return logprob, log_s - c, log_s, c, log_sk


@triton.jit
def store_outputs(logprob_ptr, entropy_ptr, res_ptr, rows, T, rmask, M, S, Tm, Mk, Sk, zy, valid, inv_tau):
    """``logprob [T]``, ``entropy [T]`` and ``res [5, T] = (M, log S, c, Mk, log Sk)`` in the outputs' dtype."""
    logprob, entropy, log_s, c, log_sk = outputs(M, S, Tm, Mk, Sk, zy, valid, inv_tau)
    dt = res_ptr.dtype.element_ty
    tl.store(logprob_ptr + rows, logprob.to(dt), mask=rmask)
    tl.store(entropy_ptr + rows, entropy.to(dt), mask=rmask)
    tl.store(res_ptr + rows, M.to(dt), mask=rmask)
    tl.store(res_ptr + T + rows, log_s.to(dt), mask=rmask)
    tl.store(res_ptr + 2 * T + rows, c.to(dt), mask=rmask)
    tl.store(res_ptr + 3 * T + rows, Mk.to(dt), mask=rmask)
    tl.store(res_ptr + 4 * T + rows, log_sk.to(dt), mask=rmask)
