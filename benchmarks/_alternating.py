"""What the single-process CPU timing scripts share (``lean_stats.py``, ``mask_floor.py``, ``fresh_buffer.py``,
``gradient_pool.py``, ``jax_recycled.py``, ``head_step.py``, ``grad_indicator.py``, ``jax_vs_torch.py``).

Their variants are timed in one process with calls alternating, so that every
variant sees the same machine load; each is called ``warm`` times first
(compiles, first touches), then ``reps`` rounds of one call each.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from typing import Callable


def size_parser(doc: str, dtypes: str, *, V: str = "32000", reps: int = 9) -> argparse.ArgumentParser:
    """The common options: ``--T``, ``--V`` (comma list, :func:`widths`), ``--dtypes`` (comma list), ``--reps``.

    Callers add their own options to the parser before parsing.
    """
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--V", default=V, help="comma list of V_local")
    ap.add_argument("--dtypes", default=dtypes)
    ap.add_argument("--reps", type=int, default=reps)
    return ap


def widths(a: argparse.Namespace) -> list[int]:
    """``--V`` as a list of ints."""
    return [int(s) for s in str(a.V).split(",")]


def size_args(doc: str, dtypes: str) -> argparse.Namespace:
    """:func:`size_parser`'s options, parsed, for scripts that take one ``--V`` (an int)."""
    a = size_parser(doc, dtypes).parse_args()
    (a.V,) = widths(a)
    return a


def times_ms(fns: dict[str, Callable[[], object]], reps: int, warm: int = 1, pause: float = 0.0) -> dict[str, list]:
    """Wall times of each ``fns`` value, milliseconds, ``reps`` calls alternating between them.

    ``pause``: seconds slept before each timed call (not timed), e.g. so that
    one framework's idle worker threads stop spinning before the other's call.
    """
    for f in fns.values():
        for _ in range(warm):
            f()
    times: dict = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            if pause:
                time.sleep(pause)
            t0 = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t0) * 1e3)
    return times


def medians_ms(fns: dict[str, Callable[[], object]], reps: int, warm: int = 1) -> dict[str, float]:
    """Median of :func:`times_ms` per function."""
    return {k: statistics.median(v) for k, v in times_ms(fns, reps, warm).items()}


def minor_faults() -> int:
    """This process's minor page faults so far (a fresh 4 KiB page's first touch is one)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def times_and_faults(fns: dict[str, Callable[[], object]], reps: int, warm: int = 1) -> tuple[dict, dict]:
    """:func:`times_ms`, and each timed call's minor page faults (the warm-up calls' left out)."""
    faults: dict = {k: [] for k in fns}

    def counted(k, f):
        def run():
            f0 = minor_faults()
            f()
            faults[k].append(minor_faults() - f0)
        return run

    times = times_ms({k: counted(k, f) for k, f in fns.items()}, reps, warm)
    return times, {k: v[warm:] for k, v in faults.items()}


def spread(ts: list) -> str:
    """Median, mean and max of times in ms, and how many calls took more than 2.5x the median.

    A loop of calls pays the mean; on a VM whose fresh huge pages now and then
    stall, the mean can be several times the median (README "Benchmark").
    """
    med = statistics.median(ts)
    return (f"median {med:6.1f} mean {statistics.mean(ts):6.1f} max {max(ts):6.0f} ms, "
            f"{sum(t > 2.5 * med for t in ts)}/{len(ts)} calls > 2.5x median")
