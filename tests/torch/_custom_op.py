"""What the custom-op tests share: the engines and callers they run, and a caller's compiled function.

Every op (logits, extended, fused) is run by each engine, called eagerly and from inside a caller's
``torch.compile(fullgraph=True)`` (a graph break raises) with the ``aot_eager`` and ``inductor`` backends.
"""

import types

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


def fresh(fn):
    """A copy of ``fn`` with a code object of its own, which dynamo has never compiled.

    Dynamo's cache and recompile limit are per code object: a closure of the same code compiled for
    the 9th time would meet the limit. ``torch._dynamo.reset()`` starts afresh too, but it drops every
    code object's graphs, the compiled engine's kernels included: traced again (~1.4 s each) by every
    later test of the process.
    """
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def compiled(fn, caller: str):
    """``fn`` as the ``caller`` runs it: as is, or compiled afresh with ``fullgraph=True`` by that backend."""
    if caller == "eager":
        return fn
    return torch.compile(fresh(fn), fullgraph=True, backend=caller)  # fullgraph: a graph break raises


def matrix(cases, ids=None, compiled_first_case_only: bool = False) -> list:
    """``pytest.param(case, engine, caller)`` over :data:`ENGINES` x :data:`CALLERS` for each case, the
    compiled engine under the fullgraph callers on the first case only.

    ``compiled_first_case_only``: the compiled engine on the first case only, from every caller: for an
    op whose every case another test runs eagerly on the compiled engine (that call is the eager
    caller's: the same custom op), which this matrix would repeat (~1.4 s of tracing per variant in a
    process that has not compiled it).

    The compiled engine's kernels compile inside the op's real kernel at run time, the same for every
    caller (the caller's graph holds the op as opaque): its case-dependent variants run from the eager
    caller on every case; the eager engine, cheap, on every
    case and caller (the fake kernel's outputs per case under each caller). The Triton engine runs the
    same fake kernel: on every case from the eager caller, under the fullgraph callers on the first case
    in the fast tier (its other cases there: slow).
    """
    ids = [str(c) for c in cases] if ids is None else ids
    out = []
    for i, (case, cid) in enumerate(zip(cases, ids)):
        for eng in ENGINES:
            for cal in CALLERS:
                (impl,), (caller,) = eng.values, cal.values
                if impl == "compiled" and (caller != "eager" or compiled_first_case_only) and i > 0:
                    continue
                breadth = [pytest.mark.slow] if impl == "triton" and caller != "eager" and i > 0 else []
                out.append(pytest.param(case, impl, caller, id=f"{cid}-{eng.id}-{cal.id}",
                                        marks=[*eng.marks, *cal.marks, *breadth]))
    return out
