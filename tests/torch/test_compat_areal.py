"""``dualvp_torch.compat.areal`` (AReaL's ``gather_logprobs`` / ``gather_logprobs_entropy``) against float64.

AReaL's semantics (``areal/utils/functional/vocab_parallel.py``): ``softmax(logits / temperature)``,
float32 results, the entropy with its gradient; ``tp_group`` of more than one rank means ``logits`` is
this rank's shard. W = 1 in-process, W = 2 on gloo ranks; AReaL's own tensor-parallel test runs against
these functions in scripts/peer_tests.py.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dualvp import reference  # noqa: E402
from dualvp_torch.compat import areal  # noqa: E402
from dualvp_torch.testing import run_ranks  # noqa: E402

from . import _compat_stacks as cs  # noqa: E402

TAU = 0.7


def _problem(world, dtype="bfloat16"):
    z = cs.logits((3, 4, 10 * world), dtype, seed=31)
    rng = np.random.default_rng(32)
    y = rng.integers(0, 10 * world, size=(3, 4))
    ups = {"logprob": rng.normal(size=(3, 4)).astype(np.float32), "entropy": rng.normal(size=(3, 4)).astype(np.float32)}
    return z, y, ups


def _expected(z, y, ups):
    lp, h = reference.logprob_entropy(z, y, temperature=TAU)
    g = reference.logprob_entropy_grad(z, y, ups["logprob"], ups["entropy"], temperature=TAU)
    g_lp = reference.logprob_entropy_grad(z, y, ups["logprob"], temperature=TAU)
    return lp, h, g, g_lp


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_w1_values_dtype_and_grad(monkeypatch, dtype):
    monkeypatch.setenv("DUALVP_COMPILE", "0")
    z, y, ups = _problem(1, dtype)
    lp_ref, h_ref, g_ref, g_lp_ref = _expected(z, y, ups)
    x = cs.t(z, dtype, grad=True)
    lp, h = areal.gather_logprobs_entropy(x, torch.tensor(y), TAU)
    assert lp.dtype == h.dtype == torch.float32
    cs.check(lp, lp_ref, dtype, "logprob")
    cs.check(h, h_ref, dtype, "entropy")
    cs.check(cs._grads([lp, h], [ups["logprob"], ups["entropy"]], x), g_ref, dtype, "grad")
    x = cs.t(z, dtype, grad=True)
    lp = areal.gather_logprobs(x, torch.tensor(y), TAU, None, 2)
    cs.check(cs._grads([lp], [ups["logprob"]], x), g_lp_ref, dtype, "grad")
    x = cs.t(z.reshape(12, -1), dtype)  # 2-D input, as AReaL's packed sequences
    cs.check(areal.gather_logprobs(x, torch.tensor(y.reshape(12)), TAU), lp_ref.reshape(12), dtype, "logprob")


def test_w2_gloo_against_the_oracle():
    z, y, ups = _problem(2)
    ranks = run_ranks(cs.areal_ranks, 2, z, y, ups, TAU, timeout=300, env={"DUALVP_COMPILE": "0"})
    lp_ref, h_ref, g_ref, g_lp_ref = _expected(z, y, ups)
    for r, out in enumerate(ranks):
        cols = slice(r * 10, (r + 1) * 10)
        lp, h, dt, g = out["both"]
        assert dt == "torch.float32"
        cs.check(lp, lp_ref, "bfloat16", "logprob")
        cs.check(h, h_ref, "bfloat16", "entropy")
        cs.check(g, g_ref[..., cols], "bfloat16", "grad")
        lp, g = out["logprob"]
        cs.check(lp, lp_ref, "bfloat16", "logprob")
        cs.check(g, g_lp_ref[..., cols], "bfloat16", "grad")
        cs.check(out["private"][0], lp_ref, "bfloat16", "logprob")
        cs.check(out["private"][1], h_ref, "bfloat16", "entropy")


def test_errors_name_the_argument(monkeypatch):
    monkeypatch.setenv("DUALVP_COMPILE", "0")
    z = torch.randn(4, 6)
    with pytest.raises(ValueError, match="labels"):
        areal.gather_logprobs(z, torch.tensor([0, 1, 2, 6]))
    with pytest.raises(ValueError, match="labels"):  # no ignore id in AReaL
        areal.gather_logprobs(z, torch.tensor([0, 1, 2, -100]))
    with pytest.raises(ValueError, match="temperature"):
        areal.gather_logprobs_entropy(z, torch.tensor([0, 1, 2, 3]), 0.0)
    with pytest.raises(TypeError, match="chunk_size"):
        areal.gather_logprobs(z, torch.tensor([0, 1, 2, 3]), chunk_size=None)
    with pytest.raises(TypeError, match="tp_group"):
        areal.gather_logprobs(z, torch.tensor([0, 1, 2, 3]), tp_group="tp")
