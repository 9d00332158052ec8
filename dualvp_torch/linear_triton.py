"""Host side of the fused LM-head op's Triton kernels (``impl="triton"``).

:func:`stats` launches :func:`~dualvp_torch.triton_kernels.linear_fwd.linear_stats_kernel`
(one launch, plus :func:`~dualvp_torch.triton_kernels.linear_fwd.linear_merge_splits_kernel`
over its vocabulary splits) and :func:`grads` launches
:func:`~dualvp_torch.triton_kernels.linear_bwd.linear_grad_kernel` (one
launch; for 16-bit weights one per vocabulary chunk, see below). The cross-rank
merge, the collectives and autograd stay in :mod:`dualvp_torch.linear`.

Memory: the forward holds ``[n_splits, T, 6]`` float32 statistics. The
backward accumulates ``dh`` in a float32 ``[T, H]`` buffer (the buffer of its
all-reduce / reduce-scatter, as on the torch path) and ``dW`` in float32: for
float32 weights the returned gradient itself; for 16-bit weights a ``[chunk,
H]`` float32 buffer per vocabulary chunk of at most ``memory_budget`` bytes,
rounded once into the returned gradient after its chunk.

The kernel modules are imported at the first call: ``triton`` is optional, and
``TRITON_INTERPRET`` (the CPU interpreter) is read when a kernel is defined.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from dualvp import spec

from . import triton_kernels, tuning

__all__ = ["blocks", "grads", "group_rows", "kept_logits", "matmul_precision", "stats", "unavailable",
           "DH_GROUP_BYTES"]



def unavailable(device: torch.device) -> Optional[str]:
    """Why ``impl="triton"`` cannot run on ``device`` (``None`` when it can)."""
    if not triton_kernels.available():
        return "the triton package is not installed"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and triton_kernels.interpreting():
        return None
    return f"needs a CUDA device (or TRITON_INTERPRET=1 for CPU tensors), got device {device}"


def blocks(device: torch.device) -> tuple[int, int, int, Optional[int]]:
    """``(BLOCK_T, BLOCK_V, BLOCK_K, num_warps)``: tensor-core sized on a GPU, small in the interpreter.

    The CUDA tiles are untuned (no GPU measurement yet); ``tuning.Tuning.triton_linear_blocks``
    overrides them.
    """
    if device.type == "cuda":
        return tuning.current().triton_linear_blocks or (64, 128, 64, 8)
    return 16, 32, 16, None


def _upcast(x: torch.Tensor) -> bool:
    # the interpreter's tl.dot mis-computes bfloat16 operands: convert them after loading
    return x.device.type == "cpu" and x.dtype == torch.bfloat16


def _precision(x: torch.Tensor, allow_tf32: bool) -> str:
    # tl.dot's input precision: float32 operands (or upcast ones) IEEE unless TF32 is allowed;
    # the interpreter: "ordered" (linear_tile.dot: NumPy's sgemm gives a row a value that depends on
    # its position in the tile)
    if x.device.type == "cpu":
        return "ordered"
    if x.dtype == torch.float32 or _upcast(x):
        return "tf32" if allow_tf32 and x.dtype == torch.float32 else "ieee"
    return "default"


#: Bytes of float32 ``dh`` rows that the backward's resident tiles share (``GROUP_T`` row blocks,
#: kept in L2 while their column blocks sweep; H100/H200 L2: 50 MB, shared with the dW blocks).
DH_GROUP_BYTES = 16 << 20


def group_rows(n_row_blocks: int, block_t: int, hsz: int, device: torch.device) -> int:
    """``GROUP_T`` of the backward's tile order: row blocks whose ``dh`` fits :data:`DH_GROUP_BYTES`."""
    if device.type != "cuda":
        return 2  # the interpreter: small groups, so that the tests walk the grouped order
    return max(1, min(n_row_blocks, DH_GROUP_BYTES // max(1, block_t * hsz * 4)))


def _launch(warps: Optional[int]) -> dict:
    return {} if warps is None else {"num_warps": warps}


#: Columns of one vocabulary split of the forward on CUDA (a multiple of ``BLOCK_V``): ``V_local = 32000``
#: gives 8 splits, so that even a few row blocks fill the SMs.
SPLIT_COLUMNS = 4096


def _blocks_per_split(n_vblocks: int, block_v: int, device: torch.device) -> int:
    """Vocabulary blocks per split of the forward: from ``V`` (and the tile) alone, never ``T``.

    Batch invariance: a row's statistics are merged split by split, so the
    splits must not follow the row count (they once did: ``4 * SMs / row
    blocks`` splits).
    """
    if device.type == "cuda":
        return max(1, SPLIT_COLUMNS // block_v)
    return max(1, -(-n_vblocks // 3))  # the interpreter: 3 splits, several blocks per split


def stats(h2: torch.Tensor, weight: torch.Tensor, ycol: torch.Tensor, keep: Optional[torch.Tensor],
          tau: torch.Tensor, temperature: float, allow_tf32: bool) -> torch.Tensor:
    """``[T, 6]`` float32 statistics of this rank's logits ``h2 weight^T`` (``spec.block_stats``, merged).

    ``ycol [T]`` int64: the target's column in the shard, negative where the
    shard does not own it; ``keep [T, V]`` bool or ``None``; ``tau`` the 0-d
    float32 temperature (for the host merge), ``temperature`` its value.
    """
    from .triton_kernels.linear_fwd import linear_stats_kernel

    n, hsz = h2.shape
    v = weight.shape[0]
    bt, bv, bk, warps = blocks(h2.device)
    n_rows, nvb = triton.cdiv(n, bt), triton.cdiv(v, bv)
    per_split = _blocks_per_split(nvb, bv, h2.device)
    splits = triton.cdiv(nvb, per_split)
    out = torch.empty((splits, n, spec.N_STATS), dtype=torch.float32, device=h2.device)
    km = keep.view(torch.uint8) if keep is not None else ycol
    linear_stats_kernel[(n_rows, splits)](
        h2, weight, ycol, km, out, n, v, hsz, per_split,
        h2.stride(0), h2.stride(1), weight.stride(0), weight.stride(1),
        km.stride(0) if keep is not None else 0, km.stride(1) if keep is not None else 0,
        1.0 / temperature,
        HAS_KEEP=keep is not None, UPCAST=_upcast(h2), PRECISION=_precision(h2, allow_tf32),
        BLOCK_T=bt, BLOCK_V=bv, BLOCK_K=bk, **_launch(warps),
    )
    if splits == 1:
        return out[0]
    from .triton_kernels.linear_fwd import linear_merge_splits_kernel

    merged = torch.empty((n, spec.N_STATS), dtype=torch.float32, device=h2.device)
    rb = 128 if h2.device.type == "cuda" else 16
    linear_merge_splits_kernel[(triton.cdiv(n, rb),)](out, merged, n, splits, 1.0 / temperature, BLOCK=rb)
    return merged


def _mm_f32_into(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """``acc (+)= a @ b`` with float32 accumulation into the float32 ``acc`` (cuBLAS on CUDA).

    16-bit operands: tensor cores with a float32 output (``out_dtype``);
    float32 operands: IEEE float32 or TF32 as :func:`matmul_precision` sets it.
    """
    if a.device.type == "cuda":
        f32 = a.dtype == torch.float32
        kw = {} if f32 else {"out_dtype": torch.float32}
        if first:
            torch.mm(a, b, out=acc, **kw)
        else:
            torch.addmm(acc, a, b, out=acc, **kw)
        return
    r = a.float() @ b.float()  # the CPU (interpreter tests): exact products of the 16-bit values
    acc.copy_(r) if first else acc.add_(r)


@contextlib.contextmanager
def matmul_precision(x: torch.Tensor, allow_tf32: bool):
    """cuBLAS float32 products on CUDA in IEEE float32 (``allow_tf32=False``) or TF32, whatever torch's global
    flag (the fused op's tile loop and its Triton backward's products alike)."""
    if x.device.type != "cuda" or x.dtype != torch.float32:
        yield
        return
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


#: The ``"gemm"`` backward's vocabulary chunks at the default budget: ``G`` (its parts) for ``T x V / 16``
#: columns, the default fraction of ``B`` (``linear_tiles.BUDGET_FRACTION``), whatever ``T``.
GEMM_CHUNKS = 16


def default_atomic_budget(v: int, hsz: int) -> int:
    """The ``"atomic"`` backward's float32 ``dW`` chunk bytes at the default budget.

    A sixteenth of ``[V, H]``, at least 1 MiB.
    """
    return max(v * hsz * 4 // GEMM_CHUNKS, 1 << 20)


def grads(h2, weight, ycol, keep, comb, gl, ge, temperature: float, need_dh: bool, need_dw: bool,
          allow_tf32: bool, rounding: str, budget: Optional[int], kept=None):
    """``(dh [T, H] float32 or None, dW [V, H] in weight's dtype or None)``: this rank's partial sums.

    ``comb = (M, log_s, c, mk, log_sk)`` ``[T]`` float32 (``c`` may be
    ``None``: no entropy gradient, and then ``ge`` is ``None``); ``gl``,
    ``ge`` ``[T]`` float32 upstream gradients; ``budget``: bytes of one
    vocabulary chunk's buffers for 16-bit weights (``G`` chunks, or the
    float32 ``dW`` chunk on the ``"atomic"`` backward); ``None`` (the
    default): ``G`` chunks of ``ceil(V / GEMM_CHUNKS)`` columns (rounded up
    to ``BLOCK_V``), from ``V`` alone: ``dh``'s row sums its chunks'
    products in chunk order, so a chunk sized from ``T`` would make a row's
    ``dh`` follow the batch (an explicit ``budget`` sizes them from ``T``).

    ``Tuning.triton_linear_backward == "gemm"`` (the default): per
    vocabulary chunk the kernel recomputes the logits and writes ``G``
    (``G_hi``, ``G_lo`` with the 16-bit split) in the weight's dtype, then
    cuBLAS adds ``G W_c`` to the float32 ``dh`` and forms ``dW_c = G^T h``
    (rounded once to the weight's dtype; float32 products in IEEE float32
    unless ``allow_tf32``). ``"atomic"``: the kernel multiplies in-register
    ``G`` and adds with float32 atomics.

    ``rounding`` (``Tuning.gradient_rounding``, 16-bit weights): ``"split"``
    ``G_hi + G_lo``; ``"once"`` ``G`` rounded once; ``"fixed"`` (the default;
    the ``"gemm"`` backward, ``"atomic"`` runs it as ``"split"``) rounded once,
    and the kernel records per row the residual ``d = G - rnd(G)`` at the
    target column and at the (at most two) other columns with ``p_v > 1/3``
    (``FIX_G``: slots 0, 1 and 2, see :func:`_unpack`); the host adds ``d
    W[c]`` to ``dh`` (after the chunks, per row, slot 0, 1, then 2) and
    ``d h_t`` to the chunk's float32 ``dW`` block before its one rounding
    (:func:`~dualvp_torch.triton_kernels.linear_bwd.linear_fix_dw_kernel`,
    entries sorted by column: no atomics). With ``kept`` the residuals are
    those of the written kept values at every kept column instead.

    ``kept``: ``(cols, use, vals)`` ``[T, K+1]`` (``keep_ids``: the kept
    columns and the gradient's values there, ``spec.kept_grad``, float32):
    written over each stored ``G`` chunk before its products (rounded once
    to the weight's dtype, or split), as the tile path writes them over its
    tile. Needs the ``"gemm"`` backward.
    """
    from .triton_kernels.linear_bwd import linear_grad_kernel

    n, hsz = h2.shape
    v = weight.shape[0]
    dev = h2.device
    bt, bv, bk, warps = blocks(dev)
    M, log_s, c, mk, log_sk = (None if x is None else x.contiguous() for x in comb)
    has_ent = ge is not None
    gemm = tuning.current().triton_linear_backward == "gemm"
    sixteen = weight.dtype != torch.float32
    fixing = rounding == "fixed" and sixteen and gemm
    split = (rounding == "split" or (rounding == "fixed" and not gemm)) and sixteen  # atomic: "fixed" as split
    if kept is not None and not gemm:
        raise NotImplementedError(
            "keep_ids: the fused Triton backward writes the kept columns into its stored G chunks; "
            "Tuning(triton_linear_backward='atomic') forms G in registers only: use the default 'gemm' backward "
            "or a keep_mask")
    dh = torch.zeros((n, hsz), dtype=torch.float32, device=dev) if need_dh else None
    chunk = v
    dw = acc = g_hi = g_lo = None
    if gemm:
        if budget is None:  # batch invariance: dh sums its chunks' products, so the chunk follows V alone
            chunk = min(v, max(bv, triton.cdiv(triton.cdiv(v, GEMM_CHUNKS), bv) * bv))
        else:
            per_col = n * weight.element_size() * (2 if split else 1) + (4 * hsz if (split or fixing) and need_dw
                                                                          else 0)
            chunk = min(v, max(bv, budget // max(1, per_col) // bv * bv))
        g_hi = torch.empty((n, chunk), dtype=weight.dtype, device=dev)
        g_lo = torch.empty((n, chunk), dtype=weight.dtype, device=dev) if split else g_hi
        if need_dw:
            dw = torch.empty((v, hsz), dtype=weight.dtype, device=dev)
            acc = torch.empty((chunk, hsz), dtype=torch.float32, device=dev) if split or fixing else None
    elif need_dw:
        if weight.dtype == torch.float32:
            dw = acc = torch.zeros((v, hsz), dtype=torch.float32, device=dev)
        else:
            chunk = min(v, max(bv, (budget or default_atomic_budget(v, hsz)) // max(1, 4 * hsz) // bv * bv))
            dw = torch.empty((v, hsz), dtype=weight.dtype, device=dev)
            acc = torch.empty((chunk, hsz), dtype=torch.float32, device=dev)
    chunked = not gemm and need_dw and acc is not dw  # atomic 16-bit dW: a float32 buffer per vocabulary chunk
    fix = fixes = None
    if fixing and kept is None:  # the kernel's residual slots [3, T] (column << 32 | float32 bits): _unpack
        fix = torch.full((3, n), -1, dtype=torch.int64, device=dev)
        fix[1].fill_(_EMPTY_MIN)  # slot 1: an atomic min over the row's candidates
    elif fixing:  # keep_ids: the residuals of the kept values written over G, at every kept column
        vals = kept[2]
        fixes = (torch.where(kept[1], kept[0], -1).t().contiguous(),
                 (vals - vals.to(weight.dtype).to(vals.dtype)).t().contiguous())
    dummy = dh if dh is not None else (acc if acc is not None else g_hi)  # a disabled output's pointer (unused)
    group_t = group_rows(triton.cdiv(n, bt), bt, hsz, dev)
    for j0 in range(0, v, chunk):
        j1 = min(v, j0 + chunk)
        if chunked:
            acc.zero_()
        dw_arg = (acc if chunked else acc[j0:j1]) if need_dw and not gemm else dummy
        km = keep[:, j0:j1].view(torch.uint8) if keep is not None else ycol
        wj = weight[j0:j1]
        linear_grad_kernel[(triton.cdiv(n, bt), triton.cdiv(j1 - j0, bv))](
            h2, wj, ycol, km, M, log_s, c if has_ent else M, mk, log_sk, gl, ge if has_ent else gl,
            dh if need_dh else dummy, dw_arg, g_hi if gemm else dummy, g_lo if gemm else dummy,
            chunk if gemm else 0, fix if fix is not None else ycol,
            n, j1 - j0, hsz, j0,
            h2.stride(0), h2.stride(1), wj.stride(0), wj.stride(1),
            km.stride(0) if keep is not None else 0, km.stride(1) if keep is not None else 0,
            1.0 / temperature,
            HAS_KEEP=keep is not None, HAS_ENT_GRAD=has_ent, NEED_DH=need_dh, NEED_DW=need_dw,
            SPLIT_G=split, STORE_G=gemm, FIX_G=fix is not None, UPCAST=_upcast(h2),
            PRECISION=_precision(h2, allow_tf32),
            BLOCK_T=bt, BLOCK_V=bv, BLOCK_K=bk, GROUP_T=group_t, **_launch(warps),
        )
        if gemm:
            parts = [g_hi[:, : j1 - j0]] + ([g_lo[:, : j1 - j0]] if split else [])
            if kept is not None:
                _set_kept(parts, kept, j0, j1 - j0)
            with matmul_precision(h2, allow_tf32):
                if need_dh:
                    for part in parts:
                        _mm_f32_into(dh, part, wj, first=False)
                if need_dw and (split or fixing):
                    for i, part in enumerate(parts):
                        _mm_f32_into(acc[: j1 - j0], part.t(), h2, first=i == 0)
                    if fixing:
                        if fix is not None:
                            fixes = _unpack(fix)
                        _fix_dw(acc[: j1 - j0], h2, *fixes, j0, j1)
                    dw[j0:j1].copy_(acc[: j1 - j0])  # the one rounding of this chunk of dW
                elif need_dw:  # G rounded once (or float32): cuBLAS accumulates in float32, rounds once into dW
                    if dev.type == "cuda":
                        torch.mm(parts[0].t(), h2, out=dw[j0:j1])
                    else:
                        dw[j0:j1].copy_(parts[0].t().float() @ h2.float())
        elif chunked:
            dw[j0:j1].copy_(acc[: j1 - j0])  # the one rounding of this chunk of dW
    if fixing and need_dh:
        cols, res = _unpack(fix) if fix is not None else fixes
        for s_cols, s_res in zip(cols, res):  # per row, slot after slot: the same order wherever the row sits
            dh.addcmul_(s_res[:, None], weight[s_cols.clamp(min=0)].to(torch.float32))
    return dh, dw


#: Slot 1's empty value (the kernel's atomic min over a row's candidate columns); the other slots': -1.
_EMPTY_MIN = torch.iinfo(torch.int64).max


def _unpack(fix: torch.Tensor):
    """``(cols [3, T] int64, res [3, T] float32)`` of the kernel's packed slots; ``res`` 0 where ``cols`` is -1.

    Slot 0: the target column; slots 1 and 2: the lowest and the highest
    column with ``p_v > 1/3`` other than the target (atomic min and max of
    the packed values over the tiles). A row with one such column has it in
    both: slot 2 is dropped where its column is slot 1's.
    """
    cols = torch.where((fix >= 0) & (fix != _EMPTY_MIN), fix >> 32, -1)
    cols[2] = torch.where(cols[2] == cols[1], -1, cols[2])
    res = (fix & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    return cols, torch.where(cols >= 0, res, torch.zeros((), dtype=torch.float32, device=fix.device))


def _fix_dw(acc: torch.Tensor, h2: torch.Tensor, cols: torch.Tensor, res: torch.Tensor, j0: int, j1: int) -> None:
    """Add ``res[s, t] h2[t]`` to ``acc[cols[s, t] - j0]`` (float32) for the entries with a column in ``[j0, j1)``.

    No host sync: the entries are sorted by column (stable: slot-major row
    order within a column) and :func:`linear_fix_dw_kernel` sums each
    column's run, found by ``searchsorted``, in that order.
    """
    from .triton_kernels.linear_bwd import linear_fix_dw_kernel

    n = cols.shape[-1]
    flat = cols.reshape(-1)
    width = j1 - j0
    key = torch.where((flat >= j0) & (flat < j1), flat - j0, width)
    key, order = torch.sort(key, stable=True)
    bounds = torch.searchsorted(key, torch.arange(width + 1, dtype=key.dtype, device=key.device))
    hsz = h2.shape[1]
    cuda = acc.device.type == "cuda"
    bh = min(2048, triton.next_pow2(hsz)) if cuda else min(64, triton.next_pow2(hsz))
    # CUDA: >= 8 16-bit elements of h per thread (16-byte loads): one warp per 512 columns
    linear_fix_dw_kernel[(width, triton.cdiv(hsz, bh))](
        acc, h2, (order % n).to(torch.int32), res.reshape(-1)[order], bounds, hsz, acc.stride(0), h2.stride(0),
        h2.stride(1), BLOCK_H=bh, **_launch(max(1, bh // 512) if cuda else None))


def _set_kept(parts, kept, start: int, width: int) -> None:
    """Write the kept columns' values of the chunk ``[start, start + width)`` over its stored ``G`` (its parts)."""
    from .stages import xp as sxp  # with take_along_axis

    cols, use, vals = kept
    c, u = spec.columns_in_block(sxp, cols, use, start, width)
    hi = vals.to(parts[0].dtype)
    spec.set_at_columns(sxp, parts[0], c, hi, u)
    if len(parts) > 1:  # G_lo: what rounding G_hi left, rounded
        spec.set_at_columns(sxp, parts[1], c, (vals - hi.to(vals.dtype)).to(parts[1].dtype), u)


def kept_logits(h2: torch.Tensor, weight: torch.Tensor, cols: torch.Tensor, use: torch.Tensor,
                budget: int) -> torch.Tensor:
    """``[T, K+1]`` float32: the logits ``h2[t] . weight[cols[t, k]]`` where ``use``, else 0 (``keep_ids``).

    O(T K H) products over rows in chunks whose gathered weight rows (float32,
    ``[rows, K+1, H]``) stay within ``budget`` bytes. Each logit is one row's
    own dot product (the same wherever the row sits).
    """
    n, hsz = h2.shape
    k1 = cols.shape[-1]
    out = torch.zeros((n, k1), dtype=torch.float32 if h2.dtype != torch.float64 else h2.dtype, device=h2.device)
    step = max(1, budget // max(1, k1 * hsz * 4))
    for i0 in range(0, n, step):
        i1 = min(n, i0 + step)
        wg = weight[cols[i0:i1].reshape(-1)].reshape(i1 - i0, k1, hsz).to(out.dtype)
        z = torch.bmm(wg, h2[i0:i1].to(out.dtype)[:, :, None])[..., 0]
        out[i0:i1] = torch.where(use[i0:i1], z, 0.0)
    return out


class _Triton:
    # ``triton.cdiv`` without importing triton at module import
    @staticmethod
    def cdiv(a: int, b: int) -> int:
        return -(-a // b)

    @staticmethod
    def next_pow2(a: int) -> int:
        return 1 << max(0, (a - 1).bit_length())


triton = _Triton()
