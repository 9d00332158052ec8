"""``dualvp bench``: the run.

For each (size, dtype) the driver makes the inputs (:mod:`.inputs`) and the
float64 oracle once, then starts worker processes (:mod:`.worker`, through
:mod:`.procs`) for the implementations (:data:`.implementations.IMPLS`), in
the plan's order. On a CPU each worker runs one implementation on one case,
so that the peak RSS it reports is its own (``--interleave``: the
implementations of a case at once, taking turns), and each case's inputs are
made when its turn comes; on a GPU (``--per-impl-workers``) one worker per
implementation runs every case (its peak memory is reset per call) while
background processes make the cases' inputs in order, each worker waiting
for a case's ``READY`` marker. The driver compares each record's outputs
with the oracle as the record arrives, prints a line, and appends its row to
the results file (:mod:`.results`) at once; an implementation that fails or
cannot run becomes a row with the error (``note``) and the run goes on.
Then the implementations marked ``gloo`` run on W ranks
of a gloo group (``--worlds``; on a GPU the W ranks share it) with their
collectives counted. The copy bandwidth that sets each row's ``floor_ms`` is
measured once, at the start (:func:`.timing.copy_bandwidth`).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .. import _proc
from . import report, results, timing
from .implementations import IMPLS, MODES
from .inputs import Oracle, errors, make_inputs, round_logits
from .options import Plan, plan
from .procs import free_port, run_jobs, run_workers

__all__ = ["run"]


def _save_inputs(ddir: str, arrays: dict) -> None:
    """The arrays as ``ddir/<name>.npy``, then the ``READY`` marker the workers wait for."""
    os.makedirs(ddir, exist_ok=True)
    for k, v in arrays.items():
        np.save(os.path.join(ddir, k + ".npy"), v)
    open(os.path.join(ddir, "READY"), "w").close()


def _make_case_files(T: int, V: int, seed: int, dirs: dict) -> None:
    """The inputs of one size, saved once per dtype (``dirs``: dtype -> data directory), each directory
    marked ``READY`` once complete (a worker waits for it), or ``FAILED`` with the error. Run in a
    process of its own (:func:`_prepare_in_background`)."""
    try:
        inp = make_inputs(T, V, seed)
        z32 = inp.pop("logits")
        for dtype, ddir in dirs.items():
            _save_inputs(ddir, {"logits": round_logits(z32, dtype), **inp})
    except BaseException as e:
        for ddir in dirs.values():
            os.makedirs(ddir, exist_ok=True)
            with open(os.path.join(ddir, "FAILED"), "w") as f:
                f.write(f"{type(e).__name__}: {e}")
        raise


def _saved_oracle(ddir: str, err_rows: int) -> Oracle:
    """The oracle of a case whose inputs are on disk (memory-mapped: it reads only its first rows)."""
    arr = {k: np.load(os.path.join(ddir, k + ".npy"), mmap_mode="r") for k in ("logits", "target", "keep", "gl", "gh")}
    return Oracle(arr, arr.pop("logits"), err_rows)


@dataclass
class _Case:
    index: int
    T: int
    V: int
    dtype: str
    data_dir: str
    _oracle: Optional[Oracle] = None
    future: Optional[Future] = None  # the background preparation of its inputs, if any
    err_rows: int = 0

    def spec(self, out_dir: str) -> dict:
        return dict(index=self.index, T=self.T, V=self.V, dtype=self.dtype, data_dir=self.data_dir, out_dir=out_dir)

    def oracle(self) -> Oracle:
        """The float64 oracle (waits for the inputs; raises their preparation's error)."""
        if self._oracle is None:
            self.future.result()
            self._oracle = _saved_oracle(self.data_dir, self.err_rows)
        return self._oracle

    def label(self) -> str:
        return f"{self.T}x{self.V} {self.dtype}"


@dataclass
class _Run:
    """State shared by the steps of one bench run."""

    args: object
    plan: Plan
    work: str
    env: dict
    bandwidth: float
    records: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    written: int = 0  # rows already appended to the results file
    failures: list = field(default_factory=list)
    skipped: dict = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)  # the workers' reader threads judge records

    def job(self, impl: str, cases: list, **overrides) -> dict:
        """The job file of one worker (see :mod:`.worker`)."""
        big = max(c["T"] * c["V"] for c in cases)
        job = dict(impl=impl, cases=cases, modes=self.plan.modes_of(impl), reps=self.plan.reps_for(big, 1),
                   warmup=self.plan.warmup, loop=self.plan.loop, err_rows=self.args.err_rows,
                   options=self.plan.options.get(impl, {}), port=None, device=self.plan.device,
                   wait_s=self.args.worker_timeout)
        job.update(overrides)
        if job["port"] is None and IMPLS[impl].process_group:
            job["port"] = free_port()
        return job

    def add(self, rec: dict, errs: dict) -> None:
        """One result: printed, kept, made a row of the results file and written."""
        with self.lock:
            rec["errors"] = errs
            self.records.append(rec)
            print(report.row(rec), flush=True)
            self.rows.append(self.row(rec, errs))
            self.flush()

    def row(self, rec: dict, errs: dict) -> dict:
        masked = MODES[rec["mode"]].masked
        mask_bytes = rec["T"] * rec["V_local"] if masked else 0
        return dict(self.env, impl=rec["impl"], op="logits", dtype=rec["dtype"], mode=rec["mode"], T=rec["T"],
                    V_local=rec["V_local"], W=rec.get("world", 1), wall_ms=rec["wall_ms"], fwd_ms=rec["fwd_ms"],
                    bwd_ms=rec["bwd_ms"], kernel_ms=rec.get("kernel_ms"), queued_ms=rec.get("queued_ms"),
                    host_us=rec.get("host_us"), launches=rec.get("launches"), first_ms=rec.get("first_ms"),
                    peak_extra_B=rec.get("peak_extra_B"),
                    floor_ms=timing.floor_ms(rec["B"], self.bandwidth, mask_bytes),
                    err_logprob=errs.get("logprob"), err_entropy=errs.get("entropy"), err_grad=errs.get("grad"),
                    reps=rec.get("reps"))

    def flush(self) -> None:
        """Append the rows not yet written (after every result: a run cut short keeps its rows)."""
        with self.lock:
            path = self.args.results or results.default_path(self.plan.device)
            if path != "none" and len(self.rows) > self.written:
                results.append(path, self.rows[self.written:])
                self.written = len(self.rows)

    def note(self, impl: str, note: str, case: Optional[_Case] = None, mode: Optional[str] = None, W: int = 1,
             V_local: Optional[int] = None) -> None:
        """A row without figures: why ``impl`` has none for this case (an error, or why it was skipped)."""
        with self.lock:
            self.rows.append(dict(self.env, impl=impl, op="logits", dtype=case.dtype if case else None, mode=mode,
                                  T=case.T if case else None, V_local=V_local or (case.V if case else None), W=W,
                                  note=note[:300]))
            self.flush()

    def fail(self, impl: str, where: str, error: str, cases: tuple = (None,), modes: tuple = (None,),
             W: int = 1, V_local: Optional[int] = None) -> None:
        """A failure: printed, listed, and a row per case and mode it left without figures."""
        self.failures.append({"impl": impl, "where": where, "error": error})
        print(f"  ! {impl} {where}: {error}", flush=True)
        for c in cases:
            for m in modes:
                self.note(impl, f"error: {error}", c, m, W, V_local)


def _oracle_first(oracle: Oracle, modes: list, what: str) -> None:
    # the oracle first, so that it never competes with a worker for the CPU
    t = time.monotonic()
    for m in modes:
        oracle.forward(MODES[m].masked)
        oracle.grad(MODES[m].masked, MODES[m].entropy_grad)
    print(f"  (inputs and float64 oracle for {what}: {time.monotonic() - t:.0f}s)", flush=True)


def _run_impls(run: _Run, groups: list, cases: list) -> None:
    """Each group of implementations at once (one worker each) over ``cases``.

    Each record is judged against the oracle as it arrives and its row written at once; an
    implementation that fails (any exception in its worker, its exit, a timeout) or cannot run
    here becomes a row with the error for every case and mode it left without figures, and the
    run goes on.
    """
    for impls in groups:
        outd = {(i, c.index): os.path.join(run.work, f"out_{i}_{c.index}") for i in impls for c in cases}
        for d in outd.values():
            os.makedirs(d)
        done: set = set()  # (impl, case index, mode) with a result or a row saying why not
        by_case = {c.index: c for c in cases}

        def on_record(rec, job):
            impl = job["impl"]
            if rec["kind"] == "unavailable":
                run.skipped[impl] = rec["why"]
                print(f"skipping {impl}: {rec['why']}", flush=True)
                for c in cases:
                    run.note(impl, f"skipped: {rec['why']}", c)
                    done.update((impl, c.index, m) for m in run.plan.modes_of(impl))
                return
            c = by_case[rec["case"]]
            done.add((impl, c.index, rec["mode"]))
            report.progress(f"  {impl} {rec['T']}x{rec['V_local']} {rec['dtype']} {rec['mode']}: "
                            f"{rec['wall_ms']:.2f} ms")
            try:
                i = run.plan.modes_of(impl).index(rec["mode"])
                with np.load(os.path.join(outd[impl, c.index], f"out_{i}_r0.npz")) as o:
                    e = errors(c.oracle(), rec["mode"], o["lp"], o["h"], o["g"])
            except Exception as ex:  # the oracle's inputs or the worker's outputs: the row says so
                run.fail(impl, c.label(), f"judging: {type(ex).__name__}: {ex}", (c,), (rec["mode"],))
                return
            report.progress("")
            run.add(rec, e)

        jobs = [run.job(i, [c.spec(outd[i, c.index]) for c in cases]) for i in impls]
        errs = run_jobs(jobs, run.work, run.args.worker_timeout * len(jobs) * len(cases), on_record,
                        interleave=len(jobs) > 1)
        report.progress("")
        for job, e in errs:
            impl = job["impl"]
            left = [c for c in cases if any((impl, c.index, m) not in done for m in job["modes"])]
            for c in left:
                run.fail(impl, c.label(), e, (c,), tuple(m for m in job["modes"] if (impl, c.index, m) not in done))
            if not left:
                run.fail(impl, ", ".join(c.label() for c in cases), e, (), ())
        for d in outd.values():
            shutil.rmtree(d, ignore_errors=True)
        run.flush()


def _cases_of_size(run: _Run, T: int, V: int, first_index: int) -> list:
    inp = make_inputs(T, V, run.args.seed)
    z32 = inp.pop("logits")
    out = []
    for k, dtype in enumerate(run.plan.dtypes):
        ddir = os.path.join(run.work, f"data_{T}x{V}_{dtype}")
        z = round_logits(z32, dtype)
        _save_inputs(ddir, {"logits": z, **inp})
        case = _Case(first_index + k, T, V, dtype, ddir, Oracle(inp, z, run.args.err_rows))
        _oracle_first(case.oracle(), run.plan.modes, case.label())
        out.append(case)
    return out


def _prepare_in_background(run: _Run, pool) -> list:
    """Every (size, dtype) case, its inputs made by ``pool`` (one task per size, in order): workers
    start at once and wait for each case's ``READY`` marker; the oracle is read when judging."""
    cases: list = []
    for T, V in run.plan.sizes:
        dirs = {d: os.path.join(run.work, f"data_{T}x{V}_{d}") for d in run.plan.dtypes}
        fut = pool.submit(_make_case_files, T, V, run.args.seed, dirs)
        for d, ddir in dirs.items():
            cases.append(_Case(len(cases), T, V, d, ddir, future=fut, err_rows=run.args.err_rows))
    return cases


def _bench_sizes(run: _Run) -> None:
    """Every implementation at every (size, dtype)."""
    p = run.plan
    if not p.sizes:
        return
    if p.per_impl_workers:  # one worker per implementation, all cases (a GPU: imports and compiles once)
        # processes, not threads: making the inputs is NumPy work that would hold the GIL from the
        # workers' reader threads; one per size, up to half the cores (the workers need the rest)
        n = max(1, min(len(p.sizes), (os.cpu_count() or 2) // 2))
        pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"))
        try:
            cases = _prepare_in_background(run, pool)
            _run_impls(run, [[i] for i in p.impls], cases)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return
    groups = [p.impls] if run.args.interleave else [[i] for i in p.impls]
    n = 0
    for T, V in p.sizes:
        for case in _cases_of_size(run, T, V, n):
            _run_impls(run, groups, [case])
            shutil.rmtree(case.data_dir, ignore_errors=True)
            n += 1


def _bench_worlds(run: _Run, W: int) -> None:
    """The ``gloo`` implementations on W ranks (sharing the GPU with --device cuda): rows and collectives."""
    gT, gV = run.plan.gloo_size
    V = gV * W
    inp = make_inputs(gT, V, run.args.seed + W)
    ddir = os.path.join(run.work, f"data_gloo_{W}")
    _save_inputs(ddir, inp)
    where = _Case(0, gT, V, "float32", ddir)  # for the rows of failures
    cuda = run.plan.device == "cuda"
    err_rows = min(gT, run.args.err_rows) if cuda else gT
    oracle = Oracle(inp, inp["logits"].astype(np.float64), err_rows)
    for impl in run.plan.gloo_impls:
        outd = os.path.join(run.work, f"out_gloo_{impl}_{W}")
        os.makedirs(outd)
        port = free_port()
        case = dict(index=0, T=gT, V=V, dtype="float32", data_dir=ddir, out_dir=outd)
        over = dict(reps=run.plan.reps, warmup=run.plan.warmup, loop=run.plan.loop) if cuda else \
            dict(reps=1, warmup=0, loop=1, threads=1)
        jobs = [run.job(impl, [case], world=W, rank=r, port=port, err_rows=err_rows, **over) for r in range(W)]
        got: dict = {}

        def on_record(rec, job, got=got, impl=impl):
            if rec["kind"] == "unavailable":
                print(f"skipping {impl} at W={W}: {rec['why']}", flush=True)
                if job.get("rank", 0) == 0:
                    run.note(impl, f"skipped: {rec['why']}", where, W=W, V_local=gV)
            else:
                got.setdefault(rec["mode"], {})[rec["rank"]] = rec

        errs = run_workers(jobs, run.work, run.args.worker_timeout, on_record)
        if errs:  # one row per mode left without figures, with the first rank's error
            more = f" (and {len(errs) - 1} more ranks)" if len(errs) > 1 else ""
            left = tuple(m for m in run.plan.modes_of(impl) if len(got.get(m, {})) != W)
            run.fail(impl, f"W={W}", errs[0] + more, (where,), left or (None,), W=W, V_local=gV)
        for i, mode in enumerate(run.plan.modes_of(impl)):
            ranks = got.get(mode, {})
            if len(ranks) != W:
                continue
            outs = [dict(np.load(os.path.join(outd, f"out_{i}_r{r}.npz"))) for r in range(W)]
            g = np.concatenate([o["g"] for o in outs], axis=-1)
            rec = ranks[0]
            c0 = rec.get("collectives")
            rec["ranks_agree"] = all(ranks[r].get("collectives") == c0 for r in range(W))
            run.add(rec, errors(oracle, mode, outs[0]["lp"], outs[0]["h"], g))
            report.print_collectives(rec)
        shutil.rmtree(outd, ignore_errors=True)
        run.flush()
    shutil.rmtree(ddir, ignore_errors=True)


def _raise_on_sigterm() -> None:
    def _term(signum, frame):  # so that the caller's `finally` removes the inputs
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        signal.signal(signal.SIGTERM, _term)
    except ValueError:  # not the main thread
        pass


def _finish(run: _Run, t_start: float) -> int:
    path = run.args.results or results.default_path(run.plan.device)
    if path != "none" and run.rows:
        print(f"\nappended {run.written} rows to {path}")
    if run.args.out:
        doc = {"meta": dict(run.env, command=" ".join(sys.argv), bandwidth_Bps=run.bandwidth,
                            elapsed_s=time.monotonic() - t_start, skipped=run.skipped,
                            plan={k: v for k, v in vars(run.plan).items() if k != "options"}),
               "results": run.records, "rows": run.rows, "failures": run.failures}
        os.makedirs(os.path.dirname(os.path.abspath(run.args.out)), exist_ok=True)
        with open(run.args.out, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        print(f"wrote {run.args.out}")
    print(f"floor_ms: 3 B + the mask's bytes twice at {run.bandwidth / 1e9:.1f} GB/s (copy bandwidth measured "
          f"at the start); memory: {report.memory_method(run.plan.device)}")
    return 1 if run.failures else 0


def run(args) -> int:
    """Entry point of ``dualvp bench``; returns the exit status."""
    if args.report:
        print(results.markdown(results.read(args.report)))
        return 0
    if args.device == "cuda":
        # before planning (which may probe JAX in a child) or starting any worker
        why = _proc.cuda_problem(1)
        if why:
            print(f"dualvp bench: {why}", file=sys.stderr)
            return 2
    if args.op == "linear":
        from . import linear

        return linear.run_args(args)
    try:
        p = plan(args)
    except ValueError as e:
        print(f"dualvp bench: {e}", file=sys.stderr)
        return 2
    for impl, why in p.skipped.items():
        print(f"skipping {impl}: {why}")
    t_start = time.monotonic()
    run_ = _Run(args, p, tempfile.mkdtemp(prefix="dualvp-bench-"), results.environment(p.device),
                timing.copy_bandwidth(p.device), skipped=dict(p.skipped))
    _raise_on_sigterm()
    try:
        if p.explicit:  # named but unable to run on this device: a row says why
            for impl, why in p.skipped.items():
                if not why.startswith("runs on "):
                    run_.note(impl, f"skipped: {why}")
        print(f"dualvp bench: sizes {p.sizes}, dtypes {p.dtypes}, impls {p.impls}, modes {p.modes}, "
              f"on {run_.env['device']}")
        print(report.header())
        _bench_sizes(run_)
        if p.worlds and p.gloo_impls:
            print(f"\nW ranks over gloo (T={p.gloo_size[0]}, V_local={p.gloo_size[1]} per rank, float32"
                  + ("; the ranks share the GPU" if p.device == "cuda" else "") + ")")
            for W in p.worlds:
                _bench_worlds(run_, W)
    finally:
        shutil.rmtree(run_.work, ignore_errors=True)
        run_.flush()
    return _finish(run_, t_start)
