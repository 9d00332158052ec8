"""What the custom-op tests share: the engines and callers they run, and a caller's compiled function.

Every op (logits, extended, fused) is run by each engine, called eagerly and from inside a caller's
``torch.compile(fullgraph=True)`` (a graph break raises) with the ``aot_eager`` and ``inductor`` backends.
"""

import pytest
import torch

from dualvp_torch import engines

ENGINES = [
    pytest.param("eager", id="eager"),
    pytest.param("compiled", id="compiled", marks=pytest.mark.slow),
    pytest.param("triton", id="triton", marks=pytest.mark.skipif(
        engines.ENGINES["triton"].unavailable(torch.device("cpu")) is not None, reason="no triton interpreter")),
]
CALLERS = [
    pytest.param("eager", id="eager-caller"),
    pytest.param("aot_eager", id="fullgraph-aot_eager"),
    pytest.param("inductor", id="fullgraph-inductor", marks=pytest.mark.slow),
]


def compiled(fn, caller: str):
    """``fn`` as the ``caller`` runs it: as is, or compiled with ``fullgraph=True`` by that backend."""
    if caller == "eager":
        return fn
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=caller)  # fullgraph: a graph break raises
