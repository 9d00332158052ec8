"""``dualvp bench ...`` through the CLI's entry point in this test process.

Its workers are processes all the same; only the command's own start-up (a
fresh interpreter importing torch) is not paid again. The command as a process
of its own: tests/tools/test_bench_quick.py's
``test_per_impl_workers_make_inputs_in_the_background_and_a_failure_is_a_row``.
"""

import json


def run_bench(args, cwd, capsys, monkeypatch, expect_rc: int = 0) -> str:
    """Run ``dualvp bench args`` in ``cwd``; assert its exit code; return its stdout."""
    from dualvp.tools.bench import driver
    from dualvp.tools.cli import main

    monkeypatch.setattr(driver, "_raise_on_sigterm", lambda: None)  # leave this process's SIGTERM alone
    monkeypatch.chdir(cwd)
    rc = main(["bench", *args])
    out = capsys.readouterr()
    assert rc == expect_rc, out.out[-3000:] + out.err[-3000:]
    return out.out


def worker_here(job: dict, capsys, monkeypatch) -> list:
    """The worker's loop (:mod:`dualvp.tools.bench.worker`) for ``job`` in this process; its records.

    For tests not about the process boundary: a worker process is a torch or JAX start-up (seconds)
    each. The workers as processes: tests/tools/test_bench_quick.py."""
    from dualvp.tools.bench import worker

    monkeypatch.setattr(worker, "_TURNS", worker.Turns(False))
    capsys.readouterr()
    (worker.run_jax if worker.IMPLS[job["impl"]].framework == "jax" else worker.run_torch)(job)
    recs = [json.loads(ln[2:]) for ln in capsys.readouterr().out.splitlines() if ln.startswith("@@")]
    assert all(r["kind"] == "result" for r in recs), recs
    return recs
