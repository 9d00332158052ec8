"""dualvp for JAX: log-prob and entropy of vocab-sharded logits with exact gradients.

- :func:`logprob_entropy`: per-shard op, for use inside ``jax.shard_map``
  (vocab split over ``axis_name``) or unsharded (``axis_name=None``).
- :func:`sharded_logprob_entropy`: the same on global arrays whose last dim is
  sharded over a mesh axis.

Both are a ``jax.custom_vjp`` built on :mod:`dualvp.spec` with one collective
(an all-gather of O(T) statistics) per call and a closed-form backward.
"""

from .function import check_target_range, logprob_entropy
from .sharded import sharded_logprob_entropy

__all__ = ["logprob_entropy", "sharded_logprob_entropy", "check_target_range"]
