"""Run a function on W real ``torch.distributed`` ranks (gloo, CPU), for tests.

    from dualvp_torch.testing import run_ranks

    def body(rank, world_size, scale):          # module level: it is pickled
        group = torch.distributed.group.WORLD
        ...
        return something_picklable

    results = run_ranks(body, 2, 3.0, timeout=60)   # [result of rank 0, result of rank 1]

Each rank is a fresh process with the default process group initialised on a
free local port, ``torch`` limited to ``max(1, cpu_count // world_size)``
threads, and the group destroyed after ``fn`` returns. ``fn`` is called as
``fn(rank, world_size, *args)``, must be importable (defined at module level)
and return a picklable value.

The ranks are forked from a multiprocessing *forkserver* that has imported
torch, torch.distributed and dualvp_torch once (and has run no torch op, so
no thread pool is forked): a spawned rank would import torch itself, 1-2 s of
CPU per rank per call, most of a small test's cost on a 2-core machine. The
forkserver starts at the first call and serves every later one of the
process. A rank sees the caller's environment and working directory as they
are at the call, as a spawned rank would. Where there is no forkserver
(Windows), the ranks are spawned.

Failure handling, designed for tests of ops that must never hang:

* a rank that raises: by default :class:`RanksFailed` is raised in the parent,
  carrying every rank's exception (``.errors``: rank -> exception), formatted
  traceback (``.tracebacks``) and the results of the ranks that succeeded; with
  ``return_exceptions=True`` the exception objects are returned in place of
  results instead;
* a hang: after ``timeout`` seconds (wall clock, spawn included) every child
  still alive is killed and :class:`RanksTimedOut` names the ranks that never
  reported. The gloo collective timeout is set to the same value.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.multiprocessing as mp

__all__ = ["run_ranks", "free_port", "RanksFailed", "RanksTimedOut"]


class RanksFailed(RuntimeError):
    """One or more ranks raised. ``errors``/``tracebacks``: rank -> exception / text."""

    def __init__(self, errors: dict, tracebacks: dict, results: dict):
        self.errors = errors
        self.tracebacks = tracebacks
        self.results = results
        lines = [f"{len(errors)} rank(s) raised:"]
        for r in sorted(errors):
            lines.append(f"--- rank {r}: {type(errors[r]).__name__}: {errors[r]}\n{tracebacks[r]}")
        super().__init__("\n".join(lines))


class RanksTimedOut(TimeoutError):
    """Some ranks did not finish within the timeout (``missing``: their ranks)."""

    def __init__(self, missing: list, timeout: float, results: dict, errors: dict):
        self.missing = missing
        self.results = results
        self.errors = errors
        super().__init__(f"ranks {missing} did not finish within {timeout:.0f} s (hang?); all were killed")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _picklable_error(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


#: What the forkserver imports before it forks a rank (the costly imports of every rank).
#: The modules named in ``DUALVP_FORKSERVER_PRELOAD`` (comma-separated, read when the server
#: starts) are imported too: a framework that every rank of a job imports (megatron-core's
#: import takes ~2 s, once in the server instead of once per rank). One that cannot be
#: imported is skipped (multiprocessing ignores an ImportError of a preloaded module).
PRELOAD = ("numpy", "torch", "torch.distributed", "dualvp_torch")


def _preload() -> list:
    extra = os.environ.get("DUALVP_FORKSERVER_PRELOAD", "")
    return list(PRELOAD) + [m.strip() for m in extra.split(",") if m.strip()]


def _context():
    """The forkserver context (torch preloaded), or spawn where there is none."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        # Takes effect when the server starts (the first call); later calls reuse it.
        ctx.set_forkserver_preload(_preload())
        return ctx
    return mp.get_context("spawn")


def _worker(fn, rank, world_size, port, backend, timeout, threads, environ, env, args, out_q):
    import torch.distributed as dist

    # A forked rank inherits the forkserver's environment (from its start):
    # take the caller's, as a spawned rank would.
    os.environ.clear()
    os.environ.update(environ)
    for k, v in (env or {}).items():
        os.environ[k] = str(v)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=max(1.0, timeout)),
        )
        try:
            result = fn(rank, world_size, *args)
        finally:
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        try:
            out_q.put((rank, True, pickle.dumps(result), None))
        except Exception as exc:  # unpicklable result
            out_q.put((rank, False, pickle.dumps(RuntimeError(f"result not picklable: {exc}")), ""))
    except BaseException as exc:  # noqa: BLE001 - report everything to the parent
        tb = traceback.format_exc()
        out_q.put((rank, False, pickle.dumps(_picklable_error(exc)), tb))


def run_ranks(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    env: Optional[dict] = None,
    threads: Optional[int] = None,
    return_exceptions: bool = False,
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    Args:
      fn: module-level callable (pickled to the children).
      world_size: number of ranks (>= 1).
      args: extra picklable arguments, passed to every rank.
      timeout: hard wall-clock limit in seconds for the whole run.
      backend: ``torch.distributed`` backend (``gloo`` on CPU).
      env: extra environment variables set in every child before ``fn`` runs
        (e.g. ``{"DUALVP_COMPILE": "0"}``).
      threads: torch intra-op threads per rank (default ``cpu_count // W``).
      return_exceptions: return exceptions in place of results instead of
        raising :class:`RanksFailed`.

    Returns:
      ``[result of rank 0, ..., result of rank W-1]``.
    """
    if world_size < 1:
        raise ValueError(f"world_size: expected >= 1, got {world_size}")
    ctx = _context()
    out_q = ctx.Queue()
    port = free_port()
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, r, world_size, port, backend, timeout, threads, dict(os.environ), env, args, out_q),
            daemon=True,
        )
        for r in range(world_size)
    ]
    deadline = time.monotonic() + timeout
    for p in procs:
        p.start()
    results: dict = {}
    errors: dict = {}
    tracebacks: dict = {}
    try:
        while len(results) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rank, ok, payload, tb = out_q.get(timeout=min(left, 0.5))
            except queue_mod.Empty:
                # A child that died without reporting (segfault, os._exit) never will.
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)]
                dead = [r for r in dead if r not in results and r not in errors]
                if dead and out_q.empty():
                    for r in dead:
                        errors[r] = RuntimeError(f"rank {r} died with exit code {procs[r].exitcode}")
                        tracebacks[r] = ""
                continue
            value = pickle.loads(payload)
            if ok:
                results[rank] = value
            else:
                errors[rank] = value
                tracebacks[rank] = tb or ""
    finally:
        for p in procs:
            p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    missing = [r for r in range(world_size) if r not in results and r not in errors]
    if missing:
        raise RanksTimedOut(missing, timeout, results, errors)
    if errors and not return_exceptions:
        raise RanksFailed(errors, tracebacks, results)
    return [results[r] if r in results else errors[r] for r in range(world_size)]
