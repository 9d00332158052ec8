"""The op's fresh CPU gradient three ways: plain, advised as huge pages, or from a pool (a prototype).

``dualvp_torch`` returns the gradient of the logits in a fresh ``[T, V_local]``
buffer. Plain 4 KiB pages fault on first write, every call; advised as huge
pages (``kernels.HUGE_PAGE_DEVICES``, opt-in; the CPU default until 2026-12-05) they fault 512x
less often, but on a VM whose balloon reports free 2 MiB blocks to its host
some calls stall for seconds (README "Benchmark"). The third variant is a
prototype that lives only in this script: the gradient is a view of an
anonymous mapping advised as huge pages, and when the caller drops the
gradient the mapping goes back to a pool (one per byte size) for the next
call, already faulted in. Its price is that the pool holds one gradient's
bytes (1 B) per size between calls.

The three alternate call by call (``_alternating.times_ms``), forward +
backward of log-prob + entropy with gradient; each is reported as median,
mean and max, and how many calls took more than 2.5x the median. The pooled
gradient is checked to be bit-identical to the advised one first.

Usage: python benchmarks/gradient_pool.py [--T 2048 --V 32000,152064 --dtypes float32,bfloat16 --reps 15]
"""

from __future__ import annotations

import ctypes
import mmap
import weakref

import numpy as np
import torch
from _alternating import size_parser, spread, times_ms, widths

from dualvp_torch import kernels, logprob_entropy

_MADV_HUGEPAGE = 14
_plain_fresh_grad = kernels._fresh_grad


class _Pool:
    """Anonymous mappings by byte size; a gradient's mapping returns when its last tensor is freed."""

    def __init__(self):
        self.free: dict[int, list] = {}
        self.created = 0
        libc = ctypes.CDLL(None)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._madvise = libc.madvise

    def grad(self, z: torch.Tensor) -> torch.Tensor:
        n = z.numel() * z.element_size()
        if n < kernels.HUGE_PAGE_MIN_BYTES:
            return _plain_fresh_grad(z)
        free = self.free.setdefault(n, [])
        if free:
            m = free.pop()
        else:
            m = mmap.mmap(-1, n)  # page-aligned, its own mapping
            view = np.frombuffer(m, dtype=np.uint8)
            self._madvise(view.ctypes.data, n, _MADV_HUGEPAGE)
            del view
            self.created += 1
        # torch.frombuffer keeps `owner` alive as long as any tensor on its storage; when the last
        # one goes, `owner` is collected and the mapping (still faulted in) is free again
        owner = np.frombuffer(m, dtype=np.uint8)
        weakref.finalize(owner, free.append, m)
        return torch.frombuffer(owner, dtype=z.dtype, count=z.numel()).view(z.shape)


def main() -> None:
    a = size_parser(__doc__, "float32,bfloat16", V="32000,152064", reps=15).parse_args()
    pool = _Pool()
    variants = {"plain": (frozenset(), _plain_fresh_grad), "advised": (frozenset({"cpu"}), _plain_fresh_grad),
                "pooled": (frozenset({"cpu"}), pool.grad)}
    default = kernels.HUGE_PAGE_DEVICES

    def call(x, y, gl, gh, variant):
        kernels.HUGE_PAGE_DEVICES, kernels._fresh_grad = variants[variant]
        z = x.detach().requires_grad_(True)
        lp, h = logprob_entropy(z, y)
        torch.autograd.backward((lp, h), (gl, gh))
        return z.grad

    try:
        for v in widths(a):
            for name in a.dtypes.split(","):
                x = torch.randn(a.T, v).to(getattr(torch, name))
                g = torch.Generator().manual_seed(0)
                y = torch.randint(0, v, (a.T,), generator=g)
                gl, gh = torch.randn(a.T, generator=g), torch.randn(a.T, generator=g)
                assert torch.equal(call(x, y, gl, gh, "pooled"), call(x, y, gl, gh, "advised"))
                ts = times_ms({k: (lambda k=k: call(x, y, gl, gh, k)) for k in variants}, a.reps, warm=2)
                print(f"{a.T}x{v} {name:9s}\n    " + "\n    ".join(f"{k:8s} {spread(t)}" for k, t in ts.items()))
        print(f"pool: {pool.created} mappings created, by size {sorted((n, len(f)) for n, f in pool.free.items())}")
    finally:
        kernels.HUGE_PAGE_DEVICES, kernels._fresh_grad = default, _plain_fresh_grad


if __name__ == "__main__":
    main()
