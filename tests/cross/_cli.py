"""``dualvp verify ...`` through its command-line entry in this process, with or without the deliberate fault.

In process rather than as ``python -m dualvp``: the torch ranks fork from this
process's forkserver (torch imported once, :mod:`dualvp_torch.testing`) instead
of a fresh one per run, and the command's own start-up is not paid again. The
JAX backend still runs in the child ``dualvp verify`` starts
(:func:`dualvp.tools.verify.start_jax`), which inherits ``fault`` from the
environment; nothing in this process reads it. ``python -m dualvp`` as a
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
