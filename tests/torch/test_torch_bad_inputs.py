"""Every bad input of the shared table raises the documented exception, naming the argument."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dualvp import cases  # noqa: E402
from dualvp_torch import logprob_entropy  # noqa: E402

_TABLE = [b for b in cases.BAD_INPUTS if "torch" in b.backends]


def _convert(v):
    if isinstance(v, np.ndarray):
        return torch.from_numpy(v)
    if isinstance(v, np.generic):  # 0-d inputs: a 0-d tensor
        return torch.tensor(v)
    return v


def test_table_is_large_enough():
    assert len(_TABLE) >= 25


def test_base_is_valid():
    kw = {k: _convert(v) for k, v in cases.bad_input_base().items()}
    lp, h = logprob_entropy(kw.pop("logits"), kw.pop("target"), **kw)
    assert lp.shape == (4,) and h.shape == (4,)


@pytest.mark.parametrize("bad", _TABLE, ids=lambda b: b.name)
def test_bad_input_raises(bad):
    kw = cases.bad_input_base()
    kw.update(bad.changes)
    kw = {k: _convert(v) for k, v in kw.items()}
    if isinstance(kw["logits"], torch.Tensor) and kw["logits"].is_floating_point():
        kw["logits"].requires_grad_(True)
    with pytest.raises(bad.error) as info:
        logprob_entropy(kw.pop("logits"), kw.pop("target"), **kw)
    msg = str(info.value)
    assert msg.startswith(bad.arg + ":") or f"{bad.arg}:" in msg, msg
    assert "expected" in msg, msg
