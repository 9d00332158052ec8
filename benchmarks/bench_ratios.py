"""Ratios between two implementations of a ``dualvp bench`` result file, by median and by mean.

The bench's goals compare medians; a loop of calls pays the mean, and on a
VM whose fresh huge pages now and then stall (README "Benchmark") the two
differ by up to 4x for the implementations that advise huge pages. Per
implementation it prints how many calls took more than 2.5x their case's
median, the mean/median range over the cases and the minor page faults per
call; per pair ``A/B`` the time ratio per (size, dtype, mode), summarised
per size and over all.

Usage: python benchmarks/bench_ratios.py RESULT.json dualvp-jax/dualvp-torch [A/B ...]
"""

from __future__ import annotations

import json
import statistics
import sys


def _mean(r: dict) -> float:
    return statistics.mean(r["times_fwdbwd_s"])


def main(path: str, pairs: list) -> None:
    results = [r for r in json.load(open(path))["results"] if r.get("world", 1) == 1]
    by = {(r["impl"], r["V_local"], r["dtype"], r["mode"]): r for r in results}
    for impl in sorted({r["impl"] for r in results}):
        rs = [r for r in results if r["impl"] == impl]
        times = [t for r in rs for t in r["times_fwdbwd_s"]]
        slow = sum(t > 2.5 * r["fwdbwd_s"] for r in rs for t in r["times_fwdbwd_s"])
        mm = [_mean(r) / r["fwdbwd_s"] for r in rs]
        faults = [r["minor_faults_fwdbwd"] for r in rs if r.get("minor_faults_fwdbwd") is not None]
        print(f"{impl:22s} {len(times)} calls, {slow} > 2.5x median, slowest {max(times):.2f} s; "
              f"mean/median {min(mm):.2f}-{max(mm):.2f} (median {statistics.median(mm):.2f})"
              + (f"; minor faults per call {min(faults)}-{max(faults)}" if faults else ""))
    sizes = sorted({k[1] for k in by})
    for a, b in (p.split("/") for p in pairs):
        for stat, get in (("median", lambda r: r["fwdbwd_s"]), ("mean", _mean)):
            for V in sizes + [None]:
                v = [get(r) / get(by[(b,) + k[1:]]) for k, r in by.items()
                     if k[0] == a and (V is None or k[1] == V) and (b,) + k[1:] in by]
                if v:
                    print(f"{a} / {b}, {stat:6s} {'all sizes' if V is None else f'V_local={V}':15s}: "
                          f"{min(v):.2f}-{max(v):.2f}, median {statistics.median(v):.2f}, <= 1 in {sum(x <= 1 for x in v)}/{len(v)}")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
