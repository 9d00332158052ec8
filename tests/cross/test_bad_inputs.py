"""Every bad input of the shared table (:data:`dualvp.testing.cases.BAD_INPUTS`) raises the
documented exception, naming the argument, on every backend and entry point.

Backends: ``torch`` (``dualvp_torch.logprob_entropy``), ``jax``
(``dualvp_jax.logprob_entropy``) and ``jax-sharded`` (the global-array
``dualvp_jax.sharded_logprob_entropy`` on a 2-device mesh); a backend whose
framework is not installed is skipped.
"""

import numpy as np
import pytest

from dualvp.testing import cases

# backend -> the table's backend tag its cases are selected by
BACKENDS = {"torch": "torch", "jax": "jax", "jax-sharded": "jax"}


def _call(backend: str):
    """``call(kw)``: the backend's op on ``kw`` (NumPy values converted to its arrays)."""
    if backend == "torch":
        torch = pytest.importorskip("torch")
        from dualvp_torch import logprob_entropy

        def convert(v):
            if isinstance(v, np.ndarray):
                return torch.from_numpy(v)
            if isinstance(v, np.generic):  # 0-d inputs: a 0-d tensor
                return torch.tensor(v)
            return v

        def call(kw):
            # eager kernels: validation runs before any kernel, and the valid base
            # call need not pay a torch.compile
            kw = {"impl": "eager", **{k: convert(v) for k, v in kw.items()}}
            z = kw.pop("logits")
            if isinstance(z, torch.Tensor) and z.is_floating_point():
                z.requires_grad_(True)
            return logprob_entropy(z, kw.pop("target"), **kw)

        return call
    pytest.importorskip("jax")
    import jax.numpy as jnp

    import dualvp_jax

    def jconvert(kw):
        return {k: jnp.asarray(v) if isinstance(v, (np.ndarray, np.generic)) else v for k, v in kw.items()}

    if backend == "jax":
        return lambda kw: dualvp_jax.logprob_entropy(**jconvert(kw))
    from tests.jax._helpers import mesh_1d

    def sharded(kw):
        kw = jconvert(kw)
        return dualvp_jax.sharded_logprob_entropy(kw.pop("logits"), kw.pop("target"), mesh_1d(2, "auto"), "tp", **kw)

    return sharded


def _table(backend: str) -> list:
    return [b for b in cases.BAD_INPUTS if BACKENDS[backend] in b.backends]


_PARAMS = [pytest.param(backend, bad, id=f"{backend}-{bad.name}") for backend in BACKENDS for bad in _table(backend)]


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_table_is_large_enough_and_its_base_valid(backend):
    assert len(_table(backend)) >= 25
    lp, h = _call(backend)(cases.bad_input_base())
    assert lp.shape == (4,) and h.shape == (4,)


@pytest.mark.parametrize("backend,bad", _PARAMS)
def test_bad_input_raises(backend, bad):
    call = _call(backend)
    kw = cases.bad_input_base()
    kw.update(bad.changes)
    with pytest.raises(bad.error) as info:
        call(kw)
    msg = str(info.value)
    assert f"{bad.arg}:" in msg and "expected" in msg, msg
