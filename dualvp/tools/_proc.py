"""Starting the child processes of ``dualvp verify`` and ``dualvp bench``.

Both tools run backends in fresh Python processes: JAX reads ``XLA_FLAGS``
(the number of host devices) once, at import, and each benchmark worker must
own its process so that the peak memory it reports is its own.
:func:`cuda_problem` is the check both run before starting any child when
``--device cuda`` is asked for.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from typing import Mapping, Optional, Sequence

__all__ = ["child_env", "start_python", "cuda_problem", "finish_jax"]

# The directory that holds this `dualvp` package: children import the same code
# as the parent, also when the parent runs from a checkout via PYTHONPATH.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_DEVICE_COUNT = "--xla_force_host_platform_device_count"


def child_env(host_devices: int = 1, set_vars: Optional[Mapping[str, Optional[str]]] = None) -> dict:
    """The parent's environment for a child, with ``host_devices`` JAX CPU devices.

    ``set_vars``: variables to set (a ``None`` value removes the variable).
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = _ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT)]
    if host_devices > 1:
        flags.append(f"{_DEVICE_COUNT}={host_devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    for k, v in (set_vars or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def start_python(args: Sequence[str], env: Mapping[str, str], **popen) -> subprocess.Popen:
    """``python args...`` with this interpreter; ``popen``: :class:`subprocess.Popen` options."""
    return subprocess.Popen([sys.executable, *args], env=dict(env), text=True, **popen)


def cuda_problem(ranks: int = 1) -> Optional[str]:
    """Why ``ranks`` torch processes (one GPU each) cannot run on CUDA here, or ``None`` when they can.

    Checked in the parent before anything is spawned, so that ``--device
    cuda`` on a machine without enough GPUs fails at once with this message.
    ``torch.cuda.is_available`` / ``device_count`` do not create a CUDA
    context in the parent.
    """
    try:
        import torch
    except ImportError:
        return "--device cuda needs torch, which is not importable"
    if not torch.cuda.is_available():
        return (f"--device cuda: no CUDA device (torch {torch.__version__}, built with CUDA "
                f"{torch.version.cuda}, torch.cuda.is_available() is False)")
    n = torch.cuda.device_count()
    if n < ranks:
        return (f"--device cuda: this machine has {n} GPU(s); --tp {ranks} needs {ranks} "
                f"(one NCCL rank per GPU)")
    return None


def finish_jax(started: tuple, timeout: float):
    """Wait for the child of :func:`dualvp.tools.verify.start_jax` (or of its kin); the
    :class:`dualvp.testing.Outputs` it wrote, or ``RuntimeError`` (failure, timeout)."""
    proc, dst = started
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise RuntimeError(f"JAX backend did not finish within {timeout:.0f} s") from None
    if proc.returncode:
        raise RuntimeError(f"JAX backend failed:\n{err[-4000:]}")
    with open(dst, "rb") as f:
        return pickle.load(f)
