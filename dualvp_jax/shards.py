"""What every shard of the JAX ops computes alike: dtypes, the shard's position, the statistics' gather.

Shared by the logits op (:mod:`dualvp_jax.function`), its extended form (:mod:`dualvp_jax.extended`) and
the fused op's blocks (:mod:`dualvp_jax.linear_blocks`): this module's job is to share them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from dualvp import spec
from dualvp.validation import Options

__all__ = ["int_dtype", "compute_dtype", "shard_index", "shard_position", "gather_stats"]


def int_dtype():
    return jnp.int64 if jax.config.jax_enable_x64 else jnp.int32


def compute_dtype(dtype):
    # bf16 / f16 / f32 -> f32; f64 -> f64 (only reachable under jax_enable_x64).
    return jnp.promote_types(dtype, jnp.float32)


def shard_index(axis_name):
    """``(r, W)``: this shard's index along ``axis_name`` and the shard count (``(0, 1)`` unsharded)."""
    if axis_name is None:
        return 0, 1
    return lax.axis_index(axis_name), lax.axis_size(axis_name)


def shard_position(axis_name, opt: Options, target, v_local: int):
    """``(valid, owns, local, bad)`` for this shard, and the shard count."""
    r, w = shard_index(axis_name)
    valid, owns, local = spec.target_to_local(jnp, target, r, v_local, opt.ignore_index)
    bad = valid & ((target < 0) | (target >= w * v_local))
    return valid, owns, local, bad


def gather_stats(axis_name, stats):
    if axis_name is None:
        return stats[None]
    # The one collective of the op. ``to="invarying"``: the table is the same
    # on every shard, and its type says so (check_vma).
    return lax.all_gather(stats, axis_name, axis=0, to="invarying")
