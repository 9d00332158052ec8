"""``dualvp bench``: the options and the run loop.

For each (size, dtype) the driver makes the inputs (:mod:`.inputs`) and the
float64 oracle once, then starts one worker process per implementation
(:mod:`.worker`; the implementations are :data:`.implementations.IMPLS`), so
the peak memory each reports is its own; it compares each worker's outputs
with the oracle after the worker has exited (no CPU competition while it
times), prints the table while it runs, and writes a JSON file and a PNG
chart (:mod:`.report`). With ``--interleave`` the workers of a (size,
dtype) start at once and take turns (:func:`_hand_turns`): one computes at a
time and their timed calls alternate, so that a shared machine's slow and
fast phases fall on every implementation alike. Then the implementations
marked ``gloo`` run on W gloo ranks to count their collectives per call.

``--device cuda`` (W = 1 on one GPU): the torch workers run on the GPU
(timers read after ``torch.cuda.synchronize()``, memory from
``torch.cuda.max_memory_allocated``: :data:`CUDA_MEMORY_METHOD`); the JAX
implementations run only when JAX has a GPU backend (checked once in a probe
process), else they are skipped with a one-line note; the gloo collectives
run is CPU-only and is skipped. Without CUDA the command exits 2 before it
starts anything.

Timing: wall clock of forward and backward separately, median over ``reps``
calls after the first call (reported apart as ``first_call_s``: it includes
compilation) and ``warmup`` untimed calls. ``fwdbwd_s`` is the median of the
per-call sums.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from .. import _proc
from . import report
from .implementations import IMPLS, MODES, locate
from .inputs import TOPK, Oracle, errors, make_inputs, round_logits

__all__ = ["add_arguments", "run", "run_workers", "MEMORY_METHOD", "CUDA_MEMORY_METHOD"]

MEMORY_METHOD = (
    "peak extra RSS of one forward+backward in the implementation's own process: "
    "after gc.collect() and malloc_trim(0), the kernel's peak-RSS counter is reset "
    "(echo 5 > /proc/self/clear_refs); extra = VmHWM after the call - VmRSS before it. "
    "Inputs are allocated before; the returned gradient counts. Reported as a multiple of "
    "B = bytes of the logits (shard) in their dtype. dualvp-torch-inplace gets non-leaf logits "
    "(a copy made by an autograd node before the measured call, as an LM head's output exists "
    "before the op); its gradient overwrites them."
)
CUDA_MEMORY_METHOD = (
    "peak extra CUDA memory of one forward+backward in the implementation's own process: after "
    "gc.collect() and torch.cuda.synchronize(), torch.cuda.reset_peak_memory_stats(); extra = "
    "torch.cuda.max_memory_allocated() after the call (synchronized) - torch.cuda.memory_allocated() before it. "
    "Inputs are allocated before; the returned gradient counts; as a multiple of B. JAX on a GPU: not measured."
)
TIMING_METHOD = (
    "wall clock (perf_counter), median of reps after the first call and warm-up; first_call_s "
    "includes compile; cpu_fwdbwd_s = process CPU time of fwd+bwd (all threads), median"
)
INTERLEAVE_METHOD = (
    "interleaved: the implementations of each (size, dtype) ran at once in their own processes, taking "
    "turns (one computed at a time: each worker's start, compile and first calls in one turn, then one "
    "turn per timed call, round robin), so that their timed calls alternate"
)
ERROR_METHOD = (
    "max abs error vs float64 dualvp.reference on the dtype-rounded inputs; log-prob and entropy "
    "over all rows, gradient over the first --err-rows rows (default 256)"
)


# --------------------------------------------------------------------------- options


_DEFAULT_OUT = "bench-results/bench.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``dualvp bench`` options."""
    p.add_argument("--quick", action="store_true", help="tiny size, float32, few reps (about a minute)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cpu, or cuda: W=1 on one GPU (torch workers on the GPU, memory from "
                        "torch.cuda.max_memory_allocated; JAX only if it has a GPU backend; no gloo run)")
    p.add_argument("--op", default="logits", choices=["logits", "linear"],
                   help="logits: the op on logits shards (default); linear: the fused LM-head op vs its baselines "
                        "(dualvp.tools.bench.linear; uses --T, --hidden, --V, --dtypes, --impls, --reps, --slime-path, --out)")
    p.add_argument("--T", type=int, default=2048, help="--op linear: tokens")
    p.add_argument("--hidden", type=int, default=1024, help="--op linear: hidden size H")
    p.add_argument("--V", type=int, default=32000, help="--op linear: V_local, rows of the weight shard")
    p.add_argument("--sizes", default=None, help="comma list of TxV_local (default 2048x32000,2048x152064)")
    p.add_argument("--dtypes", default=None, help="comma list of float32,bfloat16 (default both)")
    listing = "; ".join(f"{i.name}: {i.about}" for i in IMPLS.values())
    p.add_argument("--impls", default=None, help=f"comma list of implementations (default all available): {listing}")
    p.add_argument("--modes", default=None, help=f"comma list of {','.join(MODES)} (default all)")
    p.add_argument("--slime-path", default=None, metavar="DIR",
                   help="a slime checkout (DIR/slime/utils/ppo_utils.py) for the 'slime' implementation "
                   "(default: an importable slime, else slime is skipped)")
    p.add_argument("--reps", type=int, default=None, help="timed calls per mode (default 3; 2 for >1e8 elements)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls after the first, untimed one (default 0)")
    p.add_argument("--worlds", default=None, help="comma list of gloo world sizes W>1 for the collectives run "
                   "(default 2,4; 'none' to skip)")
    p.add_argument("--gloo-size", default=None, help="TxV_local of the gloo run (default 256x4096)")
    p.add_argument("--err-rows", type=int, default=256, help="rows whose gradient is compared with float64")
    p.add_argument("--out", default=_DEFAULT_OUT, help="JSON path; the PNG goes next to it")
    p.add_argument("--png", default=None, help="chart path (default: --out with .png)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", default=None, metavar="JSON",
                   help="print the Markdown tables of an existing result file (no run)")
    p.add_argument("--worker-timeout", type=float, default=1800.0, help="seconds per worker process")
    p.add_argument("--interleave", action="store_true",
                   help="run the implementations of each (size, dtype) at once, in their own processes, "
                   "taking turns: one computes at a time and their timed calls alternate, so that all see "
                   "the same phases of a shared machine's load (all their inputs and buffers are resident "
                   "together)")


def _split(s: Optional[str], default) -> list:
    if s is None:
        return list(default)
    return [x.strip() for x in s.split(",") if x.strip()]


def _size(s: str) -> tuple[int, int]:
    t, v = s.lower().split("x")
    return int(t), int(v)


@dataclass
class _Plan:
    """What one run does, from the options."""

    sizes: list
    dtypes: list
    modes: list
    impls: list  # the ones that run here
    skipped: dict  # impl -> why not
    options: dict  # impl -> options for its workers (from `locate`)
    worlds: list
    gloo_size: tuple
    reps: Optional[int]
    warmup: int
    quick: bool
    device: str = "cpu"
    gloo_impls: list = field(default_factory=list)

    def reps_for(self, T: int, V: int) -> int:
        if self.reps is not None:
            return self.reps
        return 2 if T * V > 1e8 or self.quick else 3


def _plan(args) -> _Plan:
    """The plan, or ``ValueError`` naming the bad option value."""
    q = args.quick
    sizes = [_size(s) for s in _split(args.sizes, ["64x2048"] if q else ["2048x32000", "2048x152064"])]
    dtypes = _split(args.dtypes, ["float32"] if q else ["float32", "bfloat16"])
    modes = _split(args.modes, MODES)
    impls = _split(args.impls, IMPLS)
    for name, vals, allowed in (("dtype", dtypes, ("float32", "bfloat16")), ("mode", modes, MODES),
                                ("impl", impls, IMPLS)):
        bad = [v for v in vals if v not in allowed]
        if bad:
            raise ValueError(f"unknown {name} {bad}; expected {list(allowed)}")
    found = {i: locate(IMPLS[i], args) for i in impls}
    device = getattr(args, "device", "cpu")
    if device == "cuda":
        jax_impls = [i for i in impls if IMPLS[i].framework == "jax" and isinstance(found[i], dict)]
        why = _jax_gpu_problem() if jax_impls else None
        for i in jax_impls if why else ():
            found[i] = why
    run_impls = [i for i in impls if isinstance(found[i], dict)]
    plan = _Plan(
        sizes=sizes, dtypes=dtypes, modes=modes, impls=run_impls,
        skipped={i: why for i, why in found.items() if isinstance(why, str)},
        options={i: found[i] for i in run_impls},
        # the collectives run is gloo on the CPU: not part of a --device cuda run
        worlds=[] if args.worlds == "none" or device == "cuda" else
        [int(w) for w in _split(args.worlds, ["2"] if q else ["2", "4"])],
        gloo_size=_size(args.gloo_size or ("32x512" if q else "256x4096")),
        reps=args.reps, warmup=args.warmup or 0, quick=q, device=device,
    )
    # dualvp on gloo ranks runs eager: the collectives are outside the compiled kernels
    dualvp_run = any(i.startswith("dualvp-torch") for i in run_impls)
    plan.gloo_impls = [i for i in IMPLS if IMPLS[i].gloo and (i in run_impls or
                                                               (i == "dualvp-torch-eager" and dualvp_run))]
    return plan


def _jax_gpu_problem() -> Optional[str]:
    """``None`` when JAX has a GPU backend here, else why not (probed in a child: JAX would
    otherwise take GPU memory in this process for the whole run)."""
    code = "import jax; print(len(jax.devices('gpu')))"
    try:
        p = subprocess.run([sys.executable, "-c", code], env=_proc.child_env(1, {"JAX_PLATFORMS": "cuda"}),
                           capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "jax GPU probe timed out (120 s)"
    if p.returncode == 0:
        return None
    last = (p.stderr.strip().splitlines() or ["?"])[-1][:200]
    return f"jax has no GPU backend (jax.devices('gpu') failed: {last})"


# --------------------------------------------------------------------------- environment


def _version(mod: str) -> Optional[str]:
    try:
        from importlib.metadata import version

        return version(mod)
    except Exception:
        return None


def _git() -> Optional[str]:
    """``<short rev>[+dirty]`` of the checkout this dualvp runs from, if it is one."""
    root = _proc._ROOT
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "dualvp", "dualvp_torch",
                                "dualvp_jax"], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev + ("+dirty" if dirty else "")) or None
    except Exception:
        return None


def _machine() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_bytes": mem,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "jax": _version("jax"),
        "numpy": np.__version__,
        "megatron-core": _version("megatron-core"),
        "gpu": None,
        # fresh buffers' page faults are a large part of CPU times here (README, "Benchmark"): the
        # transparent-huge-page policy and glibc's tunables change every result; in a VM whose
        # balloon reports free pages of this order (9: 2 MiB) to the host, a huge-page fault may
        # land on a reported block that the host must fault in again, and fresh-buffer times swing
        "transparent_hugepage": _first_line("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_defrag": _first_line("/sys/kernel/mm/transparent_hugepage/defrag"),
        "page_reporting_order": _first_line("/sys/module/page_reporting/parameters/page_reporting_order"),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE"),
    }


def _first_line(path: str):
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:
        return None


def _meta(args, plan: _Plan) -> dict:
    argv = sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]
    cuda = plan.device == "cuda"
    return {
        "command": "python -m dualvp bench " + " ".join(argv),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "git": _git(),
        "machine": _machine(),
        "sizes": [{"T": t, "V_local": v} for t, v in plan.sizes],
        "dtypes": plan.dtypes,
        "modes": plan.modes,
        "impls": plan.impls,
        "skipped": plan.skipped,
        "device": plan.device,
        "memory_method": CUDA_MEMORY_METHOD if cuda else MEMORY_METHOD,
        "timing_method": TIMING_METHOD + ("; on the GPU torch.cuda.synchronize() before every clock read" if cuda
                                          else "") + ("; " + INTERLEAVE_METHOD if args.interleave else ""),
        "interleave": bool(args.interleave),
        "error_method": ERROR_METHOD,
        "inputs": f"confident-LM logits N(10,3) + three +25 spikes per row; target sampled from softmax; "
                  f"keep mask = top-{TOPK} (+ target); upstream grads N(0,1); seed {args.seed}",
        "notes": ("one GPU (W=1), inputs made and oracle run on the CPU; no gloo collectives run" if cuda else
                  "CPU only; the machine may be shared, so timings are noisy."),
    }


# --------------------------------------------------------------------------- workers


def _worker_env(impl: str, device: str = "cpu") -> dict:
    # one host device for JAX in the workers, whatever the caller set; JAX on the GPU only for
    # --device cuda, and then without preallocating most of the GPU's memory
    gpu = {"JAX_PLATFORMS": "cuda", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"} if device == "cuda" else \
        {"JAX_PLATFORMS": "cpu"}
    return _proc.child_env(1, {"DUALVP_COMPILE": None, **gpu, **IMPLS[impl].env,
                               "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", "ignore")})


def _pump(p: subprocess.Popen, job: dict, errs: list, on_record: Callable,
          on_turn: Optional[Callable[[str], None]] = None) -> None:
    """Read a worker's stdout: ``@@`` lines are records, the rest is log.

    ``on_turn("yield")`` when the worker ends a turn of an interleaved run,
    ``on_turn("exit")`` when its stdout closes.
    """
    for line in p.stdout:
        if not line.startswith("@@"):
            continue
        rec = json.loads(line[2:])
        if rec["kind"] == "yield":
            if on_turn is not None:
                on_turn("yield")
            continue
        if rec["kind"] != "error":
            on_record(rec, job)
            continue
        errs.append((job, rec["error"]))
        if rec.get("traceback"):
            print(rec["traceback"], file=sys.stderr)
    if on_turn is not None:
        on_turn("exit")


def _exit_error(p: subprocess.Popen, log_path: str) -> str:
    with open(log_path) as f:
        tail = f.read()[-2000:].strip()
    return f"exit code {p.returncode}: {tail.splitlines()[-1] if tail else ''}"


def _hand_turns(procs: list, events: "queue.Queue") -> None:
    """Round-robin turns for interleaved workers: one of them computes at a time.

    The turn goes to each live worker in order (a line on its stdin); it ends
    with the worker's ``yield`` record or its exit (``events``: ``(index,
    what)``). A worker takes one turn to start (import, data, compile) and
    then one per timed call (:class:`dualvp.tools.bench.worker.Turns`), so
    the timed calls of the group alternate and none shares the CPU with
    another worker's work.
    """
    live = set(range(len(procs)))
    i = 0
    while live:
        while i not in live:
            i = (i + 1) % len(procs)
        try:
            procs[i].stdin.write("go\n")
            procs[i].stdin.flush()
        except (BrokenPipeError, OSError, ValueError):  # it has exited already
            live.discard(i)
            continue
        while True:
            j, what = events.get()
            if what == "exit":
                live.discard(j)
            if j == i:
                break
        i = (i + 1) % len(procs)


def _run_jobs(jobs: list[dict], work: str, timeout: float, on_record: Callable,
              interleave: bool = False) -> list[tuple[dict, str]]:
    """:func:`run_workers`, with each error paired with its worker's job."""
    procs = []
    for i, job in enumerate(jobs):
        path = os.path.join(work, f"job_{i}.json")
        with open(path, "w") as f:
            json.dump(dict(job, interleave=interleave), f)
        log = open(os.path.join(work, f"worker_{job['impl']}_{i}.log"), "w")
        p = _proc.start_python(["-m", "dualvp.tools.bench.worker", path],
                               _worker_env(job["impl"], job.get("device", "cpu")),
                               stdout=subprocess.PIPE, stderr=log,
                               stdin=subprocess.PIPE if interleave else subprocess.DEVNULL)
        procs.append((p, log, job))
    errs: list = []
    deadline = time.monotonic() + timeout
    events: "queue.Queue" = queue.Queue()
    turn = (lambda i: (lambda what: events.put((i, what)))) if interleave else (lambda i: None)
    threads = [threading.Thread(target=_pump, args=(p, j, errs, on_record, turn(i)), daemon=True)
               for i, (p, _, j) in enumerate(procs)]
    if interleave:
        threads.append(threading.Thread(target=_hand_turns, args=([p for p, _, _ in procs], events), daemon=True))
    for t in threads:
        t.start()
    for (p, log, job), t in zip(procs, threads):
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            errs.append((job, f"timeout after {timeout:.0f}s"))
        except BaseException:  # interrupted: take the workers down with us
            for q, _, _ in procs:
                q.kill()
            raise
        t.join(timeout=10)
        log.close()
        if p.stdin is not None:
            p.stdin.close()
        if p.returncode not in (0, None) and not any(j is job for j, _ in errs):
            errs.append((job, _exit_error(p, log.name)))
    return errs


def run_workers(jobs: list[dict], work: str, timeout: float, on_record: Callable,
                interleave: bool = False) -> list[str]:
    """Start one worker per job, all at once (the ranks of one gloo group, or
    the implementations of one (size, dtype)); stream their records to
    ``on_record(rec, job)``; return error strings.

    ``interleave``: the workers take turns (:func:`_hand_turns`): one computes
    at a time, and their timed calls alternate, so that every implementation
    sees the same phases of a shared machine's load. ``timeout`` is for all
    of them together.
    """
    return [msg for _, msg in _run_jobs(jobs, work, timeout, on_record, interleave)]


def _free_port() -> int:
    from dualvp_torch.testing import free_port  # only torch workers need a port

    return free_port()


# --------------------------------------------------------------------------- the run


def _save_inputs(ddir: str, arrays: dict) -> None:
    os.makedirs(ddir)
    for k, v in arrays.items():
        np.save(os.path.join(ddir, k + ".npy"), v)


@dataclass
class _Run:
    """State shared by the steps of one bench run."""

    args: argparse.Namespace
    plan: _Plan
    doc: dict
    work: str
    t_start: float
    jobs_done: int = 0

    def job(self, impl: str, T: int, V: int, dtype: str, data_dir: str, out_dir: str, **overrides) -> dict:
        """The job file of one worker (see :mod:`.worker`)."""
        job = dict(impl=impl, T=T, V=V, dtype=dtype, modes=self.plan.modes, reps=self.plan.reps_for(T, V),
                   warmup=self.plan.warmup, data_dir=data_dir, out_dir=out_dir, err_rows=self.args.err_rows,
                   options=self.plan.options.get(impl, {}), port=None, device=self.plan.device)
        job.update(overrides)
        if job["port"] is None and IMPLS[impl].process_group:
            job["port"] = _free_port()
        return job

    def write(self, complete: bool = False) -> None:
        report.write_json(self.doc, self.args.out, self.t_start, complete)


def _oracle_first(oracle: Oracle, modes: list, what: str) -> None:
    # the oracle first, so that it never competes with a worker for the CPU
    t = time.monotonic()
    for m in modes:
        oracle.forward(MODES[m].masked)
        oracle.grad(MODES[m].masked, MODES[m].entropy_grad)
    print(f"  (float64 oracle for {what}: {time.monotonic() - t:.0f}s)", flush=True)


def _bench_impls(run: _Run, impls: list, T: int, V: int, dtype: str, ddir: str, oracle: Oracle) -> None:
    """Implementations on one (size, dtype), each in its own process: one
    implementation per call, or (``--interleave``) all of them at once,
    taking turns."""
    outd = {impl: os.path.join(run.work, f"out_{impl}_{T}x{V}_{dtype}") for impl in impls}
    got: dict = {impl: [] for impl in impls}

    def on_record(rec, job):
        got[job["impl"]].append(rec)
        if rec.get("gpu") and not run.doc["meta"]["machine"]["gpu"]:
            run.doc["meta"]["machine"]["gpu"] = rec["gpu"]
        report.progress(f"  {job['impl']} {T}x{V} {dtype} {rec['mode']}: f+b {rec['fwdbwd_s']:.3f}s")

    jobs = []
    for impl in impls:
        os.makedirs(outd[impl])
        jobs.append(run.job(impl, T, V, dtype, ddir, outd[impl]))
    errs = _run_jobs(jobs, run.work, run.args.worker_timeout * len(jobs), on_record, interleave=len(jobs) > 1)
    report.progress("")
    for impl in impls:
        for rec in got[impl]:
            with np.load(os.path.join(outd[impl], f"out_{run.plan.modes.index(rec['mode'])}_r0.npz")) as o:
                rec["errors"] = errors(oracle, rec["mode"], o["lp"], o["h"], o["g"])
            run.doc["results"].append(rec)
            print(report.row(rec), flush=True)
        for job, e in errs:
            if job["impl"] == impl:
                run.doc["failures"].append({"impl": impl, "T": T, "V_local": V, "dtype": dtype, "error": e})
                print(f"  ! {impl} {T}x{V} {dtype}: {e}", flush=True)
        run.jobs_done += 1
        shutil.rmtree(outd[impl], ignore_errors=True)
    n_jobs = len(run.plan.sizes) * len(run.plan.dtypes) * len(run.plan.impls)
    print(f"  [{run.jobs_done}/{n_jobs} done, {time.monotonic() - run.t_start:.0f}s]", flush=True)
    run.write()


def _bench_sizes(run: _Run) -> None:
    """Every implementation at every (size, dtype), one process each."""
    groups = [run.plan.impls] if run.args.interleave else [[impl] for impl in run.plan.impls]
    for T, V in run.plan.sizes:
        inp = make_inputs(T, V, run.args.seed)
        z32 = inp.pop("logits")
        for dtype in run.plan.dtypes:
            ddir = os.path.join(run.work, f"data_{T}x{V}_{dtype}")
            z = round_logits(z32, dtype)
            _save_inputs(ddir, {"logits": z, **inp})
            oracle = Oracle(inp, z, run.args.err_rows)
            _oracle_first(oracle, run.plan.modes, f"{T}x{V} {dtype}")
            for impls in groups:
                _bench_impls(run, impls, T, V, dtype, ddir, oracle)
            del oracle, z
            shutil.rmtree(ddir, ignore_errors=True)
        del z32, inp


def _gloo_entries(impl: str, W: int, gT: int, gV: int, outd: str, modes: list, got: dict, oracle: Oracle) -> list:
    """Collective counts and errors per mode of one gloo run (modes where every rank reported)."""
    entries = []
    for i, mode in enumerate(modes):
        ranks = got.get(mode, {})
        if len(ranks) != W:
            continue
        outs = [dict(np.load(os.path.join(outd, f"out_{i}_r{r}.npz"))) for r in range(W)]
        g = np.concatenate([o["g"] for o in outs], axis=-1)
        c0 = ranks[0]["collectives"]
        entries.append({"impl": impl, "world": W, "T": gT, "V_local": gV, "mode": mode, "per_call": c0,
                        "ranks_agree": all(ranks[r]["collectives"] == c0 for r in range(W)),
                        "errors": errors(oracle, mode, outs[0]["lp"], outs[0]["h"], g),
                        "fwdbwd_s": ranks[0]["fwdbwd_s"]})
    return entries


def _bench_gloo(run: _Run, W: int) -> None:
    """The ``gloo`` implementations on W ranks: collectives per call."""
    gT, gV = run.plan.gloo_size
    V = gV * W
    inp = make_inputs(gT, V, run.args.seed + W)
    ddir = os.path.join(run.work, f"data_gloo_{W}")
    _save_inputs(ddir, inp)
    oracle = Oracle(inp, inp["logits"].astype(np.float64), gT)
    for impl in run.plan.gloo_impls:
        outd = os.path.join(run.work, f"out_gloo_{impl}_{W}")
        os.makedirs(outd)
        port = _free_port()
        jobs = [run.job(impl, gT, V, "float32", ddir, outd, world=W, rank=r, port=port, threads=1, reps=1,
                        warmup=0, err_rows=gT, device="cpu") for r in range(W)]
        got: dict = {}

        def on_record(rec, job, got=got):
            got.setdefault(rec["mode"], {})[rec["rank"]] = rec

        for e in run_workers(jobs, run.work, run.args.worker_timeout, on_record):
            run.doc["failures"].append({"impl": impl, "world": W, "error": e})
            print(f"  ! {impl} W={W}: {e}", flush=True)
        for entry in _gloo_entries(impl, W, gT, gV, outd, run.plan.modes, got, oracle):
            run.doc["collectives"].append(entry)
            report.print_collectives(entry)
        shutil.rmtree(outd, ignore_errors=True)
    shutil.rmtree(ddir, ignore_errors=True)


def _raise_on_sigterm() -> None:
    def _term(signum, frame):  # so that the caller's `finally` removes the inputs
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        signal.signal(signal.SIGTERM, _term)
    except ValueError:  # not the main thread
        pass


def run(args) -> int:
    """Entry point of ``dualvp bench``; returns the exit status."""
    if args.report:
        with open(args.report) as f:
            print(report.markdown_report(json.load(f)))
        return 0
    if getattr(args, "device", "cpu") == "cuda":
        # before planning (which may probe JAX in a child) or starting any worker
        why = _proc.cuda_problem(1)
        if why:
            print(f"dualvp bench: {why}", file=sys.stderr)
            return 2
    if args.op == "linear":
        from . import linear

        if args.out == _DEFAULT_OUT:
            args.out = "bench-results/bench_linear.json"
        return linear.run_args(args)
    try:
        plan = _plan(args)
    except ValueError as e:
        print(f"dualvp bench: {e}", file=sys.stderr)
        return 2
    for impl, why in plan.skipped.items():
        print(f"skipping {impl}: {why}")
    if plan.device == "cuda" and args.worlds != "none":
        print("skipping the collectives run: it runs on gloo ranks on the CPU (use --device cpu)")
    out_png = args.png or os.path.splitext(args.out)[0] + ".png"
    doc = {"meta": _meta(args, plan), "results": [], "collectives": [], "failures": []}
    run_ = _Run(args, plan, doc, tempfile.mkdtemp(prefix="dualvp-bench-"), time.monotonic())
    _raise_on_sigterm()
    try:
        print(f"dualvp bench: sizes {plan.sizes}, dtypes {plan.dtypes}, impls {plan.impls}, modes {plan.modes}")
        print(report.header())
        _bench_sizes(run_)
        if plan.worlds and plan.gloo_impls:
            print(f"\ncollectives per call on W gloo ranks (T={plan.gloo_size[0]}, V_local={plan.gloo_size[1]}, "
                  "float32; dualvp with DUALVP_COMPILE=0: the collectives are outside the compiled kernels)")
            for W in plan.worlds:
                _bench_gloo(run_, W)
    finally:
        shutil.rmtree(run_.work, ignore_errors=True)
    run_.write(complete=True)
    note = report.chart(doc, out_png)
    report.print_goals(doc)
    print(f"\nwrote {args.out}" + (f" and {out_png}" if note is None else f" ({note})"))
    print(f"memory: {doc['meta']['memory_method']}")
    print("timings are wall clock" + (" after torch.cuda.synchronize()." if plan.device == "cuda" else
                                      " on a CPU that may be shared with other work: expect noise."))
    return 1 if doc["failures"] else 0
