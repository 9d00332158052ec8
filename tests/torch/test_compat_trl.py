"""``dualvp_torch.compat.trl`` (TRL's ``selective_log_softmax`` / ``entropy_from_logits``) against float64.

TRL's semantics (``trl/trainer/utils.py``): ``index [...]`` or ``[..., K]``; output in the logits' dtype
(here rounded once from float32); no temperature, no ignore id. ``install()`` is tested on stand-in
``trl`` modules (TRL itself is not a dependency); scripts/peer_tests.py runs TRL's own tests.
"""

import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dualvp import reference  # noqa: E402
from dualvp_torch.compat import trl as dtrl  # noqa: E402

from ._compat_stacks import check, logits, n, oracle_k, t  # noqa: E402


@pytest.fixture(autouse=True)
def _eager(monkeypatch):
    monkeypatch.setenv("DUALVP_COMPILE", "0")  # the op's eager stages: no compile cost in this file


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "float16"])
def test_selective_log_softmax_values_dtype_and_grad(dtype):
    z = logits((3, 5, 37), dtype, seed=1)
    y = np.random.default_rng(2).integers(0, 37, size=(3, 5))
    g = np.random.default_rng(3).normal(size=(3, 5))
    x = t(z, dtype, grad=True)
    out = dtrl.selective_log_softmax(x, torch.tensor(y))
    assert out.dtype == x.dtype and out.shape == (3, 5)
    lp, _ = reference.logprob_entropy(z, y)
    check(out, lp, dtype, "logprob", out_dtype=dtype)
    out.backward(torch.tensor(g).to(out.dtype))
    g_used = n(torch.tensor(g).to(out.dtype))  # the upstream gradient as the op received it
    check(x.grad, reference.logprob_entropy_grad(z, y, g_used), dtype, "grad")
    f32 = dtrl.selective_log_softmax(x.detach(), torch.tensor(y), float32_output=True)
    assert f32.dtype == (torch.float64 if dtype == "float64" else torch.float32)
    check(f32, lp, dtype, "logprob")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", [1, 4])
def test_selective_log_softmax_k_ids_per_position(dtype, k):
    """``index [..., K]``: K log-probs per position; the gradient of sum_k g_k log p_k."""
    z = logits((2, 3, 29), dtype, seed=4)
    idx = np.random.default_rng(5).integers(0, 29, size=(2, 3, k))
    idx[0, 0] = idx[0, 0, 0]  # repeated ids in a row
    g = np.random.default_rng(6).normal(size=(2, 3, k))
    x = t(z, dtype, grad=True)
    out = dtrl.selective_log_softmax(x, torch.tensor(idx))
    assert out.shape == (2, 3, k) and out.dtype == x.dtype
    lp, grad = oracle_k(z, idx, n(torch.tensor(g).to(out.dtype)))
    check(out, lp, dtype, "logprob", out_dtype=dtype)
    out.backward(torch.tensor(g).to(out.dtype))
    check(x.grad, grad, dtype, "grad")


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(41,), (4, 41), (2, 3, 41)])
def test_entropy_from_logits(dtype, shape):
    z = logits(shape, dtype, seed=7)
    g = np.random.default_rng(8).normal(size=shape[:-1])
    x = t(z, dtype, grad=True)
    h = dtrl.entropy_from_logits(x, chunk_size=1)
    assert h.dtype == x.dtype and h.shape == shape[:-1]
    _, ent = reference.logprob_entropy(z, np.zeros(shape[:-1], dtype=np.int64))
    check(h, ent, dtype, "entropy", out_dtype=dtype)
    assert torch.equal(h, dtrl.entropy_from_logits(x, 128))  # chunk_size changes nothing
    h.backward(torch.tensor(g).to(h.dtype))
    ref_g = reference.logprob_entropy_grad(z, np.zeros(shape[:-1], dtype=np.int64), np.zeros(shape[:-1]),
                                           n(torch.tensor(g).to(h.dtype)))
    check(x.grad, ref_g, dtype, "grad")
    check(dtrl.entropy_from_logits(x.detach(), float32_output=True), ent, dtype, "entropy")


def test_errors_name_the_argument():
    z = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="index"):
        dtrl.selective_log_softmax(z, torch.full((2, 3), 8))
    with pytest.raises(ValueError, match="index"):  # no ignore id in TRL: -100 is out of range
        dtrl.selective_log_softmax(z, torch.full((2, 3), -100))
    with pytest.raises(ValueError, match="index"):
        dtrl.selective_log_softmax(z, torch.tensor([[[0, 9]] * 3] * 2))  # a bad id in column 1 of [..., K]
    with pytest.raises(ValueError, match="index"):
        dtrl.selective_log_softmax(z, torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="index"):
        dtrl.selective_log_softmax(z, [0, 1])
    with pytest.raises(TypeError, match="chunk_size"):
        dtrl.entropy_from_logits(z, chunk_size=2.5)
    with pytest.raises(TypeError, match="float32_output"):
        dtrl.entropy_from_logits(z, float32_output=1)


# --------------------------------------------------------------------------------- install / uninstall


def _original_sls(logits, index):
    return torch.gather(logits.log_softmax(-1), -1, index.unsqueeze(-1)).squeeze(-1)


def _original_efl(logits, chunk_size=128):
    lp = logits.log_softmax(-1)
    return -(lp.exp() * lp).sum(-1)


@pytest.fixture
def fake_trl(monkeypatch):
    """``trl``, ``trl.trainer.utils`` and two trainer modules that imported the names themselves."""
    mods = {name: types.ModuleType(name) for name in
            ("trl", "trl.trainer", "trl.trainer.utils", "trl.trainer.grpo_trainer", "trl.experimental.ppo")}
    mods["trl.trainer.utils"].selective_log_softmax = _original_sls
    mods["trl.trainer.utils"].entropy_from_logits = _original_efl
    mods["trl.trainer.grpo_trainer"].selective_log_softmax = _original_sls
    mods["trl.trainer.grpo_trainer"].entropy_from_logits = _original_efl
    mods["trl.experimental.ppo"].selective_log_softmax = _original_sls
    mods["trl.trainer"].utils = mods["trl.trainer.utils"]
    mods["trl"].trainer = mods["trl.trainer"]
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    yield mods
    dtrl.uninstall()


def test_install_rebinds_every_loaded_trl_module_and_uninstall_restores(fake_trl):
    inst = dtrl.install()
    assert inst.modules == ["trl.experimental.ppo", "trl.trainer.grpo_trainer", "trl.trainer.utils"]
    grpo = fake_trl["trl.trainer.grpo_trainer"]
    assert grpo.selective_log_softmax is dtrl.selective_log_softmax
    assert grpo.entropy_from_logits is dtrl.entropy_from_logits
    before = dict(dtrl.calls)
    z, y = torch.randn(2, 4, 11), torch.randint(0, 11, (2, 4))
    torch.testing.assert_close(grpo.selective_log_softmax(z, y), _original_sls(z, y), rtol=1e-5, atol=1e-5)
    grpo.entropy_from_logits(z)
    assert dtrl.calls["selective_log_softmax"] == before.get("selective_log_softmax", 0) + 1
    assert dtrl.calls["entropy_from_logits"] == before.get("entropy_from_logits", 0) + 1
    # a trainer module imported after install() takes the rebound name from trl.trainer.utils
    late = types.ModuleType("trl.trainer.rloo_trainer")
    late.selective_log_softmax = fake_trl["trl.trainer.utils"].selective_log_softmax
    sys.modules["trl.trainer.rloo_trainer"] = late
    try:
        assert late.selective_log_softmax is dtrl.selective_log_softmax
        restored = dtrl.uninstall()
        assert "trl.trainer.rloo_trainer" in restored and late.selective_log_softmax is _original_sls
    finally:
        del sys.modules["trl.trainer.rloo_trainer"]
    for name in ("trl.trainer.utils", "trl.trainer.grpo_trainer"):
        assert fake_trl[name].selective_log_softmax is _original_sls
        assert fake_trl[name].entropy_from_logits is _original_efl
    assert dtrl.uninstall() == []  # a no-op when not installed


def test_install_as_context_manager_and_float32_output(fake_trl):
    grpo = fake_trl["trl.trainer.grpo_trainer"]
    with dtrl.install(float32_output=True):
        out = grpo.selective_log_softmax(torch.randn(3, 9).bfloat16(), torch.tensor([0, 4, 8]))
        assert out.dtype == torch.float32
        assert grpo.entropy_from_logits(torch.randn(3, 9).bfloat16()).dtype == torch.float32
    assert grpo.selective_log_softmax is _original_sls
    with dtrl.install():
        with dtrl.install():  # re-installing is allowed and stays reversible
            assert grpo.selective_log_softmax is dtrl.selective_log_softmax
    assert grpo.selective_log_softmax is _original_sls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_newer_trl_arguments_temperature_row_mask_and_the_one_pass_function(dtype):
    """TRL >= 1.11: ``temperature``, ``row_mask`` and ``selective_log_softmax_and_entropy``."""
    z = logits((3, 4, 23), dtype, seed=9)
    y = np.random.default_rng(10).integers(0, 23, size=(3, 4))
    mask = np.ones((3, 4), dtype=bool)
    mask[2, 1:] = False
    y_masked = np.where(mask, y, 99)  # ids of masked positions are never read
    g = np.random.default_rng(11).normal(size=(3, 4)).astype(np.float32)
    tau = 0.6
    lp_ref, h_ref = reference.logprob_entropy(z, y, temperature=tau)
    x = t(z, dtype, grad=True)
    lp, h = dtrl.selective_log_softmax_and_entropy(x, torch.tensor(y_masked), True, tau, torch.tensor(mask))
    assert lp.dtype == h.dtype == x.dtype
    check(lp, np.where(mask, lp_ref, 0.0), dtype, "logprob", out_dtype=dtype)
    check(h, np.where(mask, h_ref, 0.0), dtype, "entropy", out_dtype=dtype)
    (lp.float() * torch.tensor(g)).sum().backward()
    gm = np.where(mask, n(torch.tensor(g).to(lp.dtype)), 0.0)
    check(x.grad, reference.logprob_entropy_grad(z, y, gm, temperature=tau), dtype, "grad")
    lp2 = dtrl.selective_log_softmax(x.detach(), torch.tensor(y_masked), tau, torch.tensor(mask), float32_output=True)
    check(lp2, np.where(mask, lp_ref, 0.0), dtype, "logprob")
    _, h3 = dtrl.selective_log_softmax_and_entropy(x, torch.tensor(y), entropy_requires_grad=False)
    assert not h3.requires_grad
