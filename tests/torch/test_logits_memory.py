"""``logprob_entropy`` on logits: peak extra memory of forward + backward (the profiler's allocation trace).

Compiled and eager, in the modes of the shared table whose memory differs, with a fresh or an in-place
gradient; and megatron's label-smoothed drop-in. (Recompiles: test_recompile.py; the eager path's
peak RSS: test_eager_path.py.)
"""

import pytest

torch = pytest.importorskip("torch")

from dualvp.testing.modes import MODES  # noqa: E402
from dualvp_torch import eager, logprob_entropy, tuning  # noqa: E402

from ._alloc import allocations as _allocations, peak as _peak  # noqa: E402

T, V = 512, 4096  # B = 8 MiB in float32, 4 MiB in bfloat16


# modes of the shared table (dualvp.testing.modes) whose memory differs
_MODES = ("lp", "lp+ent+grad", "lp+ent+grad.keep", "lp+ent.keep")
# the fast tier ("not slow") keeps the eager path in bfloat16 in the masked mode with entropy gradient
# (the largest scratch; bfloat16 also upcasts each chunk, so its float32 temporaries are the larger
# share of B); the compiled cases (a compile each on a cold cache), float32 and the other modes are slow
_FAST = ("eager", "lp+ent+grad.keep")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _cases(modes, fast_dtypes=("float32", "bfloat16")):
    return [pytest.param(impl, mode, _DTYPES[dt], id=f"{mode}-{impl}-{dt}",
                         marks=() if (impl, mode) == _FAST and dt in fast_dtypes else pytest.mark.slow)
            for impl in ("compiled", "eager") for mode in modes for dt in _DTYPES]


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
def serial_eager():
    """The eager path's chunks in the calling thread, where the profiler sees their allocations.

    On worker threads (the default on CPU) the allocation trace misses the
    chunks' scratch, so a test of it there would pass whatever it allocated.
    One worker gets chunks ``workers`` times larger than each of ``workers``
    parallel ones (``eager.chunk_rows`` divides the budget by the worker
    count), so the scratch measured here is the whole in-flight budget.
    """
    with tuning.using(tuning.Tuning(max_eager_workers=1)):
        yield


def _chunk_bytes(dtype, fraction, scratch_bytes):
    # one float32 [rows, V] temporary of an eager chunk (the spec's shifted logits, say)
    size = torch.empty((), dtype=dtype).element_size()
    cap = tuning.DEFAULT.cpu_chunk_scratch_bytes
    return eager.chunk_rows(T, V, size, fraction, scratch_bytes, cap_bytes=cap) * V * 4


@pytest.mark.parametrize("impl,mode,dtype", _cases(_MODES, fast_dtypes=("bfloat16",)))
def test_peak_memory(dtype, mode, impl, serial_eager):
    B, fwd_sizes, sizes = _measure(dtype, mode, impl=impl)
    # forward: nothing of [T, V_local] size; compiled: O(T) only; eager: row
    # chunks of bounded scratch (eager.STATS_FRACTION of B)
    if impl == "compiled":
        assert max(fwd_sizes, default=0) < 0.05 * B, [s for s in fwd_sizes if s > 0.01 * B]
        assert _peak(fwd_sizes) < 0.05 * B
    else:
        # the trace sees the chunks (else the bounds below would hold vacuously)
        assert max(fwd_sizes) >= _chunk_bytes(dtype, eager.STATS_FRACTION, eager.STATS_SCRATCH_BYTES)
        assert max(sizes) >= _chunk_bytes(dtype, eager.GRAD_FRACTION, eager.GRAD_SCRATCH_BYTES)
        assert max(fwd_sizes, default=0) < 0.1 * B, [s for s in fwd_sizes if s > 0.01 * B]
        assert _peak(fwd_sizes) <= eager.STATS_FRACTION * B + 0.01 * B
    # forward + backward: about one gradient buffer (in the input dtype) at the peak
    big = [s for s in sizes if s >= 0.5 * B]
    assert big == [B], big
    assert _peak(sizes) <= 1.1 * B, _peak(sizes) / B


# slow: 1-row chunks at this size (INPLACE_FRACTION), ~500 profiled chunks, the fast tier's costliest
# test; the fast tier's memory bound is test_peak_memory's (the same chunk loop, fresh gradient)
@pytest.mark.parametrize("impl,mode,dtype", _cases(["lp+ent+grad", "lp+ent+grad.keep"], fast_dtypes=()))
def test_inplace_grad_memory(dtype, mode, impl, serial_eager):
    # compiled: one fused kernel reads each element and writes its gradient
    # over it; eager: row chunks of bounded scratch. Goal: <= 0.05 B.
    B, _, sizes = _measure(dtype, mode, inplace=True, impl=impl)
    if impl == "eager":  # the trace sees the chunks
        assert max(sizes) >= _chunk_bytes(dtype, eager.INPLACE_FRACTION, eager.GRAD_SCRATCH_BYTES)
    assert _peak(sizes) <= 0.05 * B, _peak(sizes) / B


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.bfloat16])
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
