"""Every bad input of the shared table raises the documented exception, naming the argument."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import dualvp_jax  # noqa: E402
from dualvp import cases  # noqa: E402

_TABLE = [b for b in cases.BAD_INPUTS if "jax" in b.backends]


def _convert(v):
    if isinstance(v, (np.ndarray, np.generic)):
        return jnp.asarray(v)
    return v


def test_table_is_large_enough():
    assert len(_TABLE) >= 25


def test_base_is_valid():
    kw = {k: _convert(v) for k, v in cases.bad_input_base().items()}
    lp, h = dualvp_jax.logprob_entropy(kw.pop("logits"), kw.pop("target"), **kw)
    assert lp.shape == (4,) and h.shape == (4,)


@pytest.mark.parametrize("bad", _TABLE, ids=lambda b: b.name)
def test_bad_input_raises(bad):
    kw = cases.bad_input_base()
    kw.update(bad.changes)
    kw = {k: _convert(v) for k, v in kw.items()}
    with pytest.raises(bad.error) as info:
        dualvp_jax.logprob_entropy(kw.pop("logits"), kw.pop("target"), **kw)
    msg = str(info.value)
    assert f"{bad.arg}:" in msg, msg
    assert "expected" in msg, msg
