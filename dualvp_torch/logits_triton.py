"""Host side of the logits op's Triton engine: launch plans and launchers (the kernels: ``triton_kernels/``).

Data flow of one call (``T`` rows, shard ``V_local``, ``W`` ranks), driven by
:mod:`dualvp_torch.library` through the engine registry (:mod:`dualvp_torch.engines`)::

    forward:  W = 1, S = 1: logits_stats_kernel [T, V_local] -> logprob, entropy, res [5, T] (1 launch)
              else: logits_stats_kernel -> stats [S, T, 6] (S column splits, from V_local alone)
                    W > 1: all-gather stats -> [W, S, T, 6]
                    logits_merge_kernel [W S, T, 6] -> logprob, entropy, res [5, T] (1 launch)
    backward: logits_grad_kernel [T, V_local] -> gradient, fresh or in the logits' storage (1 launch)

A :class:`Plan` holds everything that depends only on the call's metadata
(shapes, dtypes, options, block sizes, grids); the op caches it per metadata
key with the call's checks (:mod:`dualvp_torch.checks`), so a call runs O(1)
Python: no target mapping in torch ops, no temperature tensor, no copy of
contiguous inputs. The checks, the agreement (``validate=True``) and the
collectives are the op's own; the kernels count no bad targets here
(``validate=False`` plans: no counter, no fill launch), nothing synchronises
with the device and no allocation depends on data (capturable by CUDA graphs).
"""

from __future__ import annotations

import struct
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from dualvp import validation

from .triton_kernels.logits_grad import EXT_COEF, logits_ext_grad_kernel, logits_grad_kernel
from .triton_kernels.logits_merge import logits_merge_kernel
from .triton_kernels.logits_stats import logits_stats_kernel

__all__ = ["Plan", "make_plan", "stats", "stats_outputs", "merge", "grad", "ext_stats", "ext_grad", "EXT_COEF"]

_TL = {torch.float32: tl.float32, torch.float64: tl.float64}


class Plan(NamedTuple):
    """The launch configuration of one call's metadata (see :func:`make_plan`)."""

    opt: validation.Options
    rank: int
    world: int
    T: int
    V: int
    vocab: int
    v_lo: int
    compute: torch.dtype  # float32, float64 for float64 input
    has_keep: bool
    need_entropy_grad: bool
    validate: bool
    record: Optional[tuple]  # agreement record (validate=True with a group), bad-target field 0
    stats_cfg: tuple  # (grid (T, S), BLOCK_V, num_warps)
    merge_cfg: tuple  # (grid, BLOCK_T, num_warps)
    grad_cfg: tuple  # (grid (T, column blocks), BLOCK_V, num_warps)
    splits: int  # S: column splits of a row in the forward, from V_local alone
    cols_per_split: int
    finalize: bool  # W = 1 and S = 1 (and no keep_ids): the statistics kernel writes the outputs (no merge launch)
    compiled: bool  # compiled for the GPU (not the interpreter), float32 compute: PTX helpers, fused reductions
    scalars: tuple  # float32: (1/tau hi, lo; log2(e)/tau; (1/tau) / that, hi, lo), pairs hi + lo exact to ~1e-15


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]  # round to nearest float32


def _pair(x: float) -> tuple:
    # a float64 as two float32 (hi + lo, ~48 bits): kernels take float32 scalars (the interpreter rounds any float)
    hi = _f32(x)
    return hi, _f32(x - hi)


_LOG2E = 1.4426950408889634

#: the forward splits a row into column ranges of at most this many blocks (GPU): a row of 4-byte logits longer
#: than 65,536 columns (16-bit: 131,072) is walked by several programs, merged associatively. From V_local alone.
MAX_BLOCKS_PER_SPLIT = 16


def make_plan(opt: validation.Options, rank: int, world: int, T: int, V: int, dtype: torch.dtype, device_type: str,
              validate: bool, record: Optional[tuple]) -> Plan:
    """Block sizes, splits and grids; a pure function of its arguments, none chosen from ``T``.

    Under the interpreter (CPU tensors) small blocks keep a launch within a
    second or two at test sizes (and rows over 256 columns split, so that the
    tests cover the split axis). On a GPU: the forward walks a row in blocks
    of 4096 (4-byte, or 2-byte with a keep mask) or 8192 (2-byte) elements,
    16-byte vector loads by 8 warps, one program per row and column split (:data:`MAX_BLOCKS_PER_SPLIT`);
    the backward one row x 4096 columns per program (8 warps); the merge (only
    with W > 1 or S > 1) 256 rows per program. Heuristics to be measured by
    the bench (docs/decisions.md, "Triton launch sizes", "Logits kernels toward
    the floor").
    """
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    if device_type == "cpu":  # TRITON_INTERPRET=1
        st = (min(128, _pow2(V)), 1)
        per_split = 2
        gr = (min(256, _pow2(V)), 1)
        mg = (64, 1)  # (a constant: blocks never from T)
    else:
        # 16 (4-byte) or 32 (2-byte) elements per thread and iteration; with a keep mask in 2-byte the
        # statistics kernel is capped at KEEP_MAXNREG registers (:func:`_reg_cap`)
        bv = 8192 if dtype.itemsize <= 2 else 4096
        st = (min(bv, _pow2(V)), 8 if V >= 2048 else 4)
        per_split = MAX_BLOCKS_PER_SPLIT
        gr = (min(4096, _pow2(V)), 8 if V >= 2048 else 4)
        mg = (256, 4)
    n_blocks = triton.cdiv(V, st[0])
    per_split = triton.cdiv(n_blocks, triton.cdiv(n_blocks, per_split))  # balanced splits
    splits = max(1, triton.cdiv(n_blocks, per_split))
    cols_per_split = per_split * st[0]
    stats_cfg = ((T, splits), *st)
    grad_cfg = ((T, triton.cdiv(V, gr[0])), *gr)
    merge_cfg = ((triton.cdiv(T, mg[0]),), *mg)
    tau = float(opt.temperature)
    inv = 1.0 / tau
    l2e = _f32(_LOG2E / tau)
    scalars = (*_pair(inv), l2e, *_pair(inv / l2e))
    compiled = device_type != "cpu" and compute == torch.float32
    return Plan(opt, rank, world, T, V, world * V, rank * V, compute, opt.has_mask, opt.need_entropy_grad,
                validate, record, stats_cfg, merge_cfg, grad_cfg, splits, cols_per_split,
                world == 1 and splits == 1 and not opt.has_ids, compiled, scalars)


#: Register cap of the statistics kernel with a keep mask over 8192-element (2-byte) blocks: uncapped it takes
#: 99 registers (Triton 3.6, sm_90), capped 96 with no spill; 32 elements per thread instead of 16 cut its
#: loop from 29.7 to 25.5 SASS instructions per element (bfloat16), the lower bound on the H200 from 1.10 to
#: 1.04 (docs/decisions.md, "Logits kernels toward the floor").
KEEP_MAXNREG = 96


def _reg_cap(keep, bv: int) -> dict:
    # launch options of the statistics kernel: the register cap where the block holds 32 elements per thread
    # beside a keep mask (GPU only: the interpreter's blocks are <= 128)
    return {"maxnreg": KEEP_MAXNREG} if keep is not None and bv == 8192 else {}


def _launch_stats(z, y, keep, plan: Plan, bad, out, logprob, entropy, res) -> None:
    grid, bv, nw = plan.stats_cfg
    k = z if keep is None else keep  # any pointer when HAS_KEEP is off
    logits_stats_kernel[grid](
        z, z.stride(0), y, k, k.stride(0), out, z if bad is None else bad, logprob, entropy, res, z,
        plan.T, plan.V, plan.v_lo, plan.vocab, plan.opt.ignore_index, plan.cols_per_split, *plan.scalars,
        HAS_KEEP=keep is not None, WITH_ENTROPY=plan.opt.with_entropy, HAS_COUNTER=bad is not None,
        FINALIZE=out is None, COMPILED=plan.compiled, COMPUTE=_TL[plan.compute], ACC=tl.float64, BLOCK_V=bv,
        KEEP_VEC=16 // z.element_size(), HAS_TARGET=True, WITH_SUM_P2=False, ROW_TAU=False, N_OUT=6, num_warps=nw,
        **_reg_cap(keep, bv),
    )


def stats(z: torch.Tensor, y: torch.Tensor, keep: Optional[torch.Tensor], plan: Plan) -> tuple:
    """``(stats [S, T, 6], bad)``: :mod:`.logits_stats` on ``z [T, V]`` (unit column stride), ``S`` column splits.

    ``bad``: the int32 ``[1]`` bad-target counter with ``plan.validate``, else
    ``None`` (no counter, no fill launched).
    """
    dev = z.device
    out = torch.empty((plan.splits, plan.T, 6), dtype=plan.compute, device=dev)
    bad = torch.zeros((1,), dtype=torch.int32, device=dev) if plan.validate else None
    if plan.T:  # (a grid of 0 programs is not launched)
        _launch_stats(z, y, keep, plan, bad, out, out, out, out)
    return out, bad


def stats_outputs(z: torch.Tensor, y: torch.Tensor, keep: Optional[torch.Tensor], plan: Plan,
                  shape: Optional[tuple] = None) -> tuple:
    """``(logprob, entropy, res [5, T], bad)`` in one launch (``plan.finalize``: W = 1, one split).

    ``logprob``, ``entropy``: ``[T]``, or ``shape`` (the target's: contiguous, no view to make).
    """
    dev = z.device
    shape = (plan.T,) if shape is None else shape
    logprob = torch.empty(shape, dtype=plan.compute, device=dev)
    entropy = torch.empty(shape, dtype=plan.compute, device=dev)
    res = torch.empty((5, plan.T), dtype=plan.compute, device=dev)
    bad = torch.zeros((1,), dtype=torch.int32, device=dev) if plan.validate else None
    if plan.T:
        _launch_stats(z, y, keep, plan, bad, None, logprob, entropy, res)
    return logprob, entropy, res, bad


def merge(all_stats: torch.Tensor, y: torch.Tensor, plan: Plan, shape: Optional[tuple] = None) -> tuple:
    """``(logprob, entropy, res [5, T])``: :mod:`.logits_merge` on ``[N, T, 6]`` partial statistics.

    ``logprob``, ``entropy``: ``[T]``, or ``shape`` (contiguous).
    """
    dev = all_stats.device
    shape = (plan.T,) if shape is None else shape
    logprob = torch.empty(shape, dtype=plan.compute, device=dev)
    entropy = torch.empty(shape, dtype=plan.compute, device=dev)
    res = torch.empty((5, plan.T), dtype=plan.compute, device=dev)
    grid, bt, nw = plan.merge_cfg
    if plan.T:
        logits_merge_kernel[grid](all_stats, y, logprob, entropy, res, plan.T, all_stats.shape[0],
                                  plan.opt.ignore_index, *plan.scalars[:2], BLOCK_T=bt, num_warps=nw)
    return logprob, entropy, res


def grad(z: torch.Tensor, y: torch.Tensor, keep: Optional[torch.Tensor], res: torch.Tensor, gl: torch.Tensor,
         ge: Optional[torch.Tensor], plan: Plan, out: Optional[torch.Tensor] = None,
         shape: Optional[tuple] = None) -> torch.Tensor:
    """The gradient of ``z [T, V]`` (:mod:`.logits_grad`) into ``out`` (``z`` itself for in place) or a fresh buffer.

    ``gl``, ``ge``: ``[T]`` upstream gradients of any float dtype and stride
    (an expanded ``[T]`` has stride 0); ``ge`` only with the entropy term.
    """
    if out is None:  # fresh: [T, V], or ``shape`` (the logits'), contiguous, rows of V
        g = torch.empty((plan.T, plan.V) if shape is None else shape, dtype=z.dtype, device=z.device)
        stride_g = plan.V
    else:
        g, stride_g = out, out.stride(0)
    grid, bv, nw = plan.grad_cfg
    k = z if keep is None else keep
    e = gl if ge is None else ge
    if plan.T:
        logits_grad_kernel[grid](
            z, z.stride(0), g, stride_g, y, k, k.stride(0), res, gl, gl.stride(0), e, e.stride(0),
            plan.T, plan.V, plan.v_lo, plan.opt.ignore_index, *plan.scalars[:3],
            HAS_KEEP=keep is not None, ENTROPY=ge is not None, COMPILED=plan.compiled, COMPUTE=_TL[plan.compute],
            BLOCK_V=bv, KEEP_VEC=16 // z.element_size(), num_warps=nw,
        )
    return g


# --- the extended op (K targets, a temperature tensor, sum p^2: dualvp_torch.extended) ------------------------
#
# The same statistics kernel without a target (HAS_TARGET=False: spec.ext_block_stats' shared row statistics,
# zy = 0, the kept pair over the mask alone), with s2 (WITH_SUM_P2) and one temperature per row (ROW_TAU);
# the K target logits and dropped flags are an O(T K) gather on the host. The gradient is
# logits_ext_grad_kernel (spec.ext_block_grad without its target terms), the target columns written over it by
# the host. Launch sizes, splits and grids are the base op's plan (from V_local alone).


def ext_stats(z: torch.Tensor, keep: Optional[torch.Tensor], tau_rows: Optional[torch.Tensor], with_entropy: bool,
              with_sum_p2: bool, plan: Plan) -> torch.Tensor:
    """``[S, T, 6 (+1 with sum_p2)]``: ``spec.ext_block_stats``' row statistics (and ``s2``) of each column split.

    ``z [T, V]`` unit column stride; ``keep`` uint8 ``[T, V]`` or ``None``;
    ``tau_rows``: ``[T]`` contiguous temperatures in the compute dtype, or
    ``None`` (the plan's number). ``with_entropy`` is forced by ``with_sum_p2``
    (``s2`` needs ``s``), as in the spec.
    """
    n_out = 7 if with_sum_p2 else 6
    out = torch.empty((plan.splits, plan.T, n_out), dtype=plan.compute, device=z.device)
    if plan.T:
        grid, bv, nw = plan.stats_cfg
        k = z if keep is None else keep
        logits_stats_kernel[grid](
            z, z.stride(0), z, k, k.stride(0), out, z, out, out, out, z if tau_rows is None else tau_rows,
            plan.T, plan.V, plan.v_lo, plan.vocab, plan.opt.ignore_index, plan.cols_per_split, *plan.scalars,
            HAS_KEEP=keep is not None, WITH_ENTROPY=with_entropy or with_sum_p2, HAS_COUNTER=False, FINALIZE=False,
            COMPILED=plan.compiled, COMPUTE=_TL[plan.compute], ACC=tl.float64, BLOCK_V=bv,
            KEEP_VEC=16 // z.element_size(), HAS_TARGET=False, WITH_SUM_P2=with_sum_p2, ROW_TAU=tau_rows is not None,
            N_OUT=n_out, num_warps=nw, **_reg_cap(keep, bv),
        )
    return out


def ext_grad(z: torch.Tensor, keep: Optional[torch.Tensor], coef: torch.Tensor, entropy: bool, sum_p2: bool,
             plan: Plan, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``spec.ext_block_grad`` (``target_terms=False``) of ``z [T, V]`` into ``out`` (``z`` for in place) or a fresh
    ``[T, V]`` buffer, from the per-row ``coef [len(EXT_COEF), T]`` (compute dtype, contiguous)."""
    if out is None:
        out = torch.empty((plan.T, plan.V), dtype=z.dtype, device=z.device)
    grid, bv, nw = plan.grad_cfg
    k = z if keep is None else keep
    if plan.T:
        logits_ext_grad_kernel[grid](
            z, z.stride(0), out, out.stride(0), k, k.stride(0), coef, plan.T, plan.V,
            HAS_KEEP=keep is not None, ENTROPY=entropy, SUM_P2=sum_p2, COMPILED=plan.compiled,
            COMPUTE=_TL[plan.compute], BLOCK_V=bv, KEEP_VEC=16 // z.element_size(), num_warps=nw,
        )
    return out
