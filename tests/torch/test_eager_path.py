"""The eager path (``dualvp_torch.eager``): chunk-parallel workers, peak RSS, the opt-in glibc heap calls.

Workers give the same bits as one chunk at a time and leave the caller's thread settings alone; the
forward keeps no per-chunk result alive (peak RSS in a fresh process); the glibc calls of
``dualvp_torch.host_memory`` run only under ``Tuning(glibc_heap=True)``, and do on glibc what they
are there for.
"""

import threading

import pytest

torch = pytest.importorskip("torch")

from dualvp_torch import host_memory, logprob_entropy, tuning  # noqa: E402


def _on_glibc() -> bool:
    import platform
    import sys

    return sys.platform.startswith("linux") and "glibc" in " ".join(platform.libc_ver())


@pytest.fixture
def two_threads():
    """At least two intra-op threads (several workers) for the test; the process's count restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield
    torch.set_num_threads(before)


def _run(z0, y, keep):
    z = z0.clone().requires_grad_(True)
    lp, h = logprob_entropy(z, y, keep_mask=keep, impl="eager")
    (lp.sum() + 0.5 * h.sum()).backward()
    return lp.detach(), h.detach(), z.grad


@pytest.mark.parametrize("with_mask", [False, True])
def test_workers_match_serial_and_keep_thread_settings(with_mask, two_threads):
    g = torch.Generator().manual_seed(0)
    T, V = 96, 4096  # several chunks per stage at this size
    z0 = torch.randn(T, V, generator=g) * 3
    y = torch.randint(0, V, (T,), generator=g)
    keep = (torch.rand(T, V, generator=g) < 0.3) if with_mask else None
    before = torch.get_num_threads()
    par = _run(z0, y, keep)
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert torch.get_num_threads() == before and seen == [before]  # the caller's and new threads' settings
    with tuning.using(tuning.Tuning(max_eager_workers=1)):
        ser = _run(z0, y, keep)
    for a, b in zip(par, ser):
        assert torch.equal(a, b)  # rows are independent: chunking changes no bit


@pytest.mark.parametrize("workers", [1, 2])
def test_glibc_heap_calls_only_when_opted_in(monkeypatch, workers, two_threads):
    # dualvp_torch.host_memory: by default the eager path makes no allocator call of its own; with
    # Tuning(glibc_heap=True) it raises glibc's heap thresholds before its chunks and trims the
    # arenas once after the forward's chunks (on the worker threads or, one worker, in the calling
    # thread), not after the backward's; on glibc the calls exist.
    calls = []
    monkeypatch.setattr(host_memory, "release_chunk_scratch", lambda: calls.append("trim"))
    monkeypatch.setattr(host_memory, "keep_chunk_scratch_mapped", lambda n: calls.append(("mapped", n)))
    g = torch.Generator().manual_seed(1)
    z0 = torch.randn(64, 4096, generator=g)  # several chunks per stage
    y = torch.randint(0, 4096, (64,), generator=g)
    with tuning.using(tuning.Tuning(max_eager_workers=workers)):  # 1: the chunks run in the calling thread
        _run(z0, y, None)
    assert calls == []
    setting = tuning.Tuning(max_eager_workers=workers, glibc_heap=True)
    with tuning.using(setting):
        _run(z0, y, None)
    assert calls.count("trim") == 1, calls
    assert ("mapped", setting.cpu_chunk_scratch_bytes) in calls, calls
    if _on_glibc():
        assert host_memory.malloc_trim() is not None


# glibc alone (no torch in the process, whose import moves the same thresholds): a worker
# thread's chunk loop, temporaries that add up to argv[2] bytes a chunk, allocated as torch's
# CPU allocator does (posix_memalign, 64-byte alignment) and freed; minor page faults of 20
# chunks, then the same after freeing one block of argv[1] bytes (what
# host_memory.keep_chunk_scratch_mapped does).
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


def test_chunk_scratch_stays_mapped_between_chunks():
    # host_memory.keep_chunk_scratch_mapped (opt-in): glibc returns a heap's free top to the kernel
    # past a trim threshold that follows the largest mmap'd block freed so far; the chunk temporaries
    # alone leave it below one chunk's scratch, and every chunk faults its pages in again. One freed
    # block of the chunk bound keeps a chunk loop's pages mapped (checked on glibc itself, in a
    # fresh process).
    import subprocess
    import sys

    if not _on_glibc():
        pytest.skip("checks glibc's heap")
    block = tuning.DEFAULT.cpu_chunk_scratch_bytes
    scratch = block * 3 // 4  # a chunk's live temporaries, within the bound
    out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, str(block), str(scratch)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    default, kept = map(int, out.stdout.split())
    pages = 20 * scratch // 4096  # if every chunk faults its scratch in
    # without the block, chunks fault in a good part of their scratch again; with it, few
    assert default > pages // 4, (default, kept, pages)
    assert kept < pages // 20, (default, kept, pages)


# The eager forward of a float32 1024 x 16384 shard in 1 MiB chunks (64 chunks of 16 rows; the shard,
# 64 MiB, above glibc's largest mmap threshold, as at the bench size), in the calling thread of a
# fresh process, with the default heap and then with the opt-in glibc heap calls (which change the
# process's heap for good, so they go second): peak extra RSS of the second call of each (the
# kernel's high-water mark reset before it), as a multiple of the shard's bytes.
_FORWARD_PEAK_SCRIPT = r"""
import torch
from dualvp_torch import logprob_entropy, tuning

def status_kb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

g = torch.Generator().manual_seed(3)
T, V = 1024, 16384
z = torch.randn(T, V, generator=g)
y = torch.randint(0, V, (T,), generator=g)
for glibc in (False, True):
    with tuning.using(tuning.Tuning(max_eager_workers=1, cpu_chunk_scratch_bytes=1 << 20, glibc_heap=glibc)):
        for _ in range(2):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            before = status_kb("VmRSS")
            logprob_entropy(z, y, with_entropy=False, impl="eager")
            extra = status_kb("VmHWM") - before
    print(extra / z.nbytes)
"""


@pytest.mark.slow
def test_forward_keeps_no_chunk_result_between_chunks():
    # eager.stats writes each chunk's statistics into one buffer of the shard's rows. When it kept
    # a list of per-chunk results (concatenated at the end), glibc's heap grew by about one chunk's
    # scratch per chunk (likely: each small result at the heap's top, above its chunk's freed
    # temporaries, so the next chunk's went above it): most of B here (a chunk's scratch per chunk of B,
    # whatever T). With the buffer the forward's peak stays a small part of B, with and without the
    # opt-in glibc heap calls (one fresh process measures both).
    import subprocess
    import sys

    if not _on_glibc():
        pytest.skip("measures glibc's heap through /proc")
    out = subprocess.run([sys.executable, "-c", _FORWARD_PEAK_SCRIPT], capture_output=True, text=True,
                         timeout=300)
    if "clear_refs" in out.stderr:
        pytest.skip("this kernel does not let a process reset its peak RSS")
    assert out.returncode == 0, out.stderr
    peaks = [float(v) for v in out.stdout.split()]  # default heap, glibc heap calls
    assert len(peaks) == 2 and max(peaks) < 0.25, out.stdout
