"""Static sm_90 figures of every Triton kernel at the goal sizes, and a lower bound on their time; no GPU needed.

Run from the repository root with the GPU image's Triton first on the path::

    PYTHONPATH=/work/t36:. python benchmarks/static_report.py            # prints, appends benchmarks/results/static.csv
    PYTHONPATH=/work/t36:. python benchmarks/static_report.py --no-save  # prints only

Each case runs forward + backward of the public op (``impl="triton"``) under
:func:`dualvp.tools.static.hopper_target`: the host code picks blocks, warps,
grids and specialisation as on an sm_90 device with 132 SMs, and every launch
only compiles. One row per kernel launch kind and case: registers, spills
(local memory bytes per thread of the compiled cubin; ``ptxas_rerun_spill_bytes``:
``ptxas -v`` on the PTX again, whose options may differ from Triton's call),
shared memory, CTAs per SM (limits: 65,536 registers, 2,048
threads, 228 KiB shared memory per SM), SASS instructions and float64
instructions per element in the streaming loop (the longest loop body; the
whole kernel when it has no loop) = instructions / (``BLOCK_T * BLOCK_V`` /
threads).

Model of the lower bound (logits op; stated, not measured): 132 SMs issuing 4
warp-instructions per clock each at 1.98 GHz (1.045e12 warp-instructions/s);
copy bandwidth 3.0 TB/s (H100) and 4.3 TB/s (H200), as measured by the copy
floor on those machines. A kernel that reads the ``[T, V]`` logits once takes
at least ``max(issue, bytes / bandwidth)`` with ``issue = T V x (instructions per
element) / 32 / 1.045e12`` and ``bytes = B`` (+ ``M`` with a keep mask: one byte per
element), a kernel that also writes them ``2 B (+ M)``; kernels without a
``[T, V]`` stream (``BLOCK_V`` absent or the O(T) merge) are left out, as are
launch gaps. ``ratio_*`` = sum over the case's kernels / the floor ``(3 B + 2
M) / bandwidth``: perfect overlap of issue and memory assumed, so the real
ratio is at least this.

Fused LM-head op: ``flop_per_8thv`` = executed FLOP / the credited ``8 T H V``
(forward 2, recompute 2, ``dh`` 2 and ``dW`` 2; each product twice with the
hi/lo split of ``G``, the option ``gradient_rounding="split"``): with the
backward writing ``G`` (``STORE_G``, the 16-bit default) the products are the
host's cuBLAS matmuls, recorded by the harness
(``matmuls``: their count) and summed as ``2 m n k``, plus ``12 T H`` for the
default ``gradient_rounding="fixed"``'s rank-1 residual terms (``FIX_G``: up to
3 per row, the bound counted); with in-kernel products
from the launch's constexprs, and ``mma_flop_ratio`` the same from the SASS
(wgmma FLOP in the backward's loop bodies over the forward's, every branch
counted once); ``atomics_per_kstep``: atomic instructions per thread in the
backward's product loop; ``membar_gpu``: GPU-scope memory barriers.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import subprocess
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: compile, do not interpret
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from dualvp.tools import static  # noqa: E402

ISSUE = 132 * 4 * 1.98e9  # warp-instructions per second
BANDWIDTH = {"H100": 3.0e12, "H200": 4.3e12}
LOGITS_SIZES = [(16384, 19008), (4096, 75968)]
FUSED_SHAPES = [(4096, 2048, 32000), (16384, 4096, 75968)]
DTYPES = ("float32", "bfloat16", "float16")
CSV = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "static.csv")
FIELDS = ["date", "commit", "triton", "op", "kernel", "dtype", "mode", "size", "grid", "block", "warps", "stages",
          "registers", "spill_bytes", "ptxas_rerun_spill_bytes", "shared_bytes", "ctas_per_sm", "instr_per_elem",
          "f64_per_elem",
          "load16_share", "ratio_h100", "ratio_h200", "flop_per_8thv", "mma_flop_ratio", "atomics_per_kstep",
          "membar_gpu", "acq_rel_atomics", "compile_s", "matmuls"]


def _commit() -> str:
    try:
        c = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True).stdout.strip()
        return c + ("-dirty" if dirty else "")
    except OSError:
        return "?"


def _per_thread_elems(a) -> float | None:
    k = a["constexprs"]
    if "BLOCK_V" not in k:
        return None
    return k.get("BLOCK_T", 1) * k["BLOCK_V"] / (32 * a["warps"])


def _row(a, op, dtype, mode, size):
    ept = _per_thread_elems(a)
    c = a["loop"]["counts"]
    w = a["loop"]["widths"]
    loads = sum(n * m for (kind, n), m in w.items() if kind == "load")
    k = a["constexprs"]
    block = "x".join(str(k[n]) for n in ("BLOCK_T", "BLOCK_V", "BLOCK_K") if n in k)
    return dict(op=op, kernel=a["kernel"], dtype=dtype, mode=mode, size=size,
                grid="x".join(map(str, a["grid"])), block=block, warps=a["warps"], stages=a["stages"],
                registers=a["registers"], spill_bytes=a["spill_bytes"],
                ptxas_rerun_spill_bytes=a["ptxas_rerun_spill_bytes"], shared_bytes=a["shared"],
                ctas_per_sm=a["ctas_per_sm"],
                instr_per_elem=round(c["total"] / ept, 2) if ept and op == "logits" else "",
                f64_per_elem=round(c["f64"] / ept, 2) if ept and op == "logits" else "",
                load16_share=round(sum(16 * m for (kind, n), m in w.items() if kind == "load" and n == 16)
                                   / loads, 2) if loads else "",
                membar_gpu=a["membar_gpu"], acq_rel_atomics=a["acq_rel_atomics"], compile_s=round(a["compile_s"], 2))


def _unique(launches):
    seen, out = set(), []
    for launch in launches:
        key = (launch.kernel, id(launch.compiled), launch.grid)
        if key not in seen:
            seen.add(key)
            out.append(launch)
    return out


def logits_rows(T, V, dtype, mode):
    with static.hopper_target() as launches:
        static.drive_logits(launches, T, V, dtype, mode)
    rows, t = [], {g: 0.0 for g in BANDWIDTH}
    isz = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    keep = static.LOGITS_MODES[mode][1]
    N = T * V
    B, M = N * isz, (N if keep else 0)
    for launch in _unique(launches):
        a = static.analyse(launch, rerun_ptxas=True)
        r = _row(a, "logits", dtype, mode, f"{T}x{V}")
        rows.append(r)
        if r["instr_per_elem"] == "" or "merge" in a["kernel"]:
            continue
        writes = any(kind == "store" and n == 16 for (kind, n) in a["loop"]["widths"])
        issue = N * r["instr_per_elem"] / 32 / ISSUE
        for g, bw in BANDWIDTH.items():
            t[g] += max(issue, ((2 if writes else 1) * B + M) / bw)
    for g, bw in BANDWIDTH.items():
        ratio = round(t[g] / ((3 * B + 2 * M) / bw), 3)
        for r in rows:
            r[f"ratio_{g.lower()}"] = ratio
    return rows


def fused_rows(T, H, V, dtype, mode, split=None, backward=None, rounding=None):
    import dataclasses

    from dualvp_torch import tuning

    setting = tuning.current()
    if split is not None:
        setting = dataclasses.replace(setting, gradient_rounding="split" if split else "once")
    if rounding is not None:
        setting = dataclasses.replace(setting, gradient_rounding=rounding)
    if backward is not None:
        setting = dataclasses.replace(setting, triton_linear_backward=backward)
    with tuning.using(setting), static.hopper_target() as launches:
        static.drive_fused(launches, T, H, V, dtype, mode)
    label = mode + ("" if split is None else f",split={'on' if split else 'off'}") + (
        "" if rounding is None else f",{rounding}") + (
        "" if backward is None else f",{backward}")
    rows, fwd_flop = [], None
    mm_flop = sum(2 * m * n * k for (_, m, n, k, _) in launches.matmuls)
    figs = [(launch, static.analyse(launch, rerun_ptxas=True)) for launch in _unique(launches)]
    for launch, a in figs:
        if a["kernel"] == "linear_stats_kernel":
            fwd_flop = max((lp["counts"]["mma_flop"] for lp in a["each_loop"]), default=0)
    for launch, a in figs:
        r = _row(a, "fused", dtype, label, f"{T}x{H}x{V}")
        k = a["constexprs"]
        if a["kernel"] == "linear_grad_kernel":
            loops = a["each_loop"]
            r["atomics_per_kstep"] = max((lp["counts"]["atomic"] for lp in loops), default=0)
            if k.get("STORE_G"):  # G written per chunk; the products are the host's cuBLAS matmuls
                # "fixed" rounding: + the rank-1 residual terms, <= 3 slots x (dh + dW) x 2 T H
                fix_flop = 12 * T * H if k.get("FIX_G") else 0
                r["flop_per_8thv"] = round((4 * T * H * V + mm_flop + fix_flop) / (8 * T * H * V), 3)
                r["matmuls"] = len(launches.matmuls)
            else:
                prod = (2 if k.get("SPLIT_G") else 1) * (int(bool(k.get("NEED_DH"))) + int(bool(k.get("NEED_DW"))))
                r["flop_per_8thv"] = (2 + 2 + 2 * prod) / 8
                bwd_flop = sum(lp["counts"]["mma_flop"] for lp in loops)
                if fwd_flop:
                    r["mma_flop_ratio"] = round((fwd_flop + bwd_flop) / (4 * fwd_flop), 3)
        rows.append(r)
    return rows


def _cases(args):
    for T, V in LOGITS_SIZES:
        for dt in DTYPES:
            for mode in static.LOGITS_MODES:
                yield "logits", (T, V, dt, mode), {}
    for T, H, V in FUSED_SHAPES:
        for dt in DTYPES:
            modes = ["lp+ent"] if dt == "float32" else ["lp+ent", "lp+ent+keep"]
            for mode in modes:
                yield "fused", (T, H, V, dt, mode), {}
            if dt != "float32":  # the default G rounding ("fixed") above; the options
                yield "fused", (T, H, V, dt, "lp+ent"), {"rounding": "split"}
                yield "fused", (T, H, V, dt, "lp+ent"), {"rounding": "once"}
                yield "fused", (T, H, V, dt, "lp+ent"), {"backward": "atomic", "split": False}
            yield "fused", (T, H, V, dt, "lp+ent"), {"backward": "atomic"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-save", action="store_true", help="print only; do not append to static.csv")
    ap.add_argument("--only", choices=("logits", "fused"), help="one op's kernels only")
    args = ap.parse_args(argv)
    import triton

    stamp = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                 commit=_commit(), triton=triton.__version__)
    rows = []
    t0 = time.perf_counter()
    for op, case, kw in _cases(args):
        if args.only and op != args.only:
            continue
        got = logits_rows(*case) if op == "logits" else fused_rows(*case, **kw)
        for r in got:
            r.update(stamp)
            rows.append(r)
            print(" ".join(f"{k}={r.get(k, '')}" for k in FIELDS[3:] if r.get(k, "") != ""), flush=True)
    print(f"{len(rows)} rows in {time.perf_counter() - t0:.0f} s (triton {triton.__version__})", file=sys.stderr)
    if not args.no_save:
        new = not os.path.exists(CSV)
        if not new:
            with open(CSV) as f:
                head = f.readline().strip().split(",")
            if head != FIELDS:
                raise SystemExit(f"{CSV}: its columns {head} are not this script's {FIELDS}; not appending")
        with open(CSV, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore", lineterminator="\n")
            if new:
                w.writeheader()
            w.writerows(rows)
        print(f"appended {len(rows)} rows to {CSV}", file=sys.stderr)


if __name__ == "__main__":
    main()
