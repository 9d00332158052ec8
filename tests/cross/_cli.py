"""``python -m dualvp verify ...`` in a child process, with or without the deliberate fault."""

import os
import subprocess
import sys

from dualvp.testing import faults


def run_verify(*args: str, fault: str = "") -> subprocess.CompletedProcess:
    """Run ``dualvp verify args`` (text output captured); ``fault``: a :data:`dualvp.testing.faults.FAULTS` name."""
    env = {k: v for k, v in os.environ.items() if k != faults.ENV}
    if fault:
        env[faults.ENV] = fault
    return subprocess.run([sys.executable, "-m", "dualvp", "verify", *args], env=env,
                          capture_output=True, text=True, timeout=600)
