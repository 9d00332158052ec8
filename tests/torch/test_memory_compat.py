"""Peak extra memory of forward + backward (profiler allocation trace). (The compat tests are in test_torch_compat.py.)"""

import pytest

torch = pytest.importorskip("torch")

from dualvp.testing.modes import MODES  # noqa: E402
from dualvp_torch import kernels, logprob_entropy  # noqa: E402

from ._alloc import allocations as _allocations, peak as _peak  # noqa: E402

T, V = 512, 4096  # B = 8 MiB in float32, 4 MiB in bfloat16


# modes of the shared table (dualvp.testing.modes) whose memory differs
_MODES = ("lp", "lp+ent+grad", "lp+ent+grad.keep", "lp+ent.keep")


def _measure(dtype, mode, inplace=False, impl=None):
    m = MODES[mode]
    opt = dict(m.options(), temperature=0.7)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, V, generator=g).to(dtype)
    y = torch.randint(0, V, (T,), generator=g)
    keep = (torch.rand(T, V, generator=g) < 0.5) if m.masked else None
    B = x.numel() * x.element_size()
    leaf = x.clone().requires_grad_(True)

    def fwd():
        z = leaf * 1 if inplace else leaf
        lp, h = logprob_entropy(z, y, keep_mask=keep, inplace_grad=inplace, impl=impl, **opt)
        return z, lp, h

    def step():
        z, lp, h = fwd()
        loss = lp.sum() if h is None or not h.requires_grad else lp.sum() + h.sum()
        if inplace:
            # the op's own backward only: its gradient flows into z's storage
            torch.autograd.grad(loss, z)
        else:
            leaf.grad = None
            loss.backward()

    step()  # warm-up (compilation)
    if inplace:
        z0 = leaf * 1  # the caller's non-leaf logits exist before the op runs
        lp, h = logprob_entropy(z0, y, keep_mask=keep, inplace_grad=True, impl=impl, **opt)
        fwd_sizes = None

        def run():
            loss = lp.sum() if h is None or not h.requires_grad else lp.sum() + h.sum()
            torch.autograd.grad(loss, z0)

        sizes = _allocations(run)
        return B, fwd_sizes, sizes
    fwd_sizes = _allocations(fwd)
    leaf.grad = None
    sizes = _allocations(step)
    return B, fwd_sizes, sizes


@pytest.fixture
def serial_eager(monkeypatch):
    """The eager path's chunks in the calling thread, where the profiler sees their allocations.

    On worker threads (the default on CPU) the allocation trace misses the
    chunks' scratch, so a test of it there would pass whatever it allocated.
    One worker gets chunks ``workers`` times larger than each of ``workers``
    parallel ones (``kernels.chunk_rows`` divides the budget by the worker
    count), so the scratch measured here is the whole in-flight budget.
    """
    monkeypatch.setattr(kernels, "MAX_EAGER_WORKERS", 1)


def _chunk_bytes(dtype, fraction, scratch_bytes):
    # one float32 [rows, V] temporary of an eager chunk (the spec's shifted logits, say)
    size = torch.empty((), dtype=dtype).element_size()
    return kernels.chunk_rows(T, V, size, fraction, scratch_bytes, cap_bytes=kernels.CPU_CHUNK_SCRATCH_BYTES) * V * 4


@pytest.mark.parametrize("impl", ["compiled", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", _MODES)
def test_peak_memory(dtype, mode, impl, serial_eager):
    B, fwd_sizes, sizes = _measure(dtype, mode, impl=impl)
    # forward: nothing of [T, V_local] size; compiled: O(T) only; eager: row
    # chunks of bounded scratch (kernels.STATS_FRACTION of B)
    if impl == "compiled":
        assert max(fwd_sizes, default=0) < 0.05 * B, [s for s in fwd_sizes if s > 0.01 * B]
        assert _peak(fwd_sizes) < 0.05 * B
    else:
        # the trace sees the chunks (else the bounds below would hold vacuously)
        assert max(fwd_sizes) >= _chunk_bytes(dtype, kernels.STATS_FRACTION, kernels.STATS_SCRATCH_BYTES)
        assert max(sizes) >= _chunk_bytes(dtype, kernels.GRAD_FRACTION, kernels.GRAD_SCRATCH_BYTES)
        assert max(fwd_sizes, default=0) < 0.1 * B, [s for s in fwd_sizes if s > 0.01 * B]
        assert _peak(fwd_sizes) <= kernels.STATS_FRACTION * B + 0.01 * B
    # forward + backward: about one gradient buffer (in the input dtype) at the peak
    big = [s for s in sizes if s >= 0.5 * B]
    assert big == [B], big
    assert _peak(sizes) <= 1.1 * B, _peak(sizes) / B


@pytest.mark.parametrize("impl", ["compiled", "eager"])
@pytest.mark.parametrize("mode", ["lp+ent+grad", "lp+ent+grad.keep"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_grad_memory(dtype, mode, impl, serial_eager):
    # compiled: one fused kernel reads each element and writes its gradient
    # over it; eager: row chunks of bounded scratch. Goal: <= 0.05 B.
    B, _, sizes = _measure(dtype, mode, inplace=True, impl=impl)
    if impl == "eager":  # the trace sees the chunks
        assert max(sizes) >= _chunk_bytes(dtype, kernels.INPLACE_FRACTION, kernels.GRAD_SCRATCH_BYTES)
    assert _peak(sizes) <= 0.05 * B, _peak(sizes) / B



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_label_smoothing_memory(dtype):
    # Megatron's drop-in with label smoothing: its extra O(T) statistic and
    # in-place gradient term add no [T, V_local] buffer (on CPU, a 16-bit
    # row sum or scatter_add_ would copy the whole shard to float32).
    from dualvp_torch import compat

    g = torch.Generator().manual_seed(0)
    leaf = torch.randn(T, V, generator=g).to(dtype).requires_grad_(True)
    y = torch.randint(0, V, (T,), generator=g)
    B = leaf.numel() * leaf.element_size()

    def step():
        leaf.grad = None
        compat.vocab_parallel_cross_entropy(leaf, y, label_smoothing=0.1).sum().backward()

    step()
    sizes = _allocations(step)
    assert [s for s in sizes if s >= 0.5 * B] == [B]
    assert _peak(sizes) <= 1.1 * B, _peak(sizes) / B


def test_new_shapes_do_not_recompile_into_the_eager_fallback():
    # Training calls the op with a new T at (almost) every step. The compiled
    # stages must take any (T, V_local) without a recompile per shape: past
    # dynamo's recompile limit (8) the op would switch to the eager path (row
    # chunks of scratch in the forward) for the rest of the process.
    g = torch.Generator().manual_seed(1)
    for t in range(3, 15):  # 12 shapes, more than the recompile limit
        x = torch.randn(t, 96 + t, generator=g).requires_grad_(True)
        lp, h = logprob_entropy(x, torch.randint(0, 96, (t,), generator=g), impl="compiled")
        (lp.sum() + h.sum()).backward()
    B, fwd_sizes, sizes = _measure(torch.float32, "lp+ent+grad", impl="compiled")
    assert max(fwd_sizes, default=0) < 0.05 * B, [s for s in fwd_sizes if s > 0.01 * B]
    assert [s for s in sizes if s >= 0.5 * B] == [B]


@pytest.mark.parametrize("masked", [False, True])
def test_views_and_coincident_sizes_do_not_recompile(monkeypatch, masked):
    # What a training loop passes: logits as views of differently shaped
    # bases (row slices, [B, S, V] batches reshaped), contiguous tensors, and
    # a first batch whose row count equals the statistics' column count (6).
    # Dynamo guarded views on their bases' layout, and duck sizing tied T to
    # the stride of a statistics column, or V_local to a slice's storage
    # offset: a recompile each (~3 s on this CPU; after 8, the eager fallback
    # for good). Allowed: one specialisation per stage when views at a
    # storage offset >= 2 follow offset-0 inputs (dynamo's 0/1 rule). (The
    # merge is compiled off the CPU only.)
    monkeypatch.setattr(kernels, "_state", {"failed": False})
    g = torch.Generator().manual_seed(3)
    V = 40

    def step(x):
        t = x.shape[0]
        keep = (torch.rand(t, V, generator=g) < 0.7) if masked else None
        lp, h = logprob_entropy(x.requires_grad_(True), torch.randint(0, V, (t,), generator=g), keep_mask=keep,
                                impl="compiled")
        (lp.sum() + h.sum()).backward()

    offset0 = [torch.randn(6, V, generator=g), torch.randn(9, V, generator=g)[:5],
               torch.randn(2, 4, V, generator=g)[:, :-1].reshape(-1, V), torch.randn(3, 3, V, generator=g).view(-1, V)]
    offset_rows = [torch.randn(8, V, generator=g)[1:-1], torch.randn(2, 6, V, generator=g).view(-1, V)[3:],
                   torch.randn(20, V, generator=g)[2:15]]
    count = lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]  # noqa: E731
    before = count()
    for x in offset0:
        step(x)
    assert count() - before == 2, f"{count() - before} graphs for the 2 stages (statistics, gradient)"
    step(torch.randn(1, V, generator=g))  # one row runs eager: no size-1 specialisation
    assert count() - before == 2, f"{count() - before - 2} graphs for a one-row call"
    for x in offset_rows + offset0 + offset_rows:
        step(x)
    assert count() - before <= 4, f"{count() - before} graphs for the 2 stages"


def test_static_vocab_compiles_once_per_width_with_dynamic_rows(monkeypatch):
    # kernels.STATIC_VOCAB_DEVICES (the GPU's default, off on the CPU), checked on the CPU: one graph
    # per stage for every row count (views and contiguous inputs alike), a new one per vocabulary
    # width, and the same numbers as the dynamic-shape kernels.
    monkeypatch.setattr(kernels, "_state", {"failed": False})
    g = torch.Generator().manual_seed(5)
    count = lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]  # noqa: E731

    def step(t, v, static):
        monkeypatch.setattr(kernels, "STATIC_VOCAB_DEVICES", frozenset({"cpu"} if static else ()))
        gen = torch.Generator().manual_seed(t * 1000 + v)
        x = torch.randn(t + 3, v, generator=gen)[2:-1]  # a view one row into its base
        keep = torch.rand(t, v, generator=gen) < 0.7  # the mask's uint8 view is marked too
        z = x.clone().requires_grad_(True)
        lp, h = logprob_entropy(z, torch.randint(0, v, (t,), generator=gen), keep_mask=keep, impl="compiled")
        (lp.sum() + h.sum()).backward()
        return lp, h, z.grad

    for t in (7, 9, 33):  # the dynamic-shape kernels first, for the comparison
        step(t, 40, False)
    before = count()
    for t in (7, 9, 33, 12):
        for a, b in zip(step(t, 40, True), step(t, 40, False)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert count() - before == 2, f"{count() - before} graphs for 2 stages at one width, rows 7-33"
    step(10, 56, True)
    assert count() - before == 4, f"{count() - before - 2} graphs for a second width (expected 2)"


def test_a_small_first_call_does_not_compile_serial_kernels(monkeypatch):
    # Inductor's C++ kernels decide at compile time, from the example sizes,
    # whether a loop is parallel; the dynamic-shape kernel then serves every
    # later shape. A first call at a tiny shape must not leave the stages
    # serial for the rest of the process (or, through the FX graph cache, for
    # later processes). A fresh compile (own cache, new code objects) of the
    # statistics at T=4, V_local=64; every stage takes the same options.
    from torch._inductor.utils import fresh_inductor_cache, run_and_get_code

    monkeypatch.setattr(kernels, "_state", {"failed": False})
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 64, generator=g)
    y = torch.randint(0, 64, (4,), generator=g)
    with fresh_inductor_cache():
        _, codes = run_and_get_code(logprob_entropy, x, y, impl="compiled")
    kernels_src = [k for c in codes for k in c.split('extern "C"')[1:]]
    assert kernels_src, codes
    for k in kernels_src:
        assert "#pragma omp parallel" in k and "num_threads(1)" not in k, k[:2000]


def _thp_mode():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def _smaps_field(addr, field):
    """``field`` (e.g. ``THPeligible``) of the mapping of this process that holds ``addr``."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith(field + ":"):
                return int(line.split()[1])
    return None


@pytest.mark.skipif(_thp_mode() in (None, "never"), reason="no transparent huge pages on this machine")
def test_fresh_gradient_buffers_are_advised_as_huge_pages(monkeypatch):
    # kernels.advise_huge_pages: the kernel records the advice on a large buffer's mapping (smaps'
    # THPeligible, 0 without the advice when the system's policy is "madvise"), and with the CPU
    # opted in (kernels.HUGE_PAGE_DEVICES) the op's fresh gradient is allocated that way; small
    # buffers are left alone, and by default nothing is advised.
    big = torch.empty(kernels.HUGE_PAGE_MIN_BYTES // 4 + 4096)  # float32, its own mapping
    addr = big.data_ptr() + big.numel() * 2  # the middle of the buffer
    if _smaps_field(addr, "THPeligible") is None:
        pytest.skip("this kernel's smaps has no THPeligible field")
    import os

    others_advise = "hugetlb" in os.environ.get("GLIBC_TUNABLES", "") or os.environ.get("THP_MEM_ALLOC_ENABLE")
    if _thp_mode() == "madvise" and not others_advise:  # glibc or torch's allocator may advise it first
        assert _smaps_field(addr, "THPeligible") == 0
    assert kernels.advise_huge_pages(big)
    assert _smaps_field(addr, "THPeligible") == 1
    assert not kernels.advise_huge_pages(torch.empty(1024))  # below HUGE_PAGE_MIN_BYTES
    z = torch.randn(kernels.HUGE_PAGE_MIN_BYTES // (4 * 256) + 8, 256)
    if _thp_mode() == "madvise" and not others_advise:
        g = kernels._fresh_grad(z)
        assert _smaps_field(g.data_ptr() + g.numel() * 2, "THPeligible") == 0
    monkeypatch.setattr(kernels, "HUGE_PAGE_DEVICES", frozenset({"cpu"}))
    g = kernels._fresh_grad(z)
    assert g.shape == z.shape and g.dtype == z.dtype and g.is_contiguous()
    assert _smaps_field(g.data_ptr() + g.numel() * 2, "THPeligible") == 1
