"""dualvp: log-probabilities and entropies from vocab-sharded logits.

This package is the specification: the math written once (:mod:`dualvp.spec`),
the float64 NumPy oracle (:mod:`dualvp.reference`), argument validation
(:mod:`dualvp.validation`) and the shared test scenarios (:mod:`dualvp.cases`).
The backends live in ``dualvp_torch`` and ``dualvp_jax``; the ``dualvp``
command (``verify``, ``bench``) in :mod:`dualvp.tools`, which this package
does not import.
"""

from . import cases, reference, simulate, spec, validation
from .reference import logprob_entropy, logprob_entropy_grad

__version__ = "0.1.0"

__all__ = [
    "spec",
    "reference",
    "simulate",
    "validation",
    "cases",
    "logprob_entropy",
    "logprob_entropy_grad",
    "__version__",
]
