"""The eager path's chunk-parallel workers: same results as one chunk at a time, no change to the caller's threads."""

import threading

import pytest

torch = pytest.importorskip("torch")

from dualvp_torch import kernels, logprob_entropy  # noqa: E402


def _run(z0, y, keep):
    z = z0.clone().requires_grad_(True)
    lp, h = logprob_entropy(z, y, keep_mask=keep, impl="eager")
    (lp.sum() + 0.5 * h.sum()).backward()
    return lp.detach(), h.detach(), z.grad


@pytest.mark.parametrize("with_mask", [False, True])
def test_workers_match_serial_and_keep_thread_settings(monkeypatch, with_mask):
    if torch.get_num_threads() < 2:
        torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    T, V = 96, 4096  # several chunks per stage at this size
    z0 = torch.randn(T, V, generator=g) * 3
    y = torch.randint(0, V, (T,), generator=g)
    keep = (torch.rand(T, V, generator=g) < 0.3) if with_mask else None
    monkeypatch.setattr(kernels, "MIN_CHUNK_ELEMENTS", V)  # one row per chunk: many chunks
    before = torch.get_num_threads()
    par = _run(z0, y, keep)
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert torch.get_num_threads() == before and seen == [before]  # the caller's and new threads' settings
    monkeypatch.setattr(kernels, "MAX_EAGER_WORKERS", 1)
    ser = _run(z0, y, keep)
    for a, b in zip(par, ser):
        assert torch.equal(a, b)  # rows are independent: chunking changes no bit


def test_forward_stage_releases_its_scratch(monkeypatch):
    # kernels._release_chunk_scratch (glibc malloc_trim) runs after the forward's statistics when
    # they ran on the worker threads: their arenas kept the freed chunk scratch resident into the
    # backward (peak RSS of the eager bf16 log-prob fwd + bwd at 2048 x 32000: 1.90 B, 1.03-1.07 B
    # with it; README "Benchmark"). Here: the forward releases once, the backward not (it cost
    # time and no peak), and the process's libc has the call (Linux with glibc).
    import platform
    import sys

    if torch.get_num_threads() < 2:
        torch.set_num_threads(2)
    calls = []
    monkeypatch.setattr(kernels, "_release_chunk_scratch", lambda: calls.append(1))
    monkeypatch.setattr(kernels, "MIN_CHUNK_ELEMENTS", 4096)
    g = torch.Generator().manual_seed(1)
    z0 = torch.randn(64, 4096, generator=g)
    _run(z0, torch.randint(0, 4096, (64,), generator=g), None)
    assert len(calls) == 1, calls
    if sys.platform.startswith("linux") and "glibc" in " ".join(platform.libc_ver()):
        assert kernels._malloc_trim() is not None
