"""``keep_ids`` (the kept set as global token ids) in dualvp_torch, against the float64 oracle.

The oracle turns the ids into a mask itself (``dualvp.reference.mask_from_ids``),
so each check is "keep_ids equals the keep mask built from the same ids".
Fast: a few cases on one process (eager, Triton under the interpreter, the
fused op's tile loop, the in-place gradient). Slow: the whole table
(:data:`dualvp.testing.cases.KEEP_IDS_CASES`) compiled, on Triton, on 2 and 4
gloo ranks, the fused op on 2 ranks, DTensor, and bad ids on one rank only;
at W = 2, 4 a few cases of both conformance tables with ids against the
mask built from the same ids on the eager and Triton engines (compiled: ids
on one case at W = 2).
"""

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dualvp_torch  # noqa: E402
from dualvp import reference, testing  # noqa: E402
from dualvp.testing import backends, cases  # noqa: E402

FAST = ("drop_target_ids", "everything_ids")
_ENV = {"DUALVP_COMPILE": "0"}


def _check(problem, out, what="", rounding_rule=False):
    # rounding_rule: the fused op's 16-bit dh / dW at its default gradient_rounding="fixed" by issue 45's rule
    bad = testing.failures(problem, {"torch": out}, rounding_rule=rounding_rule)
    assert not bad, (what, bad)


def _triton_ok():
    from dualvp_torch import triton_kernels

    return triton_kernels.available() and triton_kernels.interpreting()


@pytest.mark.parametrize("name", FAST)
def test_eager_fast(name):
    p = cases.make(cases.case(name))
    _check(p, backends.run("torch", p, 1, impl="eager"))


def test_triton_fast():
    if not _triton_ok():
        pytest.skip("triton with TRITON_INTERPRET=1 needed")
    # 384 columns: under the interpreter a row spans several column splits (stats [S, T, 6]: 2 splits, 3 blocks)
    p = cases.make(cases.case("everything_ids", vocab=384, worlds=(1, 2)))
    _check(p, backends.run("torch", p, 1, impl="triton"))


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["compiled", "triton"])  # eager: on the gloo ranks below
def test_whole_table_one_process(impl):
    if impl == "triton" and not _triton_ok():
        pytest.skip("triton with TRITON_INTERPRET=1 needed")
    for c in cases.KEEP_IDS_CASES:
        p = cases.make(c)
        _check(p, backends.run("torch", p, 1, impl=impl), c.name)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_whole_table_on_gloo_ranks(world):
    probs = [cases.make(c) for c in cases.KEEP_IDS_CASES if world in c.worlds]
    outs = backends.run_all("torch", probs, world, impl="eager", env=_ENV, timeout=400)
    for p, out in zip(probs, outs):
        _check(p, out, (p.case.name, world))


def test_ids_equal_the_backends_own_mask_result():
    """The op with ids and the op with the mask built from them agree within TOLERANCES."""
    c = cases.case("random_mask_temp_ids")
    p = cases.make(c)
    with_ids = backends.run("torch", p, 1, impl="eager")
    mask = reference.mask_from_ids(p.keep_ids, c.vocab)
    masked = cases.Problem(cases.case("random_mask_temp"), p.logits, p.target, mask, p.grad_logprob, p.grad_entropy)
    with_mask = backends.run("torch", masked, 1, impl="eager")
    for q in ("logprob", "entropy", "grad"):
        assert testing.within_tolerance(getattr(with_ids, q), getattr(with_mask, q), testing.tolerance(c.dtype, q)), q


def _tensors(p, dtype=None):
    dt = getattr(torch, dtype or p.case.dtype)
    z = torch.from_numpy(p.logits).to(dt)
    return z, torch.from_numpy(p.target), torch.from_numpy(p.keep_ids)


@pytest.mark.parametrize("impl", ["eager", "triton"])
def test_inplace_gradient_and_int32_ids(impl):
    """inplace_grad=True: the kept logits are read before the gradient overwrites them; int32 ids work too."""
    if impl == "triton" and not _triton_ok():
        pytest.skip("triton with TRITON_INTERPRET=1 needed")
    p = cases.make(cases.case("nucleus_ids"))
    z0, y, ids = _tensors(p)
    x = z0.clone().requires_grad_(True)
    z = x * 1.0  # a non-leaf: the op may overwrite it
    lp, h = dualvp_torch.logprob_entropy(z, y, keep_ids=ids.to(torch.int32), inplace_grad=True, impl=impl)
    torch.autograd.backward([lp, h], [torch.from_numpy(p.grad_logprob).float(),
                                      torch.from_numpy(p.grad_entropy).float()])
    _check(p, testing.Outputs(lp.detach().double().numpy(), h.detach().double().numpy(), x.grad.double().numpy()))


@pytest.mark.parametrize("with_entropy,entropy_grad", [(False, False), (True, False)])
def test_modes_without_the_entropy_gradient(with_entropy, entropy_grad):
    p = cases.make(cases.case("everything_ids"))
    c = p.case
    z0, y, ids = _tensors(p)
    z = z0.clone().requires_grad_(True)
    lp, h = dualvp_torch.logprob_entropy(z, y, keep_ids=ids, temperature=c.temperature, ignore_index=c.ignore_index,
                                         with_entropy=with_entropy, entropy_grad=entropy_grad, impl="eager")
    (lp * torch.from_numpy(p.grad_logprob).float()).sum().backward()
    want = testing.oracle(p, entropy_grad=False)
    assert testing.within_tolerance(z.grad.double().numpy(), want.grad, testing.tolerance("float32", "grad"))
    assert (h is None) == (not with_entropy)


def test_unvalidated_out_of_range_ids_are_ignored():
    p = cases.make(cases.case("drop_target_ids"))
    v = p.case.vocab
    z, y, ids = _tensors(p)
    extra = torch.tensor([[v, -7, 10 * v]] * ids.shape[0])
    lp, _ = dualvp_torch.logprob_entropy(z, y, keep_ids=torch.cat([ids, extra], -1), validate=False, impl="eager")
    want, _ = reference.logprob_entropy(p.logits, p.target, keep_ids=p.keep_ids)
    assert torch.isfinite(lp).all()
    assert testing.within_tolerance(lp.double().numpy(), want, testing.tolerance("float32", "logprob"))
    with pytest.raises(ValueError, match=r"keep_ids: expected ids in \[0, 64\)"):
        dualvp_torch.logprob_entropy(z, y, keep_ids=torch.cat([ids, extra], -1), impl="eager")


def test_empty_k_keeps_only_the_target():
    p = cases.make(cases.case("nucleus"))
    z = torch.from_numpy(p.logits).float()
    lp, _ = dualvp_torch.logprob_entropy(z, torch.from_numpy(p.target), keep_ids=torch.zeros((6, 0), dtype=torch.long),
                                         impl="eager")
    assert torch.equal(lp, torch.zeros_like(lp))


def _fused(p, impl, budget=None, group=None, rank=0, world=1):
    c = p.case
    dt = getattr(torch, c.dtype)
    ws, _ = p.shard(rank, world)
    h = torch.from_numpy(p.hidden).to(dt).requires_grad_(True)
    w = torch.from_numpy(np.ascontiguousarray(ws)).to(dt).requires_grad_(True)
    lp, en = dualvp_torch.linear_logprob_entropy(
        h, w, torch.from_numpy(p.target), keep_ids=torch.from_numpy(p.keep_ids), temperature=c.temperature,
        ignore_index=c.ignore_index, impl=impl, memory_budget=budget, group=group)
    gl, ge = (torch.from_numpy(x).to(lp.dtype) for x in (p.grad_logprob, p.grad_entropy))
    torch.autograd.backward([lp, en], [gl, ge])
    return testing.LinearOutputs(*(x.detach().double().numpy() for x in (lp, en, h.grad, w.grad)))


@pytest.mark.parametrize("impl", ["eager", pytest.param("compiled", marks=pytest.mark.slow)])
def test_fused_op_small_tiles_fast(impl):
    """The fused op's tile loop with tiles smaller than the shard (several token and vocab tiles)."""
    p = cases.make_linear(cases.case("drop_target_ids", lead=(7,)), 16)
    _check(p, _fused(p, impl, budget=600))


# drop_target_ids slow: everything_ids (fast) holds its drop_target mask too
@pytest.mark.parametrize("name", ["nucleus_ids", pytest.param("drop_target_ids", marks=pytest.mark.slow),
                                  "everything_ids"])
def test_fused_triton_kernels_keep_ids(name):
    # the kernels unmasked, the kept pair from the kept columns' logits, their gradient values written
    # into each stored G chunk (budget 600: G chunks of 32 columns, several per shard)
    if not _triton_ok():
        pytest.skip("needs triton under TRITON_INTERPRET=1")
    p = cases.make_linear(cases.case(name), 8)
    _check(p, _fused(p, "triton", budget=600 if name == "nucleus_ids" else None), name)


# the option "split" slow (it stays fast without ids: test_linear_triton.py::test_vs_oracle)
@pytest.mark.parametrize("rounding", ["default", pytest.param("split", marks=pytest.mark.slow)])
def test_fused_triton_fixed_gradient_keep_ids(rounding):
    # the default G rounding ("fixed") with keep_ids: the kept values written over G rounded once, their
    # residuals added back as rank-1 terms at every kept column (bfloat16: G rounded once alone fails this
    # case), judged by issue 45's rule and, on this case, element-wise too; the option "split" element-wise
    if not _triton_ok():
        pytest.skip("needs triton under TRITON_INTERPRET=1")
    from dualvp_torch import tuning

    p = cases.make_linear(cases.case("confident_lm_bf16_ids"), 8)
    if rounding == "split":
        with tuning.using(tuning.Tuning(gradient_rounding="split")):
            _check(p, _fused(p, "triton"))
        return
    assert tuning.current().gradient_rounding == "fixed"
    out = _fused(p, "triton")
    _check(p, out, "fixed, issue 45's rule", rounding_rule=True)
    _check(p, out, "fixed, element-wise")


def test_fused_triton_atomic_backward_refuses_keep_ids():
    if not _triton_ok():
        pytest.skip("needs triton under TRITON_INTERPRET=1")
    from dualvp_torch import tuning

    p = cases.make_linear(cases.case("nucleus_ids"), 8)
    with tuning.using(tuning.Tuning(triton_linear_backward="atomic")):
        with pytest.raises(NotImplementedError, match="keep_ids"):
            _fused(p, "triton")


@pytest.mark.slow
def test_fused_op_whole_table_one_process():
    for c in cases.KEEP_IDS_CASES:
        p = cases.make_linear(c, 16)
        for budget in (None, 700):
            _check(p, _fused(p, "eager", budget=budget), (c.name, budget))


# --- gloo ranks: the fused op, DTensor, bad ids on one rank -------------------------------


def _rank_work(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out = {}
    group = dist.group.WORLD
    p = cases.make_linear(cases.case("everything_ids"), 16)
    lin = _fused(p, "eager", budget=900, group=group, rank=rank, world=world)
    out["fused"] = (lin, rank)
    # DTensor logits (vocab Shard(-1)), ids a replicated DTensor and a plain tensor
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    q = cases.make(cases.case("nucleus_ids"))
    dts = []
    for as_dtensor in (True, False):
        z = distribute_tensor(torch.from_numpy(q.logits).float(), mesh, [Shard(-1)]).requires_grad_(True)
        y = distribute_tensor(torch.from_numpy(q.target), mesh, [Replicate()])
        ids = torch.from_numpy(q.keep_ids)
        ids = distribute_tensor(ids, mesh, [Replicate()]) if as_dtensor else ids
        lp, h = dualvp_torch.logprob_entropy(z, y, keep_ids=ids, impl="eager")
        (lp.to_local() * torch.from_numpy(q.grad_logprob).float()).sum().backward()
        dts.append((lp.full_tensor().detach().double().numpy(), z.grad.full_tensor().double().numpy()))
    out["dtensor"] = dts
    # bad ids on rank 0 only: every rank raises instead of waiting in a collective
    zs = torch.from_numpy(q.shard(rank, world)[0]).float()
    ids = torch.from_numpy(q.keep_ids).clone()
    if rank == 0:
        ids[0, 0] = 10 ** 6
    try:
        dualvp_torch.logprob_entropy(zs, torch.from_numpy(q.target), keep_ids=ids, group=group, impl="eager")
        out["bad"] = None
    except (ValueError, RuntimeError) as exc:
        out["bad"] = (type(exc).__name__, str(exc))
    return out


@functools.lru_cache(maxsize=None)
def _ranks(world):
    from dualvp_torch.testing import run_ranks

    return run_ranks(_rank_work, world, timeout=300, env=_ENV)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_fused_dtensor_and_bad_ids_on_ranks(world):
    res = _ranks(world)
    p = cases.make_linear(cases.case("everything_ids"), 16)
    first = res[0]["fused"][0]
    merged = first._replace(dW=np.concatenate([r["fused"][0].dW for r in res], axis=0))
    bad = testing.failures(p, {"torch": merged})
    assert not bad, bad
    q = cases.make(cases.case("nucleus_ids"))
    want = testing.oracle(q, entropy_grad=False)
    for r in res:
        for lp, g in r["dtensor"]:
            assert testing.within_tolerance(lp, want.logprob, testing.tolerance("float32", "logprob"))
            assert testing.within_tolerance(g, want.grad, testing.tolerance("float32", "grad"))
    seen = [r["bad"] for r in res]
    assert all(s is not None for s in seen), seen
    assert "keep_ids" in seen[0][1], seen
    assert all("keep_ids" in s[1] or "validation failed" in s[1] for s in seen), seen


# --- memory: no [T, V_local] buffer but the gradient ---------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("impl,dtype", [("compiled", torch.bfloat16)])
def test_peak_memory_has_no_mask_sized_buffer(impl, dtype):
    """T = 2048, V_local = 32000, K = 64: forward + backward allocate one B-sized buffer (the gradient).

    The ids' own scratch is O(T K); a float32 copy for a 16-bit scatter (torch's
    CPU scatter of bfloat16 makes one: spec.set_at_columns goes through int16)
    or a [T, V_local] mask would show as another allocation of >= B / 4.
    """
    from dualvp_torch import tuning

    from ._alloc import allocations, peak

    T, V, K = 2048, 32000, 64
    g = torch.Generator().manual_seed(0)
    leaf = torch.randn(T, V, generator=g).to(dtype).requires_grad_(True)
    y = torch.randint(0, V, (T,), generator=g)
    ids = torch.randint(0, V, (T, K), generator=g)
    B = leaf.numel() * leaf.element_size()

    def step():
        lp, h = dualvp_torch.logprob_entropy(leaf, y, keep_ids=ids, impl=impl, temperature=0.7)
        (lp.sum() + h.sum()).backward()

    with tuning.using(tuning.Tuning(max_eager_workers=1)):
        step()  # warm-up (compilation)
        leaf.grad = None
        sizes = allocations(step)
    big = [s for s in sizes if s >= B // 4]
    assert big == [B], [s / B for s in big]
    assert peak(sizes) <= 1.1 * B, peak(sizes) / B


def test_no_rows():
    z = torch.zeros(0, 8, requires_grad=True)
    lp, h = dualvp_torch.logprob_entropy(z, torch.zeros(0, dtype=torch.long), keep_ids=torch.zeros(0, 3,
                                         dtype=torch.long), impl="eager")
    (lp.sum() + h.sum()).backward()
    assert lp.shape == (0,) and z.grad.shape == (0, 8)


@pytest.mark.slow
def test_inside_a_callers_fullgraph_compile():
    """keep_ids through the custom op: one node of a caller's ``torch.compile(fullgraph=True)`` graph."""
    p = cases.make(cases.case("everything_ids"))
    c = p.case
    z0, y, ids = _tensors(p)
    gl, ge = (torch.from_numpy(x).float() for x in (p.grad_logprob, p.grad_entropy))

    def loss(z):
        lp, h = dualvp_torch.logprob_entropy(z, y, keep_ids=ids, temperature=c.temperature,
                                             ignore_index=c.ignore_index, impl="eager")
        return (lp * gl).sum() + (h * ge).sum()

    z = z0.clone().requires_grad_(True)
    torch.compile(loss, fullgraph=True)(z).backward()
    want = testing.oracle(p)
    assert testing.within_tolerance(z.grad.double().numpy(), want.grad, testing.tolerance("float32", "grad"))


@pytest.mark.parametrize("impl", ["eager", pytest.param("compiled", marks=pytest.mark.slow)])
def test_batch_invariance(impl):
    """A row's log-prob and gradient row with keep_ids: bitwise the same alone, in 7 rows and in 257."""
    from dualvp_torch import tuning

    g = torch.Generator().manual_seed(0)
    T, V, K = 257, 300, 8
    z = torch.randn(T, V, generator=g) * 3
    y, ids = torch.randint(0, V, (T,), generator=g), torch.randint(-1, V, (T, K), generator=g)

    def run(rows):
        x = z[rows].clone().requires_grad_(True)
        lp, h = dualvp_torch.logprob_entropy(x, y[rows], keep_ids=ids[rows], impl=impl)
        (lp.sum() + h.sum()).backward()
        return lp.detach(), x.grad

    with tuning.using(tuning.Tuning(max_eager_workers=1)):  # (eager: invariant in the calling thread)
        lp_all, g_all = run(slice(0, T))
        for i, rows in ((0, slice(0, 1)), (256, slice(256, 257)), (256, slice(250, 257))):
            lp, gr = run(rows)
            j = i - rows.start
            assert torch.equal(lp[j], lp_all[i]) and torch.equal(gr[j], g_all[i]), (i, rows)


# --- keep_ids with the extended options (K targets, a temperature tensor, sum p^2) ---------------------------

_EXT_IDS = ("k_masked", "row_tau_masked", "p2_masked", "all_drop_target", "all_nucleus", "all_all_but_target",
            "all_ignored_masked", "all_neg_inf_masked", "all_everything", "all_bfloat16")
_EXT_IDS_FAST = ("all_drop_target", "all_everything", "all_neg_inf_masked")


def _ext_ids_params(impls_fast):
    from dualvp.testing import extended as ext

    return [pytest.param(ext.ext_case(n), impl,
                         marks=() if (n in _EXT_IDS_FAST and impl in impls_fast) else pytest.mark.slow,
                         id=f"{n}-{impl}")
            for impl in ("eager", "triton", "compiled") for n in _EXT_IDS]


@pytest.mark.parametrize("case,impl", _ext_ids_params(("eager", "triton")))
def test_extended_options_with_ids(case, impl):
    """K targets, a temperature tensor and sum p^2 with the kept set as ids (repeated, padded): the float64
    oracle of the mask built from the same ids (each target kept for its own log-prob)."""
    from dualvp.testing import extended as ext

    from . import _ext_ranks

    if impl == "triton" and not _triton_ok():
        pytest.skip("triton with TRITON_INTERPRET=1 needed")
    prob = ext.make_ext(case)
    with_ids = _ext_ranks.run_case(prob, 0, 1, None, impl, ids=True)
    out = ext.ExtOutputs(with_ids["logprob"], with_ids["entropy"], with_ids["grad"], with_ids["sum_p2"])
    assert not ext.ext_failures(prob, out), (case.name, impl, ext.ext_failures(prob, out))


# Triton slow (its rows over several column splits with ids stay fast in test_triton_fast)
@pytest.mark.parametrize("impl", ["eager", pytest.param("triton", marks=pytest.mark.slow)])
def test_extended_ids_inplace_and_wide(impl):
    """A row over several column splits (Triton: V = 768 under the interpreter), the in-place gradient."""
    import dataclasses

    from dualvp.testing import extended as ext

    from . import _ext_ranks

    if impl == "triton" and not _triton_ok():
        pytest.skip("triton with TRITON_INTERPRET=1 needed")
    case = dataclasses.replace(ext.ext_case("all_everything"), base=cases.case("everything", vocab=768, worlds=(1, 2)))
    prob = ext.make_ext(case)
    o = _ext_ranks.run_case(prob, 0, 1, None, impl, ids=True, inplace=True)
    out = ext.ExtOutputs(o["logprob"], o["entropy"], o["grad"], o["sum_p2"])
    assert not ext.ext_failures(prob, out)


@pytest.mark.slow  # gloo ranks spawned
@pytest.mark.parametrize("impl", ["eager", "triton"])
def test_extended_ids_on_two_gloo_ranks(impl):
    from dualvp.testing import extended as ext
    from dualvp_torch.testing import run_ranks

    from . import _ext_ranks

    if impl == "triton" and not _triton_ok():
        pytest.skip("triton with TRITON_INTERPRET=1 needed")
    probs = [ext.make_ext(ext.ext_case(n)) for n in _EXT_IDS]
    res = run_ranks(_ext_ranks.rank_cases, 2, probs, impl, True, timeout=600, env=_ENV)
    for i, prob in enumerate(probs):
        outs = [r[i] for r in res]
        out = ext.ExtOutputs(outs[0]["logprob"], outs[0]["entropy"],
                             np.concatenate([o["grad"] for o in outs], axis=-1), outs[0]["sum_p2"])
        assert not ext.ext_failures(prob, out), (prob.case.name, ext.ext_failures(prob, out))


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["eager", "compiled"])
def test_extended_ids_peak_memory_has_no_mask_sized_buffer(impl):
    """K = 4 targets, a temperature per row and sum p^2 with ids: V_local = 32000, 64 ids per row;
    forward + backward allocate one B-sized buffer (the gradient), nothing of the mask's size (B / 2 in bf16).

    The eager engine runs at T = 512 (its chunks are bounded by ``cpu_chunk_scratch_bytes``, set to 4 MiB
    here, under the B / 4 = 7.8 MiB threshold; what it allocates per row does not depend on T): T = 2048
    cost ~80 s of single-threaded CPU for the same check. The compiled engine keeps the goal's T = 2048."""
    from dualvp_torch import tuning

    from ._alloc import allocations, peak

    T, V, K = (2048 if impl == "compiled" else 512), 32000, 64
    g = torch.Generator().manual_seed(0)
    leaf = torch.randn(T, V, generator=g).to(torch.bfloat16).requires_grad_(True)
    y = torch.randint(0, V, (T, 4), generator=g)
    ids = torch.randint(0, V, (T, K), generator=g)
    tau = torch.rand(T, generator=g) + 0.5
    B = leaf.numel() * leaf.element_size()

    def step():
        lp, h, p2 = dualvp_torch.logprob_entropy(leaf, y, keep_ids=ids, impl=impl, temperature=tau,
                                                 multi_target=True, with_sum_p2=True)
        (lp.sum() + h.sum() + p2.sum()).backward()

    with tuning.using(tuning.Tuning(max_eager_workers=1, cpu_chunk_scratch_bytes=4 << 20)):
        step()  # warm-up (compilation)
        leaf.grad = None
        sizes = allocations(step)
    big = [s for s in sizes if s >= B // 4]
    assert big == [B], [s / B for s in big]
    assert peak(sizes) <= 1.1 * B, peak(sizes) / B


# Triton and compiled slow (the extended op's batch invariance on Triton stays fast without ids:
# test_triton_logits.py::test_extended_batch_invariance_bitwise)
@pytest.mark.parametrize("impl", ["eager", pytest.param("triton", marks=pytest.mark.slow),
                                  pytest.param("compiled", marks=pytest.mark.slow)])
def test_extended_ids_batch_invariance(impl):
    """K = 3 targets, a temperature per row, sum p^2 and keep_ids: a row alone, in 7 rows, bitwise the same."""
    from dualvp_torch import tuning

    if impl == "triton" and not _triton_ok():
        pytest.skip("triton with TRITON_INTERPRET=1 needed")
    g = torch.Generator().manual_seed(1)
    T, V, K = 7, 300, 8
    z = torch.randn(T, V, generator=g) * 3
    y, ids = torch.randint(0, V, (T, 3), generator=g), torch.randint(-1, V, (T, K), generator=g)
    y[1, 2] = ids[1, 0].clamp(min=0)  # a listed target beside dropped ones
    tau = torch.rand(T, generator=g) + 0.5

    def run(rows):
        x = z[rows].clone().requires_grad_(True)
        lp, h, p2 = dualvp_torch.logprob_entropy(x, y[rows], keep_ids=ids[rows], temperature=tau[rows],
                                                 multi_target=True, with_sum_p2=True, impl=impl)
        (lp.sum() + h.sum() + 0.5 * p2.sum()).backward()
        return lp.detach(), h.detach(), p2.detach(), x.grad

    with tuning.using(tuning.Tuning(max_eager_workers=1)):
        full = run(slice(0, T))
        for i in (0, 1, T - 1):
            one = run(slice(i, i + 1))
            assert all(torch.equal(a[0], b[i]) for a, b in zip(one, full)), i


def test_keep_ids_with_an_extended_option_raises_in_jax_only():
    # torch takes them together (above); the shared checks refuse the pair unless the backend says it takes it
    from dualvp import validation

    kw = dict(logits_shape=(4, 8), logits_dtype="float32", target_shape=(4, 2), target_dtype="int64",
              ids_shape=(4, 3), ids_dtype="int64", multi_target=True)
    with pytest.raises(NotImplementedError, match="keep_ids.*multi_target"):
        validation.check_args(**kw)
    assert validation.check_args(**kw, ids_with_extended=True).has_ids


# --- keep_ids against keep_mask built from the same ids, W gloo ranks, every engine ------------------------

# A few masked cases of the conformance tables per world (the base op's and the extended op's), the compiled
# engine on the first only, with ids (its compiles dominate the cost); the whole base table runs on eager at
# W = 2, 4 above and on every engine at W = 1.
# W = 2 and 4 (a rank layout beyond two ranks; W = 8 spawned 8 ranks for the same shard path): the cases
# spread over both spawns
_IDS_VS_MASK = {2: ("all_everything", "drop_target", "all_confident_lm_bf16", "all_drop_target", "p2_masked"),
                4: ("everything", "all_neg_inf_masked", "row_tau_masked", "neg_inf_masked", "confident_lm_bf16")}


def _ids_against_mask(rank, world, jobs, compiled_job):
    """:func:`_ext_ranks.ids_against_mask` of ``jobs``; ``"compiled"``: this rank's compiled run of
    ``compiled_job`` (a problem) with the kept set as ids only. With ids every engine runs unmasked and the
    kept set's part is the same torch code beside it (dualvp_torch.keep_ids): the compiled run with the mask
    too (it ran here before) compiled a second variant of forward + backward on each rank, the masked compiled
    engine that the in-process tests pin."""
    import torch.distributed as dist

    from dualvp_torch import compiled

    from . import _ext_ranks

    out = _ext_ranks.ids_against_mask(rank, world, jobs)
    if compiled_job is not None:
        ids, masked = _ext_ranks.mask_of_ids(compiled_job)
        out["compiled"] = _ext_ranks.run_case(masked, rank, world, dist.group.WORLD, "compiled", ids=True,
                                              id_array=ids)
    out["compile_failed"] = compiled.failed()
    return out


def _ids_case(name):
    from dualvp.testing import extended as ext

    try:
        return ext.ext_case(name)
    except KeyError:  # a base case: the extended op's arrays with none of its options
        return ext.ExtCase(name, cases.case(name))


def _joined(outs):
    """One rank-independent output from each rank's: the row outputs the same on every rank, the grad joined."""
    from dualvp.testing import extended as ext

    for o in outs[1:]:
        for q in ("logprob", "entropy", "sum_p2"):
            assert (o[q] is None) == (outs[0][q] is None), q
            assert o[q] is None or np.array_equal(o[q], outs[0][q], equal_nan=True), q
    return ext.ExtOutputs(outs[0]["logprob"], outs[0]["entropy"], np.concatenate([o["grad"] for o in outs], -1),
                          outs[0]["sum_p2"])


@pytest.mark.slow  # W gloo ranks spawned, compiles on each at W = 2
@pytest.mark.parametrize("world", sorted(_IDS_VS_MASK))
def test_ids_equal_the_mask_of_the_same_ids_on_gloo_ranks(world):
    """keep_ids [..., K] (repeated ids, -1 padding, the same on every rank) and the keep mask built from those ids
    by the oracle's loop (each rank its shard): the same results within TOLERANCES on the eager and Triton
    (interpreter) engines, and both within TOLERANCES of the float64 oracle; the compiled engine with ids (one
    case, W = 2) within TOLERANCES of the eager engine with the mask and of the oracle."""
    from dualvp.testing import extended as ext
    from dualvp_torch.testing import run_ranks

    from . import _ext_ranks

    impls = ("eager", "triton") if _triton_ok() else ("eager",)
    jobs = [(ext.make_ext(_ids_case(n)), impls) for n in _IDS_VS_MASK[world]]
    assert all(world in p.case.worlds and p.keep_mask is not None for p, _ in jobs)
    # compiled: the first case at W = 2, with ids (the engine's ids path does not depend on W;
    # test_whole_table_one_process runs it on every keep_ids case at W = 1), against the eager run with the mask
    compiled_job = jobs[0][0] if world == 2 else None
    res = run_ranks(_ids_against_mask, world, jobs, compiled_job, timeout=900)
    assert not any(r["compile_failed"] for r in res), "a compiled stage fell back to eager"
    if compiled_job is not None:
        _, masked = _ext_ranks.mask_of_ids(compiled_job)
        with_ids = _joined([r["compiled"] for r in res])
        with_mask = _joined([r["outputs"][0][0][2] for r in res])  # the eager engine's, with the mask
        assert all(r["outputs"][0][0][0] == "eager" for r in res)
        for q, quantity in (("logprob", "logprob"), ("entropy", "entropy"), ("grad", "grad"), ("sum_p2", "entropy")):
            a, b = getattr(with_ids, q), getattr(with_mask, q)
            assert (a is None) == (b is None), ("compiled", q)
            assert a is None or testing.within_tolerance(a, b, testing.tolerance(masked.case.dtype, quantity)), q
        assert not ext.ext_failures(masked, with_ids), ("compiled", ext.ext_failures(masked, with_ids))
    for j, (prob, impls_j) in enumerate(jobs):
        _, masked = _ext_ranks.mask_of_ids(prob)
        dtype = prob.case.dtype
        for i, impl in enumerate(impls_j):
            what = (prob.case.name, world, impl)
            assert all(r["outputs"][j][i][0] == impl for r in res), what
            with_ids = _joined([r["outputs"][j][i][1] for r in res])
            with_mask = _joined([r["outputs"][j][i][2] for r in res])
            for q, quantity in (("logprob", "logprob"), ("entropy", "entropy"), ("grad", "grad"),
                                ("sum_p2", "entropy")):
                a, b = getattr(with_ids, q), getattr(with_mask, q)
                assert (a is None) == (b is None), (what, q)
                assert a is None or testing.within_tolerance(a, b, testing.tolerance(dtype, quantity)), (what, q)
            assert not ext.ext_failures(masked, with_ids), (what, "ids", ext.ext_failures(masked, with_ids))
            assert not ext.ext_failures(masked, with_mask), (what, "mask", ext.ext_failures(masked, with_mask))
