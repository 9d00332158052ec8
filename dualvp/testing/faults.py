"""Deliberate faults: the one seam through which tests prove that the checks can fail.

``DUALVP_TEST_FAULT=grad_tau`` in the environment of a process that runs the
JAX backend through :func:`dualvp.testing.run` makes the JAX backward forget
the ``1/temperature`` factor (a plausible bug): the fault re-registers the
custom VJP of :mod:`dualvp_jax.function` with a wrapped backward, so the
production backward itself carries no test code. Never set it otherwise.
"""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["ENV", "FAULTS", "install", "install_from_env"]

ENV = "DUALVP_TEST_FAULT"
FAULTS = ("grad_tau",)
_installed: set = set()


def install(name: str) -> None:
    """Install fault ``name`` (of :data:`FAULTS`) in this process; idempotent."""
    if name not in FAULTS:
        raise ValueError(f"{ENV}: expected one of {FAULTS}, got {name!r}")
    if name in _installed:
        return
    import jax.numpy as jnp

    from dualvp_jax import function as f

    backward = f._op_bwd

    def grad_tau(axis_name, opt, res, cotangents):
        g, *rest = backward(axis_name, opt, res, cotangents)
        # undo the 1/tau of the correct gradient: the bug being simulated
        return ((g.astype(jnp.promote_types(g.dtype, jnp.float32)) * opt.temperature).astype(g.dtype), *rest)

    f._op.defvjp(f._op_fwd, grad_tau)
    _installed.add(name)


def install_from_env() -> Optional[str]:
    """Install the fault named by ``$DUALVP_TEST_FAULT`` (if set); returns its name."""
    name = os.environ.get(ENV, "")
    if name:
        install(name)
    return name or None
