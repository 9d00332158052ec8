"""dualvp for JAX: log-prob and entropy of vocab-sharded logits with exact gradients.

- :func:`logprob_entropy`: per-shard op, for use inside ``jax.shard_map``
  (vocab split over ``axis_name``) or unsharded (``axis_name=None``).
- :func:`sharded_logprob_entropy`: the same on global arrays whose last dim is
  sharded over a mesh axis.
- :mod:`dualvp_jax.compat`: ``softmax_cross_entropy_with_integer_labels``,
  a drop-in for optax's, plain or sharded.
- :mod:`dualvp_jax.multiprocess`: with several JAX processes
  (``jax.distributed``), how the global-array functions' ``validate=True``
  makes every process raise the same error or none (never one raising while
  the others wait in the collective).

The two ops are a ``jax.custom_vjp`` built on :mod:`dualvp.spec` with one collective
(an all-gather of O(T) statistics) per call and a closed-form backward.
"""

from . import compat, multiprocess
from .function import check_target_range, logprob_entropy
from .sharded import sharded_logprob_entropy
from .linear import linear_logprob_entropy, sharded_linear_logprob_entropy
from .kl import kl_divergence, sharded_kl_divergence

__all__ = ["logprob_entropy", "sharded_logprob_entropy", "linear_logprob_entropy", "sharded_linear_logprob_entropy",
           "check_target_range", "compat", "multiprocess", "kl_divergence", "sharded_kl_divergence"]
