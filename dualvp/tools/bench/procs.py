"""The worker processes of ``dualvp bench``: started, fed, read and, with ``--interleave``, taking turns.

Each worker (:mod:`.worker`) runs one implementation in its own process,
so that the peak memory it reports is its own and JAX's settings are its
own. Its ``@@`` stdout lines are records; its stderr goes to a log file in
the run's scratch directory, whose last line is the error when it dies.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

from .. import _proc

__all__ = ["run_workers", "run_jobs", "free_port"]


def _worker_env(impl: str, device: str = "cpu") -> dict:
    # one host device for JAX in the workers, whatever the caller set; JAX on the GPU only for
    # --device cuda, and then without preallocating most of the GPU's memory
    gpu = {"JAX_PLATFORMS": "cuda", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"} if device == "cuda" else \
        {"JAX_PLATFORMS": "cpu"}
    return _proc.child_env(1, {"DUALVP_COMPILE": None, **gpu,
                               "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", "ignore")})


def _pump(p: subprocess.Popen, job: dict, errs: list, on_record: Callable,
          on_turn: Optional[Callable[[str], None]] = None) -> None:
    """Read a worker's stdout: ``@@`` lines are records (``result`` and ``unavailable``
    go to ``on_record``), the rest is log.

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


def run_jobs(jobs: list[dict], work: str, timeout: float, on_record: Callable,
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
    return [msg for _, msg in run_jobs(jobs, work, timeout, on_record, interleave)]


def free_port() -> int:
    from dualvp_torch.testing import free_port  # only torch workers need a port

    return free_port()
