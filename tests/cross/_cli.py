"""``dualvp verify ...`` through its command-line entry in this process, with or without the deliberate fault.

In process rather than as ``python -m dualvp``: the torch ranks fork from this
process's forkserver (torch imported once, :mod:`dualvp_torch.testing`) instead
of a fresh one per run, and the command's own start-up is not paid again. The
JAX backend still runs in the child ``dualvp verify`` starts
(:func:`dualvp.tools.verify.start_jax`), which inherits ``fault`` from the
environment; nothing in this process reads it. Tests about the report rather
than the process boundary run that child's code in this process instead
(:func:`jax_in_process`). ``python -m dualvp`` as a
process (``bench``, which asks the same CUDA check first as ``verify``):
tests/tools/test_device.py::test_cli_without_cuda_fails_fast_in_a_subprocess.
"""

import contextlib
import io
import os
import subprocess

from dualvp.testing import faults
from dualvp.tools import cli


def run_verify(*args: str, fault: str = "") -> subprocess.CompletedProcess:
    """Run ``dualvp verify args`` (text output captured); ``fault``: a :data:`dualvp.testing.faults.FAULTS` name."""
    saved = os.environ.pop(faults.ENV, None)
    if fault:
        os.environ[faults.ENV] = fault
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(["verify", *args])
    finally:
        os.environ.pop(faults.ENV, None)
        if saved is not None:
            os.environ[faults.ENV] = saved
    return subprocess.CompletedProcess(["dualvp", "verify", *args], rc, out.getvalue(), err.getvalue())


class _Finished:
    """What :func:`dualvp.tools._proc.finish_jax` reads of a child that has already run."""

    returncode = 0

    def communicate(self, timeout=None):
        return "", ""

    def kill(self):
        pass


def jax_in_process(monkeypatch) -> None:
    """``dualvp verify``'s JAX child (``verify``, ``--op extended``, ``--op kl``) run in this process.

    For the tests that are about the report, not the process boundary: a child is a JAX start-up
    (seconds) each. The child's own code (``_jax_child``, its argv, its pickled files) runs as in the
    child, on this process's host devices (tests/conftest.py asks for 8), with ``jax_enable_x64``
    restored after it. The child as a process: test_verify_input.py's ``test_npz_file_passes_at_tp2``
    and ``test_k_targets_and_row_temperature_file_passes_at_tp2``, test_checks_can_fail.py.
    """
    import sys

    import jax

    from dualvp.tools import verify, verify_ext, verify_kl

    def start_here(args, env, **popen):
        assert args[0] == "-c" and not env.get(faults.ENV), args  # a fault needs its own process
        code, argv = args[1], list(args[2:])
        assert int(argv[2]) <= jax.device_count(), argv
        x64, saved = jax.config.jax_enable_x64, sys.argv
        sys.argv = ["-c", *argv]
        try:
            exec(code, {})
        finally:
            sys.argv = saved
            jax.config.update("jax_enable_x64", x64)
        return _Finished()

    for mod in (verify, verify_ext, verify_kl):
        monkeypatch.setattr(mod, "start_python", start_here)
