"""The eager path's chunk-parallel workers: same results as one chunk at a time, no change to the caller's threads."""

import threading

import pytest

torch = pytest.importorskip("torch")

from dualvp_torch import kernels, logprob_entropy  # noqa: E402


def _on_glibc() -> bool:
    import platform
    import sys

    return sys.platform.startswith("linux") and "glibc" in " ".join(platform.libc_ver())


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


@pytest.mark.parametrize("workers", [1, 2])
def test_forward_stage_releases_its_scratch(monkeypatch, workers):
    # kernels._release_chunk_scratch (glibc malloc_trim) runs after the forward's statistics when
    # they ran in chunks, on the worker threads or (one worker) in the calling thread: the arenas
    # kept the freed chunk scratch resident into the backward (peak RSS of the eager bf16 log-prob
    # fwd + bwd at 2048 x 32000: 1.90 B, 1.03-1.07 B with it; docs/measurements.md). Here: the
    # forward releases once, the backward not (it cost time and no peak), and the process's libc
    # has the call (Linux with glibc).
    if torch.get_num_threads() < 2:
        torch.set_num_threads(2)
    calls = []
    monkeypatch.setattr(kernels, "MAX_EAGER_WORKERS", workers)  # 1: the chunks run in the calling thread
    monkeypatch.setattr(kernels, "_release_chunk_scratch", lambda: calls.append(1))
    monkeypatch.setattr(kernels, "MIN_CHUNK_ELEMENTS", 4096)
    g = torch.Generator().manual_seed(1)
    z0 = torch.randn(64, 4096, generator=g)
    _run(z0, torch.randint(0, 4096, (64,), generator=g), None)
    assert len(calls) == 1, calls
    if _on_glibc():
        assert kernels._malloc_trim() is not None


# glibc alone (no torch in the process, whose import moves the same thresholds): a worker
# thread's chunk loop, temporaries that add up to argv[2] bytes a chunk, allocated as torch's
# CPU allocator does (posix_memalign, 64-byte alignment) and freed; minor page faults of 20
# chunks, then the same after freeing one block of argv[1] bytes (what
# kernels._keep_chunk_scratch_mapped does).
_FAULTS_SCRIPT = r"""
import ctypes, resource, sys, threading
libc = ctypes.CDLL("libc.so.6")
libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
block, n = int(sys.argv[1]), 7
size = int(sys.argv[2]) // n

def alloc():
    p = ctypes.c_void_p()
    libc.posix_memalign(ctypes.byref(p), 64, size)
    return p.value

def chunks():
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(20):
        ps = [alloc() for _ in range(n)]
        for p in ps:
            libc.memset(p, 1, size)
        for p in reversed(ps):
            libc.free(p)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before

def worker(out):  # one thread throughout: one arena
    chunks()  # glibc's own rule has raised its threshold to the temporaries' size
    out.append(chunks())
    libc.free(libc.malloc(block))
    out.append(chunks())

out = []
t = threading.Thread(target=worker, args=(out,))
t.start()
t.join()
print(*out)
"""


def test_chunk_scratch_stays_mapped_between_chunks(monkeypatch):
    # kernels._keep_chunk_scratch_mapped: glibc returns a heap's free top to the kernel past a trim
    # threshold that follows the largest mmap'd block freed so far; the chunk temporaries alone
    # leave it below one chunk's scratch, and every chunk faulted its pages in again (150-300
    # thousand minor faults per float32 call at 2048 x 32000). The eager CPU path makes the call
    # (once per process), and one freed block of CPU_CHUNK_SCRATCH_BYTES keeps a chunk loop's
    # pages mapped (checked on glibc itself, in a fresh process).
    import subprocess
    import sys

    calls = []
    monkeypatch.setattr(kernels, "_keep_chunk_scratch_mapped", lambda: calls.append(1))
    g = torch.Generator().manual_seed(2)
    _run(torch.randn(8, 512, generator=g), torch.randint(0, 512, (8,), generator=g), None)
    assert calls, "the eager CPU path did not raise glibc's thresholds"
    if not _on_glibc():
        return
    block = kernels.CPU_CHUNK_SCRATCH_BYTES
    # a chunk's live temporaries: 8-26 B per element against the 28 B bound (STATS_SCRATCH_BYTES)
    scratch = block * 3 // 4
    out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, str(block), str(scratch)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    default, kept = map(int, out.stdout.split())
    pages = 20 * scratch // 4096  # if every chunk faults its scratch in
    # without the block, chunks fault in a good part of their scratch again (~40 % here); with it, few
    assert default > pages // 4, (default, kept, pages)
    assert kept < pages // 20, (default, kept, pages)


# The eager forward of a float32 2048 x 16384 shard in 1 MiB chunks, in the calling thread of a
# fresh process: peak extra RSS of the second call (the kernel's counter reset before it), as a
# multiple of the shard's bytes.
_FORWARD_PEAK_SCRIPT = r"""
import torch
from dualvp.tools.bench.worker import PeakRSS
from dualvp_torch import kernels, logprob_entropy
kernels.MAX_EAGER_WORKERS = 1
kernels.CPU_CHUNK_SCRATCH_BYTES = 1 << 20

g = torch.Generator().manual_seed(3)
T, V = 2048, 16384
z = torch.randn(T, V, generator=g)
y = torch.randint(0, V, (T,), generator=g)
for _ in range(2):
    with PeakRSS() as pk:
        logprob_entropy(z, y, with_entropy=False, impl="eager")
assert PeakRSS.method == "VmHWM-reset", PeakRSS.method  # not the sampler, which can miss a peak
print(pk.extra / z.nbytes)
"""


def test_forward_keeps_no_chunk_result_between_chunks():
    # _stats_eager writes each chunk's statistics into one buffer of the shard's rows. When it kept
    # a list of per-chunk results (concatenated at the end), glibc's heap grew by about one chunk's
    # scratch per chunk (likely: each small result at the heap's top, above its chunk's freed
    # temporaries, so the next chunk's went above it). Eager bfloat16 forward
    # at 2048 x 152064: 0.7-1.9 B of peak RSS (in two of three processes); in this script (fresh
    # process, deterministic): 0.80-0.91 B before, 0.00-0.05 B with the buffer (1 MiB of scratch).
    import subprocess
    import sys

    if not _on_glibc():
        pytest.skip("measures glibc's heap through /proc")
    out = subprocess.run([sys.executable, "-c", _FORWARD_PEAK_SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) < 0.25, out.stdout
