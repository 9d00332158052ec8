"""The bench's ``slime`` implementation: located through ``--slime-path`` (or an
importable slime), loaded from the file alone, wired to the worker; a one-line
skip when there is none. slime itself is not needed: a stand-in
``slime/utils/ppo_utils.py`` with a plain (unfused, single-shard) formulation is
written into ``tmp_path``; the numbers are checked against ``dualvp.reference``.
"""

import argparse
import importlib.util
import os
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dualvp import reference  # noqa: E402
from dualvp.tools.bench import implementations as impls  # noqa: E402
from dualvp.tools.bench import results  # noqa: E402

from ._bench_cli import run_bench, worker_here  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# slime's interface: calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy, chunk_size,
# log_prob_keep_mask, with_entropy_grad) -> (log_prob [T, 1], entropy [T] or None). The first import
# stands for a heavy dependency of slime's module that this machine lacks.
_FAKE_PPO_UTILS = textwrap.dedent('''
    import dualvp_test_missing_heavy_dependency as _heavy
    import torch


    def calculate_log_probs_and_entropy(logits, tokens, tp_group, with_entropy=False, chunk_size=-1,
                                        log_prob_keep_mask=None, with_entropy_grad=True):
        assert tp_group is None, "the stand-in is single-shard"
        z = logits.float()
        lq = z
        if log_prob_keep_mask is not None:
            kept = log_prob_keep_mask.clone()
            kept[torch.arange(z.shape[0]), tokens] = True
            lq = z.masked_fill(~kept, float("-inf"))
        log_prob = torch.log_softmax(lq, -1).gather(-1, tokens[:, None])
        entropy = None
        if with_entropy:
            logp = torch.log_softmax(z if with_entropy_grad else z.detach(), -1)
            entropy = -(logp.exp() * logp).sum(-1)
        return log_prob, entropy
''')


@pytest.fixture
def slime_checkout(tmp_path):
    d = tmp_path / "slime-checkout" / "slime" / "utils"
    d.mkdir(parents=True)
    (d / "ppo_utils.py").write_text(_FAKE_PPO_UTILS)
    return tmp_path / "slime-checkout"


def _args(**kw):
    return argparse.Namespace(**{"slime_path": None, **kw})


def test_slime_path_is_located(slime_checkout):
    got = impls.locate(impls.IMPLS["slime"], _args(slime_path=str(slime_checkout)))
    assert got == {"slime_file": str(slime_checkout / "slime" / "utils" / "ppo_utils.py")}


def test_missing_slime_is_a_reason_not_an_error(tmp_path):
    why = impls.locate(impls.IMPLS["slime"], _args(slime_path=str(tmp_path)))
    assert isinstance(why, str) and why.startswith("--slime-path: no slime/utils/ppo_utils.py under")
    if importlib.util.find_spec("slime") is None:
        why = impls.locate(impls.IMPLS["slime"], _args())
        assert isinstance(why, str) and "--slime-path" in why


def test_slime_file_loads_alone_with_stand_ins_for_missing_imports(slime_checkout):
    path = str(slime_checkout / "slime" / "utils" / "ppo_utils.py")
    mod = impls.load_slime_ops(path)
    assert mod._dualvp_stand_ins == ["dualvp_test_missing_heavy_dependency"]
    assert "dualvp_test_missing_heavy_dependency" not in sys.modules  # not left behind
    assert "slime" not in sys.modules  # the package was never imported


@pytest.mark.parametrize("mode", ["lp+ent+grad", "lp+ent.keep"])
def test_slime_forward_against_the_oracle(slime_checkout, mode):
    path = str(slime_checkout / "slime" / "utils" / "ppo_utils.py")
    forward = impls.IMPLS["slime"].build(impls.Context(torch, options={"slime_file": path}))
    m = impls.MODES[mode]
    rng = np.random.default_rng(0)
    z = rng.normal(size=(6, 32)) * 3
    y = rng.integers(0, 32, size=6)
    keep = rng.random((6, 32)) < 0.3 if m.masked else None
    gl, gh = rng.normal(size=6), rng.normal(size=6)
    zt = torch.tensor(z, requires_grad=True)
    lp, h = forward(zt, torch.from_numpy(y), None if keep is None else torch.from_numpy(keep), m, validate=False)
    assert lp.shape == (6,) and h.shape == (6,)
    ((lp * torch.from_numpy(gl)).sum() + ((h * torch.from_numpy(gh)).sum() if m.entropy_grad else 0)).backward()
    rlp, rh = reference.logprob_entropy(z, y, keep_mask=keep)
    rg = reference.logprob_entropy_grad(z, y, gl, gh if m.entropy_grad else None, keep_mask=keep)
    np.testing.assert_allclose(lp.detach().numpy(), rlp, atol=1e-5)
    np.testing.assert_allclose(h.detach().numpy(), rh, atol=1e-5)
    np.testing.assert_allclose(zt.grad.numpy(), rg, atol=1e-5)


def _bench(tmp_path, capsys, monkeypatch, *extra):
    """``dualvp bench --quick`` at 8 x 64 in this process (tests/tools/_bench_cli.py)."""
    csv = tmp_path / "cpu.csv"
    stdout = run_bench(["--quick", "--sizes", "8x64", "--modes", "lp,lp+ent+grad.keep", "--worlds", "none",
                        "--results", str(csv), *extra], tmp_path, capsys, monkeypatch)
    return stdout, (results.read(str(csv)) if csv.exists() else [])


@pytest.mark.slow
def test_bench_runs_slime_from_slime_path(tmp_path, slime_checkout, capsys, monkeypatch):
    # --slime-path -> the worker's options (bench.options.plan: locate) -> the worker's loop, judged by the
    # bench's own oracle. The loop in this process (tests/tools/_bench_cli.py); a slime worker as a process,
    # from --slime-path on the command line: tests/tools/test_bench_quick.py::
    # test_per_impl_workers_make_inputs_in_the_background_and_a_failure_is_a_row.
    from dualvp.tools.bench import driver
    from dualvp.tools.bench.inputs import errors, make_inputs

    options = impls.locate(impls.IMPLS["slime"], _args(slime_path=str(slime_checkout)))
    ddir, odir = tmp_path / "data", tmp_path / "out"
    driver._save_inputs(str(ddir), make_inputs(8, 64, 0))
    odir.mkdir()
    modes = ["lp", "lp+ent+grad.keep"]
    case = dict(index=0, T=8, V=64, dtype="float32", data_dir=str(ddir), out_dir=str(odir))
    job = dict(impl="slime", cases=[case], modes=modes, reps=1, warmup=0, loop=1, err_rows=8, options=options,
               port=None, device="cpu")
    got = worker_here(job, capsys, monkeypatch)
    assert [(r["impl"], r["mode"]) for r in got] == [("slime", m) for m in modes]
    oracle = driver._saved_oracle(str(ddir), 8)
    for i, m in enumerate(modes):
        with np.load(odir / f"out_{i}_r0.npz") as o:
            e = errors(oracle, m, o["lp"], o["h"], o["g"])
        assert e["logprob"] < 1e-5 and e["grad"] < 1e-5, (m, e)
    assert e["entropy"] < 1e-5


@pytest.mark.slow
def test_bench_without_slime_skips_it_in_one_line(tmp_path, capsys, monkeypatch):
    # no worker starts: the one implementation named is skipped
    stdout, rows = _bench(tmp_path, capsys, monkeypatch, "--impls", "slime", "--slime-path", str(tmp_path / "nowhere"))
    lines = [ln for ln in stdout.splitlines() if "slime" in ln.replace(str(tmp_path), "")]
    assert len(lines) == 1 and lines[0].startswith("skipping slime: --slime-path: no slime/utils/ppo_utils.py")
    # named but unable to run: one row says why, with no figures
    assert [(r["impl"], r["wall_ms"]) for r in rows] == [("slime", "")]
    assert rows[0]["note"].startswith("skipped: --slime-path: no slime/utils/ppo_utils.py")


def test_liger_forward_is_the_log_prob(monkeypatch):
    # a stand-in for Liger's Triton cross-entropy (CUDA only): the harness negates its per-row loss
    import types

    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    fn = types.ModuleType("liger_kernel.transformers.functional")
    fn.liger_cross_entropy = lambda z, y, reduction: torch.nn.functional.cross_entropy(z, y, reduction=reduction)
    monkeypatch.setitem(sys.modules, fn.__name__, fn)
    impl = impls.IMPLS["liger"]
    assert impl.modes == ("lp",) and impl.nonleaf_logits and impl.default_devices == ("cuda",)
    forward = impl.build(impls.Context(torch))
    rng = np.random.default_rng(0)
    z, y = rng.normal(size=(5, 16)) * 3, rng.integers(0, 16, size=5)
    lp, h = forward(torch.tensor(z), torch.from_numpy(y), None, impls.MODES["lp"])
    assert h is None
    np.testing.assert_allclose(lp.numpy(), reference.logprob_entropy(z, y)[0], atol=1e-12)


def test_an_impl_this_dualvp_lacks_is_unavailable_not_a_failure(monkeypatch):
    with pytest.raises(impls.Unavailable, match="^impl='hugetlb': ValueError"):
        impls._dualvp_impl("hugetlb")(impls.Context(torch))
    impls.IMPLS["dualvp-torch-eager"].build(impls.Context(torch))  # one it has builds
    # the Triton kernels: logprob_entropy takes impl="triton" (the bench once asked the old
    # dualvp_torch.kernels.select, which did not, and skipped them on every device); on a CPU only interpreted
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    impls.IMPLS["dualvp-torch-triton"].build(impls.Context(torch))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(impls.Unavailable, match="TRITON_INTERPRET=1"):
        impls.IMPLS["dualvp-torch-triton"].build(impls.Context(torch))
