"""What ``dualvp bench`` prints while it runs: one line per record, and the collectives of the W-rank run.

Figures only: the results file (:mod:`.results`) holds them, and nothing
here judges them against a goal.
"""

from __future__ import annotations

import sys

__all__ = ["progress", "header", "row", "print_collectives", "memory_method"]

_MEMORY = {
    "cpu": "peak extra RSS of one forward+backward in the implementation's own process (VmHWM reset through "
           "/proc/self/clear_refs after gc and malloc_trim; extra = VmHWM after - VmRSS before), / B",
    "cuda": "torch.cuda.max_memory_allocated during one forward+backward (peak reset after a synchronize) - "
            "memory_allocated before it, / B; JAX on a GPU: not measured",
}


def memory_method(device: str) -> str:
    """How ``peak_extra_B`` is measured on ``device`` (B: the bytes of the logits shard)."""
    return _MEMORY[device]


def progress(msg: str) -> None:
    """One overwritten status line on a terminal (nothing when stdout is a file)."""
    if sys.stdout.isatty():
        sys.stdout.write("\r" + msg[:110].ljust(110) + ("\r" if not msg else ""))
        sys.stdout.flush()


_COLS = (
    ("size", 14), ("dtype", 9), ("mode", 17), ("impl", 22), ("first ms", 9), ("fwd ms", 8), ("bwd ms", 8),
    ("f+b ms", 8), ("kern ms", 8), ("host us", 8), ("launch", 6), ("mem/B", 6), ("err lp", 9), ("err H", 9),
    ("err grad", 9),
)


def _ms(x) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" if x < 1 else f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def _e(x) -> str:
    return "-" if x is None else f"{x:.1e}"


def header() -> str:
    """The header of the table :func:`row` prints while the bench runs."""
    return "  ".join(f"{n:>{w}}" if i >= 4 else f"{n:<{w}}" for i, (n, w) in enumerate(_COLS))


def row(r: dict) -> str:
    """One record as a line of the live table."""
    e = r.get("errors") or {}
    vals = (
        f"{r['T']}x{r['V_local']}" + (f"/W{r['world']}" if r.get("world", 1) > 1 else ""),
        r["dtype"], r["mode"], r["impl"], _ms(r.get("first_ms")), _ms(r.get("fwd_ms")), _ms(r.get("bwd_ms")),
        _ms(r.get("wall_ms")), _ms(r.get("kernel_ms")), "-" if r.get("host_us") is None else f"{r['host_us']:.0f}",
        "-" if r.get("launches") is None else f"{r['launches']:.0f}",
        "-" if r.get("peak_extra_B") is None else f"{r['peak_extra_B']:.2f}",
        _e(e.get("logprob")), _e(e.get("entropy")), _e(e.get("grad")),
    )
    return "  ".join(f"{v:>{w}}" if i >= 4 else f"{v:<{w}}" for i, ((_, w), v) in enumerate(zip(_COLS, vals)))


def print_collectives(rec: dict) -> None:
    """One line of the W-rank run: collectives per forward / backward on rank 0, rank agreement."""
    c = rec.get("collectives")
    if not c:
        return
    f, b = c["fwd"], c["bwd"]
    print(f"  W={rec['world']} {rec['impl']:<20} {rec['mode']:<17} fwd {f['count']} coll {f['bytes']} B {f['by_op']}"
          f"  bwd {b['count']} coll {b['bytes']} B  ranks agree: {rec.get('ranks_agree')}", flush=True)
