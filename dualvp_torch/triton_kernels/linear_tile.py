"""The fused LM-head op's tile product, shared by its forward and backward kernels.

:func:`tile_logits` forms the logits tile ``z = h_i W_j^T`` (``[BLOCK_T,
BLOCK_V]``, float32 accumulation) over the hidden size in blocks of
``BLOCK_K``; the backward recomputes exactly the forward's tile this way.
:func:`dot` is ``tl.dot`` at the op's input precision: 16-bit operands on
tensor cores (``"default"``), float32 operands in IEEE float32 or TF32; under
the interpreter (``"ordered"``) a k-ordered sum of products, the same for
every row of the tile wherever it sits (batch invariance).
``UPCAST`` converts loaded operands to float32 (exact): Triton's CPU
interpreter mis-computes ``tl.dot`` on bfloat16 operands.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["dot", "tile_logits"]


@triton.jit
def dot(a, b, acc, PRECISION: tl.constexpr):
    """``acc + a @ b`` with float32 accumulation; ``PRECISION``: "default", "ieee", "tf32" or "ordered"."""
    # One return after an if/else: Triton's code generator also compiles the statements after a
    # `return` inside a constexpr `if` (tl.dot(..., input_precision="default") then fails to compile).
    if PRECISION == "default":
        r = tl.dot(a, b, acc)
    elif PRECISION == "ordered":
        # The interpreter (the host code passes it there only): a sum of broadcast products over k, in k
        # order for every element. The interpreter's tl.dot is NumPy's sgemm, whose value for a row
        # depends on the row's position in the tile (rows 0-5, 6-11, 12-15 of 16 differ in the last
        # bits, measured): the tile would make a row's logits follow its neighbours.
        r = acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    else:
        r = tl.dot(a, b, acc, input_precision=PRECISION)
    return r


@triton.jit
def tile_logits(h_ptr, w_ptr, rows, cols, row_ok, col_ok, H, stride_ht, stride_hk, stride_wv, stride_wk,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """``h[rows] @ w[cols]^T`` as a float32 ``[BLOCK_T, BLOCK_V]`` tile (0 outside ``row_ok``/``col_ok``)."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_T, BLOCK_V), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + ks
        hb = tl.load(h_ptr + rows[:, None] * stride_ht + kk[None, :] * stride_hk,
                     mask=row_ok[:, None] & (kk[None, :] < H), other=0.0)
        wb = tl.load(w_ptr + cols[:, None] * stride_wv + kk[None, :] * stride_wk,
                     mask=col_ok[:, None] & (kk[None, :] < H), other=0.0)
        if UPCAST:
            hb = hb.to(tl.float32)
            wb = wb.to(tl.float32)
        acc = dot(hb, tl.trans(wb), acc, PRECISION)
    return acc
