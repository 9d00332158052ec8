"""dualvp_torch.kl_divergence against the float64 oracle (dualvp.kl_reference).

Values and both gradients on the shared KL cases (banned ``-inf`` columns,
infinite rows, masked rows holding NaN, both directions, temperatures), in
float32 and bfloat16, at W = 1 (in process) and W = 2, 4, 8 (one gloo spawn
each, all cases in it); collectives counted per forward and backward; bad
inputs; torch.compile(fullgraph=True); the memory of the forward and backward;
batch invariance of a row's KL and gradient rows. Both engines (``impl``):
the eager one on the whole table in the fast tier, the compiled one on the
masked cases there (each compiled variant costs seconds to build) and on the
whole table, W = 1 and 2, in the slow tier.
"""

import numpy as np
import pytest
import torch

from dualvp.testing.kl import KL_CASES, KLCase, kl_failures, make_kl
from dualvp_torch import kl_divergence
from dualvp_torch import kl as kl_mod
from dualvp_torch.testing import run_ranks

from . import _kl_ranks
from ._alloc import allocations, peak

DTYPES = ("float32", "bfloat16")


def _triton_device() -> str:
    """Where ``impl="triton"`` runs here: ``"cpu"`` under TRITON_INTERPRET=1 (no GPU), else ``"cuda"``; else skip."""
    pytest.importorskip("triton")
    from dualvp_torch import triton_kernels

    if triton_kernels.interpreting():
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("impl='triton' needs a CUDA device or TRITON_INTERPRET=1")


def _run(p, *, need=(True, True), compiled=False, impl="eager"):
    dt = getattr(torch, p.case.dtype)
    dev = _triton_device() if impl == "triton" else "cpu"
    z = torch.tensor(p.logits, dtype=dt, device=dev, requires_grad=need[0])
    r = torch.tensor(p.ref_logits, dtype=dt, device=dev, requires_grad=need[1])
    m = None if p.row_mask is None else torch.tensor(p.row_mask, device=dev)
    c = p.case

    def f(z, r, m):
        return kl_divergence(z, r, row_mask=m, temperature=c.temperature, direction=c.direction, impl=impl)

    fn = torch.compile(f, fullgraph=True, backend="aot_eager") if compiled else f
    kl = fn(z, r, m)
    if any(need):
        (kl * torch.tensor(p.grad, dtype=kl.dtype, device=dev)).sum().backward()
    grad = lambda x: None if x.grad is None else x.grad.double().cpu().numpy()  # noqa: E731
    return kl.detach().double().cpu().numpy(), grad(z), grad(r)


@pytest.mark.parametrize("dtype", DTYPES + ("float64",))
def test_matches_oracle_w1(dtype):
    fails = []
    for case in KL_CASES:
        if dtype == "float64" and case.dtype != "float32":
            continue  # the bfloat16 cases' inputs, in float64, repeat float32 ones
        p = make_kl(case, dtype)
        fails += kl_failures(p, _run(p))
    assert not fails, "\n".join(fails)


#: Masked cases (banned -inf columns, rows outside row_mask holding NaN): the compiled engine's fast-tier table.
_MASKED = [c for c in KL_CASES if c.masked]


@pytest.mark.parametrize("impl, ts", [
    pytest.param("compiled", (7, 64, 1000), id="compiled", marks=pytest.mark.slow),
    pytest.param("eager", (7, 64, 1000), id="eager"),
    pytest.param("triton", (7,), id="triton-T7"),
    pytest.param("triton", (64,), marks=pytest.mark.slow, id="triton")])  # T = 7: triton-T7
def test_batch_invariant_rows(impl, ts):
    # a row's KL and both gradient rows are bitwise the same alone (T = 1) and inside calls of T = 7, 64, 1000
    # rows at random positions, and from run to run (eager chunks are chosen from V_local: 512 rows of 512
    # columns, so T = 1000 spans two chunks and a partial one; compiled kernels reduce each row in one order;
    # the Triton kernels run one program per row, blocks from V_local, so T = 1000 adds programs, not a
    # path (the interpreter runs them one by one: 1000 rows cost ~60 s of CPU); their fast-tier check: T = 7)
    dev = _triton_device() if impl == "triton" else "cpu"
    g = torch.Generator().manual_seed(0)
    V = 512
    for T in ts:
        z = torch.randn(T, V, generator=g).to(dev).requires_grad_()
        r = torch.randn(T, V, generator=g).to(dev).requires_grad_()
        m = (torch.rand(T, generator=g) < 0.9).to(dev)
        kl = kl_divergence(z, r, row_mask=m, temperature=0.8, impl=impl)
        (kl * torch.arange(1.0, T + 1, device=dev)).sum().backward()
        rows = torch.randperm(T, generator=g)[:3].tolist()
        for i in rows + [0, T - 1]:
            zi = z[i:i + 1].detach().clone().requires_grad_()
            ri = r[i:i + 1].detach().clone().requires_grad_()
            ki = kl_divergence(zi, ri, row_mask=m[i:i + 1], temperature=0.8, impl=impl)
            (ki * (i + 1.0)).sum().backward()
            assert torch.equal(ki[0], kl[i]) and torch.equal(zi.grad[0], z.grad[i]) \
                and torch.equal(ri.grad[0], r.grad[i]), (impl, T, i)
    again = kl_divergence(z.detach(), r.detach(), row_mask=m, temperature=0.8, impl=impl)
    assert torch.equal(again, kl.detach()), impl


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_compiled_matches_oracle_w1(dtype):
    # the compiled engine on the masked cases (the whole table: the slow test below)
    fails = []
    for case in _MASKED:
        p = make_kl(case, dtype)
        fails += kl_failures(p, _run(p, impl="compiled"), "compiled ")
    assert not fails, "\n".join(fails)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES + ("float64",))
def test_compiled_matches_oracle_w1_all_cases(dtype):
    fails = []
    for case in KL_CASES:
        if dtype == "float64" and case.dtype != "float32":
            continue
        if case.masked and dtype in DTYPES:  # the same run: test_compiled_matches_oracle_w1
            continue
        p = make_kl(case, dtype)
        fails += kl_failures(p, _run(p, impl="compiled"), "compiled ")
        # only one input needs a gradient: the other variants of the backward, in float32 (each is a graph
        # compiled anew per dtype, ~1 s; which gradients the graph forms does not depend on the dtype)
        if case.name == "basic" and dtype == "float32":
            for need in ((True, False), (False, True)):
                kl, dz, dr = _run(p, need=need, impl="compiled")
                fails += kl_failures(p, (kl, dz, dr), f"compiled need={need} ")
    assert not fails, "\n".join(fails)


@pytest.fixture(scope="module")
def w2_engines():
    """``{impl: per-rank run_cases}`` of the compiled and (under the interpreter) Triton engines at W = 2,
    from one spawn of the 2 ranks (a spawn costs a start-up of torch per rank). Both engines in float32: their
    bfloat16 graphs and kernels (each graph compiled anew, per rank; the kernels interpreted) are
    test_compiled_matches_oracle_w1_all_cases's and test_triton_matches_oracle_w1's on every case, and the
    cross-rank step does not depend on the dtype (the eager engine runs it in both at W = 2 and 4)."""
    try:
        interpreted = _triton_device() == "cpu"
    except pytest.skip.Exception:  # no triton: the compiled engine only
        interpreted = False
    impls = {"compiled": ("float32",), "triton": ("float32",)} if interpreted else {"compiled": ("float32",)}
    per_rank = run_ranks(_kl_ranks.run_engines, 2, impls, timeout=900)
    return {impl: [r[impl] for r in per_rank] for impl in impls}


@pytest.mark.slow
def test_compiled_matches_oracle_w2(w2_engines):
    per_rank = w2_engines["compiled"]
    fails = []
    for i, (name, dtype, kl, *_rest) in enumerate(per_rank[0]):
        p = make_kl(next(c for c in KL_CASES if c.name == name), dtype)
        np.testing.assert_array_equal(per_rank[1][i][2], kl)
        assert per_rank[0][i][5] == {"forward validate=False": 1, "forward validate=True": 2, "backward": 0}
        dz = np.concatenate([per_rank[r][i][3] for r in range(2)], axis=-1)
        dr = np.concatenate([per_rank[r][i][4] for r in range(2)], axis=-1)
        fails += kl_failures(p, (kl, dz, dr), "compiled W=2 ")
    assert not fails, "\n".join(fails)


def test_impl_none_follows_the_engine_selection(monkeypatch):
    # DUALVP_COMPILE=0 selects the eager engine, as for logprob_entropy; the results agree within TOLERANCES
    p = make_kl(_MASKED[0])
    monkeypatch.setenv("DUALVP_COMPILE", "0")
    assert kl_mod._engine(None, torch.device("cpu")) == "eager"
    assert not kl_failures(p, _run(p, impl=None))
    monkeypatch.delenv("DUALVP_COMPILE")
    assert kl_mod._engine(None, torch.device("cpu")) == "compiled"


def test_gradient_only_where_required():
    p = make_kl(KL_CASES[1])
    kl, dz, dr = _run(p, need=(True, False))
    assert dr is None and dz is not None
    assert not kl_failures(p, (kl, dz, None))
    kl, dz, dr = _run(p, need=(False, True))
    assert dz is None and dr is not None
    assert not kl_failures(p, (kl, None, dr))
    p = make_kl(KL_CASES[4])  # reverse: the gradients swap roles inside
    assert not kl_failures(p, _run(p, need=(False, True)))


# W = 8 (a whole shard banned): test_w8_fast_tier_smoke; the collective count does not depend on W
# (W = 4: slow; the fast tier's W > 2 run is the W = 8 smoke test)
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_matches_oracle_and_one_collective_per_forward(world):
    per_rank = run_ranks(_kl_ranks.run_cases, world, DTYPES, "eager", timeout=300)
    fails = []
    for i, (name, dtype, kl, *_rest) in enumerate(per_rank[0]):
        p = make_kl(next(c for c in KL_CASES if c.name == name), dtype)
        for rank in range(world):
            # every rank holds the same KL, bit for bit
            np.testing.assert_array_equal(per_rank[rank][i][2], kl)
            assert per_rank[rank][i][5] == {"forward validate=False": 1, "forward validate=True": 2, "backward": 0}
        dz = np.concatenate([per_rank[r][i][3] for r in range(world)], axis=-1)
        dr = np.concatenate([per_rank[r][i][4] for r in range(world)], axis=-1)
        fails += kl_failures(p, (kl, dz, dr), f"W={world} ")
    assert not fails, "\n".join(fails)


def test_w8_fast_tier_smoke():
    # W = 8: one case in float32 (a whole shard banned); the table at W = 2 and 4 is the test above
    p = make_kl(KL_CASES[3])  # a whole shard banned at W = 8
    assert not kl_failures(p, _w(p, 8))


def _w(p, world):
    per_rank = run_ranks(_kl_w_case, world, p, timeout=120)
    return per_rank[0][0], np.concatenate([x[1] for x in per_rank], -1), np.concatenate([x[2] for x in per_rank], -1)


def _kl_w_case(rank, world, p):
    z = torch.tensor(_kl_ranks._shard(p.logits, rank, world), dtype=torch.float32, requires_grad=True)
    r = torch.tensor(_kl_ranks._shard(p.ref_logits, rank, world), dtype=torch.float32, requires_grad=True)
    m = None if p.row_mask is None else torch.tensor(p.row_mask)
    kl = kl_divergence(z, r, group=torch.distributed.group.WORLD, row_mask=m, temperature=p.case.temperature,
                       direction=p.case.direction, impl="eager")
    (kl * torch.tensor(p.grad, dtype=kl.dtype)).sum().backward()
    return kl.detach().double().numpy(), z.grad.double().numpy(), r.grad.double().numpy()


def test_disagreeing_ranks_all_raise():
    seen = run_ranks(_kl_ranks.run_disagreements, 2, timeout=120)
    expect = {"row_mask differs": "row_mask", "direction differs": "direction",
              "temperature differs": "temperature", "bad ref on one rank": "ref_logits", "rows differ": "rows"}
    for name, word in expect.items():
        for rank in range(2):
            kind, msg = seen[rank][name]
            assert kind != "ok" and word in msg, (name, rank, kind, msg)


@pytest.mark.parametrize("impl", ["eager", pytest.param("compiled", marks=pytest.mark.slow)])
def test_compiled_fullgraph_equals_eager(impl):
    # inside a caller's torch.compile(fullgraph=True) the op is one node running the same engine, bit for bit
    p = make_kl(KL_CASES[5])  # batch dims, row mask, banned columns
    eager = _run(p, impl=impl)
    compiled = _run(p, compiled=True, impl=impl)
    for e, c in zip(eager, compiled):
        np.testing.assert_array_equal(c, e)


def _bad(**change):
    kw = dict(logits=torch.randn(3, 8), ref_logits=torch.randn(3, 8), row_mask=None, temperature=1.0,
              direction="forward", validate=True, group=None)
    kw.update(change)
    return kw


@pytest.mark.parametrize("change, name", [
    (dict(logits=np.zeros((3, 8))), "logits"),
    (dict(logits=torch.zeros(3, 8, dtype=torch.int32)), "logits"),
    (dict(logits=torch.zeros(())), "logits"),
    (dict(ref_logits=torch.zeros(3, 7)), "ref_logits"),
    (dict(ref_logits=[1.0]), "ref_logits"),
    (dict(ref_logits=torch.zeros(3, 8, dtype=torch.int64)), "ref_logits"),
    (dict(row_mask=torch.ones(3)), "row_mask"),
    (dict(row_mask=torch.ones(4, dtype=torch.bool)), "row_mask"),
    (dict(temperature=0.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=torch.tensor(1.0)), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(direction="both"), "direction"),
    (dict(direction=None), "direction"),
    (dict(group="tp"), "group"),
    (dict(validate=1), "validate"),
    (dict(impl="fast"), "impl"),
    (dict(impl=1), "impl"),
])
def test_bad_inputs_name_the_argument(change, name):
    kw = _bad(**change)
    with pytest.raises((TypeError, ValueError), match=f"^{name}:"):
        kl_divergence(kw.pop("logits"), kw.pop("ref_logits"), **kw)


def test_triton_engine_needs_cuda_or_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="^impl: 'triton' runs CUDA tensors"):
        kl_divergence(torch.randn(3, 8), torch.randn(3, 8), impl="triton")


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matches_oracle_w1(dtype):
    # the Triton kernels (under TRITON_INTERPRET=1 on the CPU) on the masked cases; the whole table: slow
    pytest.importorskip("triton")
    fails = []
    for case in _MASKED:
        p = make_kl(case, dtype)
        fails += kl_failures(p, _run(p, impl="triton"), "triton ")
    assert not fails, "\n".join(fails)


#: Rows wider than the Triton kernels' largest block (4096 columns): three blocks, the last one partial.
_WIDE = (KLCase("wide_banned_masked", rows=(4,), vocab=9000, banned="both", masked=True, temperature=0.7, seed=11),
         KLCase("wide_reverse_shard", rows=(3,), vocab=9000, banned="shard", direction="reverse", seed=12))


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])  # bfloat16 fast: above
def test_triton_matches_oracle_multi_block_rows(dtype):
    # the statistics kernel's loop over blocks (float64 accumulation across blocks) and the gradient kernel's
    # grid of column blocks, with banned columns, a banned half row, masked NaN rows, both directions
    pytest.importorskip("triton")
    assert kl_mod._block_v(9000) < 9000
    fails = []
    for case in _WIDE:
        p = make_kl(case, dtype)
        fails += kl_failures(p, _run(p, impl="triton"), "triton ")
    assert not fails, "\n".join(fails)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES + ("float64",))
def test_triton_matches_oracle_w1_all_cases(dtype):
    pytest.importorskip("triton")
    fails = []
    for case in KL_CASES:
        if dtype == "float64" and case.dtype != "float32":
            continue
        if case.masked and dtype in DTYPES:  # the same run: test_triton_matches_oracle_w1
            continue
        p = make_kl(case, dtype)
        fails += kl_failures(p, _run(p, impl="triton"), "triton ")
        if case.name == "basic":
            for need in ((True, False), (False, True)):
                fails += kl_failures(p, _run(p, need=need, impl="triton"), f"triton need={need} ")
    assert not fails, "\n".join(fails)


@pytest.mark.slow
def test_triton_matches_oracle_w2(w2_engines):
    # gloo ranks on CPU tensors: run where the interpreter is (no NCCL check of the Triton KL engine yet)
    if _triton_device() != "cpu":
        pytest.skip("the gloo ranks run CPU tensors: TRITON_INTERPRET=1 only")
    per_rank = w2_engines["triton"]
    fails = []
    for i, (name, dtype, kl, *_rest) in enumerate(per_rank[0]):
        p = make_kl(next(c for c in KL_CASES if c.name == name), dtype)
        np.testing.assert_array_equal(per_rank[1][i][2], kl)
        dz = np.concatenate([per_rank[r][i][3] for r in range(2)], axis=-1)
        dr = np.concatenate([per_rank[r][i][4] for r in range(2)], axis=-1)
        fails += kl_failures(p, (kl, dz, dr), "triton W=2 ")
    assert not fails, "\n".join(fails)


@pytest.mark.parametrize("impl, ref_grad", [
    ("eager", False), pytest.param("eager", True, marks=pytest.mark.slow),
    pytest.param("triton", False, marks=pytest.mark.slow), pytest.param("triton", True, marks=pytest.mark.slow),
    pytest.param("compiled", False, marks=pytest.mark.slow),
    pytest.param("compiled", True, marks=pytest.mark.slow)])
def test_memory_is_the_gradients_plus_bounded_scratch(ref_grad, impl, monkeypatch):
    # B = one shard's bytes; extra peak of forward + backward <= B per input needing a gradient + chunk scratch,
    # and the forward alone allocates no [T, V_local] buffer (its peak is the chunk scratch, not B).
    # Small chunks keep the scratch far below B at a size the profiler traces quickly.
    # The Triton engine (the interpreter's NumPy copies are not torch allocations) allocates the gradients only.
    monkeypatch.setattr(kl_mod, "CHUNK_ELEMENTS", 1 << 14)
    if impl == "triton" and _triton_device() != "cpu":
        pytest.skip("the CPU allocation trace: TRITON_INTERPRET=1 only")
    T, V = (32, 1024) if impl == "triton" else (128, 8192)
    z = torch.randn(T, V, requires_grad=True)
    r = torch.randn(T, V, requires_grad=ref_grad)
    B = z.numel() * 4
    # a dozen float32 chunk temporaries, O(T) statistics; Triton: the O(T) statistics alone
    scratch = 128 * T + 4096 if impl == "triton" else 12 * (1 << 14) * 4 + 64 * T

    def fwd():
        with torch.no_grad():
            kl_divergence(z, r, impl=impl)

    def step():
        kl_divergence(z, r, impl=impl).sum().backward()

    fwd(), step()  # warm up
    fwd_peak = peak(allocations(fwd))
    z.grad = r.grad = None  # freed before the trace: the step's peak counts its own buffers only
    step_peak = peak(allocations(step))
    assert fwd_peak <= scratch < B / 4, (fwd_peak, scratch, B)
    assert step_peak <= (2 if ref_grad else 1) * B + scratch, (step_peak, B)


@pytest.mark.parametrize("impl", ["eager", "compiled", "triton"])
def test_zero_rows(impl):
    # a shard with no rows (an empty micro-batch): empty KL and empty gradients of the inputs' shapes and dtypes
    dev = _triton_device() if impl == "triton" else "cpu"
    z = torch.randn(0, 3, 16, device=dev, requires_grad=True)
    r = torch.randn(0, 3, 16, device=dev, dtype=torch.bfloat16).requires_grad_()
    kl = kl_divergence(z, r, impl=impl)
    kl.sum().backward()
    assert kl.shape == (0, 3) and kl.dtype == torch.float32
    assert z.grad.shape == z.shape and z.grad.dtype == z.dtype and r.grad.shape == r.shape
    assert r.grad.dtype == torch.bfloat16
