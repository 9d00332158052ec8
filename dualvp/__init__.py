"""dualvp: log-probabilities and entropies from vocab-sharded logits.

This package is the specification: the math written once (:mod:`dualvp.spec`),
the float64 NumPy oracle (:mod:`dualvp.reference`), argument validation
(:mod:`dualvp.validation`), the spec run over simulated shards
(:mod:`dualvp.simulate`) and the conformance fixtures every backend is tested
with (:mod:`dualvp.testing`: cases, tolerances, oracle, backend adapters).
The backends live in ``dualvp_torch`` and ``dualvp_jax``; the ``dualvp``
command (``verify``, ``bench``) in :mod:`dualvp.tools`, which this package
does not import.
"""

from . import reference, simulate, spec, testing, validation

__version__ = "0.1.0"

__all__ = [
    "spec",
    "reference",
    "simulate",
    "validation",
    "testing",
    "__version__",
]
