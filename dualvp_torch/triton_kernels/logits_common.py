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

from . import interpreting


def device_fn(fn):
    """``@triton.jit`` for a helper of the compiled kernels; a plain function under the interpreter.

    The interpreter re-patches ``triton.language`` on every call of a jitted function (about 5 ms
    each): a helper called per column block made the CPU tests minutes long. Run as Python, the
    helper computes the same (its ``tl`` calls are the interpreter's).
    """
    return fn if interpreting() else triton.jit(fn)

__all__ = ["const", "exp2", "ln2", "log2e", "keep_bits", "outputs", "select", "store_outputs"]

# Triton materialises a Python float constant as float32: float64 code takes log2(e) and ln(2) as float32
# pairs hi + lo. Literals inside the helpers, not module constants: Triton re-checks every global constant
# that a kernel reads at each launch (host time).


@device_fn
def const(hi, lo, DT: tl.constexpr):
    """The constant ``hi + lo`` in ``DT``: float64 from its float32 pair, else ``hi``."""
    if DT == tl.float64:
        c = tl.cast(hi, tl.float64) + tl.cast(lo, tl.float64)
    else:
        c = tl.cast(hi, DT)
    return c


@device_fn
def log2e(DT: tl.constexpr):
    """``log2(e)`` in ``DT`` (float32: rounded once)."""
    return const(1.4426950216293335, 1.925963033500011e-08, DT)


@device_fn
def ln2(DT: tl.constexpr):
    """``ln(2)`` in ``DT`` (float32: rounded once)."""
    return const(0.6931471824645996, -1.9046542121259336e-09, DT)


@device_fn
def exp2(x, FAST: tl.constexpr):
    if FAST:
        y = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
    else:
        y = tl.exp2(x)
    return y


@device_fn
def outputs(M, S, Tm, Mk, Sk, zy, valid, inv_tau):
    """``(logprob, entropy, log S, c = Tm / S, log Sk)`` of merged float64 statistics (``spec.finalize``)."""
    log_s = tl.log(S)
    c = Tm / S
    log_sk = tl.log(Sk)
    logprob = tl.where(valid, (zy - Mk) * inv_tau - log_sk, 0.0)
    return logprob, log_s - c, log_s, c, log_sk


@device_fn
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


@device_fn
def keep_bits(kb, ASM: tl.constexpr):
    """An int32 select mask from keep-mask bytes: -1 (all bits) where the byte is nonzero, 0 elsewhere.

    ``ASM``: four bytes per 32-bit register at once, no predicate: ``t = ((w & 0x7f..) + 0x7f..) | w`` sets
    each byte's top bit iff the byte is nonzero (no carry between bytes), then one ``prmt`` per element
    replicates that bit (1.75 instructions per element). A per-element compare instead keeps 8-16
    predicates live per thread, more than the 7 predicate registers: they are spilled (``P2R``) around
    every use. The bytes must be 4 or more per thread in a row (the logits' vector layout).
    """
    if ASM:
        r = tl.inline_asm_elementwise(
            "{ .reg .b32 t; and.b32 t, $4, 0x7f7f7f7f; add.u32 t, t, 0x7f7f7f7f; or.b32 t, t, $4; "
            "prmt.b32 $0, t, 0, 0x8888; prmt.b32 $1, t, 0, 0x9999; prmt.b32 $2, t, 0, 0xaaaa; "
            "prmt.b32 $3, t, 0, 0xbbbb; }",
            "=r,=r,=r,=r,r", [kb], dtype=tl.int32, is_pure=True, pack=4)
    else:
        r = tl.where(kb != 0, -1, 0)
    return r


@device_fn
def select(km, a, b, DT: tl.constexpr, ASM: tl.constexpr):
    """``where(km != 0, a, b)`` for an int32 mask of 0 / -1 (:func:`keep_bits`): one ``lop3`` in float32.

    In PTX (``ASM``): written as bitwise operations in Triton, LLVM recognises the select and emits a
    predicate again.
    """
    if ASM and DT == tl.float32:
        r = tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xE4;", "=r,r,r,r", [a, b, km], dtype=tl.float32,
                                      is_pure=True, pack=1)
    else:
        r = tl.where(km != 0, a, b)
    return r

