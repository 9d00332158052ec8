"""What a fresh ``[T, V_local]`` buffer costs to write, with and without huge-page advice (CPU).

The op returns its gradient in a fresh buffer. Its first write faults in
every page; with 4 KiB pages that can cost more than the arithmetic
(``kernels.HUGE_PAGE_DEVICES``). This prints, per size and dtype, the median
time (and the range) of ``torch.empty(...).fill_(1)`` plain and after
``dualvp_torch.kernels.advise_huge_pages``, and of ``x * 2`` into a plain or
advised buffer (read one, write one); plain and advised calls alternate.
With ``--op``, it also times the op itself (``dualvp_torch.logprob_entropy``,
log-prob + entropy with gradient, forward + backward) with and without
``kernels.HUGE_PAGE_DEVICES``, alternating.

Each variant is reported as median, mean and max, and how many calls took
more than 2.5x the median: on a VM the advice can make the median fast and
the mean slow (a huge page the guest has to compact or the host has to back
again stalls the write), and a training loop pays the mean.

Usage: python benchmarks/fresh_buffer.py [--T 2048 --V 32000,152064 --dtypes float32,bfloat16 --reps 9 --op]
"""

from __future__ import annotations


import torch
from _alternating import size_parser, spread, times_ms, widths

from dualvp_torch import kernels, logprob_entropy
from dualvp_torch.kernels import advise_huge_pages


def _op_call(x: torch.Tensor, y: torch.Tensor, gl: torch.Tensor, gh: torch.Tensor, devices: frozenset):
    kernels.HUGE_PAGE_DEVICES = devices
    z = x.detach().requires_grad_(True)
    lp, h = logprob_entropy(z, y)
    torch.autograd.backward((lp, h), (gl, gh))
    return z.grad


def main() -> None:
    ap = size_parser(__doc__, "float32,bfloat16", V="32000,152064")
    ap.add_argument("--op", action="store_true", help="also time the op's forward + backward, advised or not")
    a = ap.parse_args()
    default = kernels.HUGE_PAGE_DEVICES
    for v in widths(a):
        for name in a.dtypes.split(","):
            x = torch.randn(a.T, v).to(getattr(torch, name))

            def fresh(advise):
                out = torch.empty_like(x)
                took = advise_huge_pages(out) if advise else False
                return out, took

            def fill(advise):
                return fresh(advise)[0].fill_(1)

            def mul(advise):
                return torch.mul(x, 2, out=fresh(advise)[0])

            took = fresh(True)[1]
            row = [f"{a.T}x{v} {name:9s} B={x.numel() * x.element_size() / 2**20:6.0f} MiB"]
            for label, fn in (("fill", fill), ("x*2", mul)):
                # alternating keeps the host's drift (and, in a VM, what the host has kept of the
                # guest's free memory) out of the comparison
                ts = times_ms({"plain": lambda: fn(False), "advised": lambda: fn(True)}, a.reps, warm=2)
                row.append(f"{label}: plain {spread(ts['plain'])}; advised {spread(ts['advised'])}")
            if a.op:
                g = torch.Generator().manual_seed(0)
                y = torch.randint(0, v, (a.T,), generator=g)
                gl, gh = torch.randn(a.T, generator=g), torch.randn(a.T, generator=g)
                ts = times_ms({"plain": lambda: _op_call(x, y, gl, gh, frozenset()),
                               "advised": lambda: _op_call(x, y, gl, gh, frozenset({"cpu"}))}, a.reps, warm=2)
                kernels.HUGE_PAGE_DEVICES = default
                row.append(f"op: plain {spread(ts['plain'])}; advised {spread(ts['advised'])}")
            print("\n    ".join(row) + ("" if took else "  (advice refused: no effect expected)"))


if __name__ == "__main__":
    main()
