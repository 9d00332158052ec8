"""Merge kernel of the logits op: the ranks' statistics to the outputs and the backward's residuals.

Implements :func:`dualvp.spec.reduce_stats` over the ``N`` partial statistics ``[N, T, 6]``
(``N = W x S``: each rank's column splits), :func:`dualvp.spec.finalize` and
:func:`dualvp.spec.outputs`, per row::

    M  = max_r m_r              S  = sum_r s_r e^dm_r,   dm_r = (m_r - M) / tau
    Tm = sum_r e^dm_r (t_r + s_r dm_r)   (0 where e^dm_r = 0)
    Mk = max_r mk_r             Sk = sum_r sk_r e^((mk_r - Mk) / tau)
    L  = (zy - Mk) / tau - log Sk   (0 where target == ignore_index)
    H  = log S - Tm / S

in float64 whatever the statistics' dtype (O(W T) work). Writes ``logprob
[T]``, ``entropy [T]`` and the residuals ``res [5, T]`` = ``(M, log S, c =
Tm / S, Mk, log Sk)`` (``spec.Combined`` without ``zy``) in the output's
dtype. The same program on every rank, on the same all-gathered input: every
rank holds bit-identical results.
"""

import triton
import triton.language as tl

from .logits_common import store_outputs

__all__ = ["logits_merge_kernel"]


@triton.jit
def logits_merge_kernel(
    stats_ptr, y_ptr, logprob_ptr, entropy_ptr, res_ptr,
    T, W, ignore_index, inv_tau_hi: tl.float32, inv_tau_lo: tl.float32,
    BLOCK_T: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    ninf = float("-inf")
    # 1/tau as a float32 pair (see logits_stats)
    inv_tau = tl.cast(inv_tau_hi, tl.float64) + tl.cast(inv_tau_lo, tl.float64)
    M = tl.full([BLOCK_T], ninf, tl.float64)
    Mk = tl.full([BLOCK_T], ninf, tl.float64)
    for r in range(W):
        base = stats_ptr + (r * T + rows64) * 6
        M = tl.maximum(M, tl.load(base + 0, mask=rmask, other=ninf).to(tl.float64))
        Mk = tl.maximum(Mk, tl.load(base + 3, mask=rmask, other=ninf).to(tl.float64))
    M_sh = tl.where(M == ninf, 0.0, M)  # spec._finite_or_zero
    Mk_sh = tl.where(Mk == ninf, 0.0, Mk)
    S = tl.zeros([BLOCK_T], tl.float64)
    Tm = tl.zeros([BLOCK_T], tl.float64)
    Sk = tl.zeros([BLOCK_T], tl.float64)
    zy = tl.zeros([BLOCK_T], tl.float64)
    for r in range(W):
        base = stats_ptr + (r * T + rows64) * 6
        m = tl.load(base + 0, mask=rmask, other=0.0).to(tl.float64)
        s = tl.load(base + 1, mask=rmask, other=0.0).to(tl.float64)
        t = tl.load(base + 2, mask=rmask, other=0.0).to(tl.float64)
        mk = tl.load(base + 3, mask=rmask, other=0.0).to(tl.float64)
        sk = tl.load(base + 4, mask=rmask, other=0.0).to(tl.float64)
        dm = (m - M_sh) * inv_tau
        w = tl.exp(dm)
        S += w * s
        # w == 0 exactly when the shard is all -inf; then s == 0 and dm = -inf
        Tm += w * (t + tl.where(w > 0, s * dm, 0.0))
        Sk += tl.exp((mk - Mk_sh) * inv_tau) * sk
        zy += tl.load(base + 5, mask=rmask, other=0.0).to(tl.float64)
    y = tl.load(y_ptr + rows64, mask=rmask, other=ignore_index).to(tl.int64)
    store_outputs(logprob_ptr, entropy_ptr, res_ptr, rows64, T, rmask, M, S, Tm, Mk, Sk, zy, y != ignore_index,
                  inv_tau)
