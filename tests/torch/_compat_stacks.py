"""Shared by the tests of the stacks' drop-ins (tests/torch/test_compat_{trl,verl,nemo_rl,areal}.py).

The float64 judges: :mod:`dualvp.reference` (log-prob, entropy and their gradients) and, for the sum of
squared probabilities, the textbook formula in NumPy (``S = sum p^2``, ``dS/dz = 2 p (p - S)``). Rank
bodies for the W = 2 gloo runs live here too (module level: they are pickled to the ranks).
"""

from __future__ import annotations

import numpy as np
import torch

from dualvp import reference
from dualvp.testing.cases import round_to_dtype
from dualvp.testing.metrics import Tolerance, max_errors, tolerance, within_tolerance

DT = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: Unit roundoff (half an ulp, relative) of the 16-bit output dtypes: a value rounded ONCE from float32.
HALF_ULP = {"bfloat16": 2.0**-8, "float16": 2.0**-11}


def logits(shape, dtype: str, seed: int = 0, scale: float = 3.0) -> np.ndarray:
    """float64 values already rounded to ``dtype`` (the oracle sees the same input as the op)."""
    rng = np.random.default_rng(seed)
    return round_to_dtype(rng.normal(size=shape) * scale, dtype)


def t(x: np.ndarray, dtype: str, grad: bool = False) -> torch.Tensor:
    return torch.tensor(x).to(DT[dtype]).requires_grad_(grad)


def n(x: torch.Tensor) -> np.ndarray:
    return x.detach().double().numpy()


def sum_pi_squared(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 ``(S, p)``: ``S = sum_v p_v^2`` of ``p = softmax(z)``."""
    u = z - z.max(axis=-1, keepdims=True)
    p = np.exp(u) / np.exp(u).sum(axis=-1, keepdims=True)
    return (p * p).sum(axis=-1), p


def sum_pi_squared_grad(z: np.ndarray, g: np.ndarray) -> np.ndarray:
    s, p = sum_pi_squared(z)
    return 2.0 * g[..., None] * p * (p - s[..., None])


def check(x, ref, dtype: str, what: str, out_dtype: str | None = None) -> None:
    """``x`` against the float64 ``ref`` within the op's tolerance for ``dtype`` inputs; a 16-bit
    ``out_dtype`` adds the one rounding of the output (half an ulp, relative)."""
    tol = tolerance(dtype, what)
    if out_dtype in HALF_ULP:
        tol = Tolerance(tol.atol, tol.rtol + HALF_ULP[out_dtype])
    xs = n(x) if isinstance(x, torch.Tensor) else np.asarray(x)
    assert xs.shape == np.shape(ref), (xs.shape, np.shape(ref))
    assert within_tolerance(xs, ref, tol), f"{what} ({dtype} in, {out_dtype} out): {max_errors(xs, ref)} > {tol}"


def oracle_k(z: np.ndarray, idx: np.ndarray, g: np.ndarray, temperature: float = 1.0):
    """float64 ``(logprobs [..., K], grad [..., V])`` of ``sum_k g_k log p(idx_k)``, from the reference."""
    lps, grad = [], np.zeros_like(z)
    for k in range(idx.shape[-1]):
        lp, _ = reference.logprob_entropy(z, idx[..., k], temperature=temperature)
        lps.append(lp)
        grad += reference.logprob_entropy_grad(z, idx[..., k], g[..., k], temperature=temperature)
    return np.stack(lps, axis=-1), grad


# ------------------------------------------------------------------------------------------- rank bodies


def _shard(full: np.ndarray, rank: int, world: int, dtype: str, grad: bool = True) -> torch.Tensor:
    v = full.shape[-1] // world
    return t(np.ascontiguousarray(full[..., rank * v : (rank + 1) * v]), dtype, grad)


def _grads(outputs, ups, x):
    """``d sum_i (ups_i * outputs_i) / dx`` as float64 NumPy (``None`` entries skipped)."""
    total = sum((o.float() * torch.tensor(u, dtype=torch.float32)).sum() for o, u in zip(outputs, ups) if o is not None)
    (g,) = torch.autograd.grad(total, x)
    return n(g)


def verl_ranks(rank: int, world: int, z: np.ndarray, y: np.ndarray, ups: dict) -> dict:
    """verl's Megatron-engine functions on this rank's shard (group: the world via ``tp_group=``)."""
    import torch.distributed as dist

    from dualvp_torch.compat import verl

    group = dist.group.WORLD
    out = {}
    x = _shard(z, rank, world, "float32")
    ent = verl.vocab_parallel_entropy(x, tp_group=group)
    out["entropy"] = (n(ent), str(ent.dtype), _grads([ent], [ups["entropy"]], x))
    x = _shard(z, rank, world, "float32")
    lp = verl.vocab_parallel_log_probs_from_logits(x, torch.tensor(y), tp_group=group)
    out["logprob"] = (n(lp), str(lp.dtype), _grads([lp], [ups["logprob"]], x))
    x = _shard(z, rank, world, "float32")
    lp2, ent2 = verl.vocab_parallel_log_probs_and_entropy(x, torch.tensor(y), tp_group=group)
    out["both"] = (n(lp2), n(ent2), _grads([lp2, ent2], [ups["logprob"], ups["entropy"]], x))
    x = _shard(z, rank, world, "float32")
    s = verl.vocab_parallel_sum_pi_squared(x, tp_group=group)
    out["sum_pi_squared"] = (n(s), str(s.dtype), _grads([s], [ups["entropy"]], x))
    xb = _shard(z, rank, world, "bfloat16", grad=False)
    out["entropy_bf16"] = (n(verl.vocab_parallel_entropy(xb, tp_group=group)),
                           str(verl.vocab_parallel_entropy(xb, tp_group=group).dtype))
    out["chunked"] = n(verl.vocab_parallel_entropy_with_chunking(_shard(z, rank, world, "float32", False), 3,
                                                                 tp_group=group))
    try:  # no group, no megatron-core state, 2 ranks: never the world group
        verl.vocab_parallel_entropy(_shard(z, rank, world, "float32", False))
        out["bare"] = None
    except ValueError as exc:
        out["bare"] = str(exc)
    return out


def verl_dtensor_ranks(rank: int, world: int, z: np.ndarray, y: np.ndarray, ups: dict) -> dict:
    """verl's unfused functions on a vocab-sharded DTensor (1-D mesh), taken as it is."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from dualvp_torch.compat import verl

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    local = _shard(z, rank, world, "float32")
    dz = DTensor.from_local(local, mesh, (Shard(-1),), run_check=False)
    lp = verl.logprobs_from_logits(dz, torch.tensor(y), inplace_backward=False)
    ent = verl.entropy_from_logits(dz)
    s = verl.calculate_sum_pi_squared_from_logits(dz)
    plain = [type(v).__name__ for v in (lp, ent, s)]
    g = _grads([lp, ent, s], [ups["logprob"], ups["entropy"], ups["logprob"]], local)
    return {"logprob": n(lp), "entropy": n(ent), "sum_pi_squared": n(s), "types": plain, "grad": g}


def nemo_ranks(rank: int, world: int, z: np.ndarray, y: np.ndarray, yk: np.ndarray, ups: dict) -> dict:
    """NeMo-RL's four classes on this rank's shard, with the world group."""
    import torch.distributed as dist

    from dualvp_torch.compat import nemo_rl

    group = dist.group.WORLD
    v = z.shape[-1] // world
    start, end = rank * v, (rank + 1) * v
    out = {}
    x = _shard(z, rank, world, "float32")
    lp = nemo_rl.DistributedLogprob.apply(x, torch.tensor(y), start, end, group)
    out["logprob"] = (n(lp), _grads([lp], [ups["logprob"]], x))
    x = _shard(z, rank, world, "float32")
    lp = nemo_rl.ChunkedDistributedLogprob.apply(x, torch.tensor(y), start, end, 2, group, False)
    out["chunked"] = (n(lp), _grads([lp], [ups["logprob"]], x))
    x = _shard(z, rank, world, "float32")
    lpk = nemo_rl.ChunkedDistributedGatherLogprob.apply(x, torch.tensor(yk), start, end, 3, group, False)
    out["gather"] = (n(lpk), _grads([lpk], [ups["gather"]], x))
    x = _shard(z, rank, world, "float32")
    neg_h = nemo_rl.ChunkedDistributedEntropy.apply(x, 2, group, False)
    out["neg_entropy"] = (n(neg_h), _grads([neg_h], [ups["entropy"]], x))
    inf = nemo_rl.ChunkedDistributedEntropy.apply(_shard(z, rank, world, "float32"), 2, group, True)
    out["inference_only_requires_grad"] = inf.requires_grad
    try:  # a wrong shard on rank 1 only: every rank raises, none hangs
        nemo_rl.DistributedLogprob.apply(_shard(z, rank, world, "float32"), torch.tensor(y),
                                         start + (rank == 1), end, group)
        out["bad_start"] = None
    except (ValueError, RuntimeError) as exc:  # the rank at fault: its ValueError; the others: RuntimeError
        out["bad_start"] = f"{type(exc).__name__}: {exc} / {exc.__cause__}"
    return out


def areal_ranks(rank: int, world: int, z: np.ndarray, y: np.ndarray, ups: dict, tau: float) -> dict:
    """AReaL's functions on this rank's shard, ``tp_group`` the world."""
    import torch.distributed as dist

    from dualvp_torch.compat import areal

    group = dist.group.WORLD
    out = {}
    x = _shard(z, rank, world, "bfloat16")
    lp, ent = areal.gather_logprobs_entropy(x, torch.tensor(y), tau, group, 4)
    out["both"] = (n(lp), n(ent), str(lp.dtype), _grads([lp, ent], [ups["logprob"], ups["entropy"]], x))
    x = _shard(z, rank, world, "bfloat16")
    lp = areal.gather_logprobs(x, torch.tensor(y), tau, group)
    out["logprob"] = (n(lp), _grads([lp], [ups["logprob"]], x))
    x = _shard(z, rank, world, "bfloat16")
    lp, ent = areal._vocab_parallel_logprobs_entropy(x, torch.tensor(y), group, tau)
    out["private"] = (n(lp), n(ent))
    return out
