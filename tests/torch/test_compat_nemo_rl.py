"""``dualvp_torch.compat.nemo_rl`` (NeMo-RL's vocab-parallel autograd classes) against float64.

NeMo-RL's semantics (``nemo_rl/distributed/model_utils.py``): ``.apply`` with its positional
arguments; float32 results; ``ChunkedDistributedEntropy`` returns ``sum p log p`` (minus the entropy);
``inference_only=True`` returns no gradient. W = 1 here in-process, W = 2 on gloo ranks; NeMo-RL's own
tests run against these classes in scripts/peer_tests.py.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dualvp import reference  # noqa: E402
from dualvp_torch.compat import nemo_rl  # noqa: E402
from dualvp_torch.testing import run_ranks  # noqa: E402

from . import _compat_stacks as cs  # noqa: E402


def _problem(world, seed=21):
    z = cs.logits((2, 5, 12 * world), "float32", seed=seed)
    rng = np.random.default_rng(seed + 1)
    y = rng.integers(0, 12 * world, size=(2, 5))
    y[1, 4] = -100  # NeMo-RL: an id on no shard gives 0 (here: only -100; any other raises)
    yk = rng.integers(0, 12 * world, size=(2, 5, 3))
    ups = {"logprob": rng.normal(size=(2, 5)).astype(np.float32),
           "entropy": rng.normal(size=(2, 5)).astype(np.float32),
           "gather": rng.normal(size=(2, 5, 3)).astype(np.float32)}
    return z, y, yk, ups


def _expected(z, y, yk, ups):
    lp, h = reference.logprob_entropy(z, y)
    zero = np.zeros(y.shape, dtype=np.int64)
    lpk, g_k = cs.oracle_k(z, yk, ups["gather"])
    return dict(
        lp=lp, h=h, lpk=lpk, g_k=g_k,
        g_lp=reference.logprob_entropy_grad(z, y, ups["logprob"]),
        g_neg_h=-reference.logprob_entropy_grad(z, zero, np.zeros(y.shape), ups["entropy"]),
    )


def _check_rank(out, e, cols):
    for key in ("logprob", "chunked"):
        lp, g = out[key]
        cs.check(lp, e["lp"], "float32", "logprob")
        cs.check(g, e["g_lp"][..., cols], "float32", "grad")
    lpk, g = out["gather"]
    cs.check(lpk, e["lpk"], "float32", "logprob")
    cs.check(g, e["g_k"][..., cols], "float32", "grad")
    neg_h, g = out["neg_entropy"]
    cs.check(neg_h, -e["h"], "float32", "entropy")
    cs.check(g, e["g_neg_h"][..., cols], "float32", "grad")
    assert out["inference_only_requires_grad"] is False


def test_w1_in_process(monkeypatch):
    monkeypatch.setenv("DUALVP_COMPILE", "0")
    z, y, yk, ups = _problem(1)
    out = _w1(z, y, yk, ups)  # group None: unsharded
    _check_rank(out, _expected(z, y, yk, ups), slice(None))


def _w1(z, y, yk, ups):
    x = lambda: cs.t(z, "float32", grad=True)  # noqa: E731
    v = z.shape[-1]
    out = {}
    a = x()
    lp = nemo_rl.DistributedLogprob.apply(a, torch.tensor(y), 0, v, None)
    out["logprob"] = (cs.n(lp), cs._grads([lp], [ups["logprob"]], a))
    a = x()
    lp = nemo_rl.ChunkedDistributedLogprob.apply(a, torch.tensor(y), 0, v, 4, None, False)
    out["chunked"] = (cs.n(lp), cs._grads([lp], [ups["logprob"]], a))
    a = x()
    lpk = nemo_rl.ChunkedDistributedGatherLogprob.apply(a, torch.tensor(yk), 0, v, 5, None)
    out["gather"] = (cs.n(lpk), cs._grads([lpk], [ups["gather"]], a))
    a = x()
    nh = nemo_rl.ChunkedDistributedEntropy.apply(a, 3, None)
    out["neg_entropy"] = (cs.n(nh), cs._grads([nh], [ups["entropy"]], a))
    out["inference_only_requires_grad"] = nemo_rl.DistributedLogprob.apply(x(), torch.tensor(y), 0, v, None,
                                                                           True).requires_grad
    return out


def test_w2_gloo_against_the_oracle_and_errors_on_every_rank():
    z, y, yk, ups = _problem(2)
    ranks = run_ranks(cs.nemo_ranks, 2, z, y, yk, ups, timeout=300, env={"DUALVP_COMPILE": "0"})
    e = _expected(z, y, yk, ups)
    for r, out in enumerate(ranks):
        _check_rank(out, e, slice(r * 12, (r + 1) * 12))
    # rank 1's bad shard: every rank raises (none waits in a collective); rank 1 names the argument
    assert ranks[0]["bad_start"].startswith("RuntimeError") and "rank 1" in ranks[0]["bad_start"]
    assert "vocab_start_index" in ranks[1]["bad_start"]


def test_errors_name_the_argument(monkeypatch):
    monkeypatch.setenv("DUALVP_COMPILE", "0")
    z = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="vocab_start_index"):
        nemo_rl.DistributedLogprob.apply(z, torch.zeros(2, 3, dtype=torch.int64), 0, 4, None)
    with pytest.raises(TypeError, match="vocab_start_index"):
        nemo_rl.DistributedLogprob.apply(z, torch.zeros(2, 3, dtype=torch.int64), 0.0, 8, None)
    with pytest.raises(ValueError, match="target"):
        nemo_rl.DistributedLogprob.apply(z, torch.full((2, 3), 8), 0, 8, None)
    with pytest.raises(ValueError, match="global_indices"):
        nemo_rl.ChunkedDistributedGatherLogprob.apply(z, torch.full((2, 3, 2), 8), 0, 8, 2, None)
    with pytest.raises(ValueError, match="chunk_size"):
        nemo_rl.ChunkedDistributedEntropy.apply(z, 0, None)
    with pytest.raises(TypeError, match="tp_group"):
        nemo_rl.ChunkedDistributedEntropy.apply(z, 2, "tp")
    with pytest.raises(TypeError, match="inference_only"):
        nemo_rl.ChunkedDistributedEntropy.apply(z, 2, None, 1)
