"""Deliberate faults: the one seam through which tests prove that the checks can fail.

``DUALVP_TEST_FAULT=grad_tau`` in the environment of a process that runs the
JAX backend through :func:`dualvp.testing.run` makes the JAX backward forget
the ``1/temperature`` factor (a plausible bug): the fault re-registers the
custom VJPs of :mod:`dualvp_jax.function` (the logits gradient) and of
:mod:`dualvp_jax.linear_blocks` (the fused LM head's ``dh`` and ``dW``) with a
wrapped backward, so the production backward itself carries no test code.
Never set it otherwise.
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
    from dualvp_jax import linear_blocks as lin

    def times_tau(g, tau):
        # undo the 1/tau of the correct gradient: the bug being simulated
        return (g.astype(jnp.promote_types(g.dtype, jnp.float32)) * tau).astype(g.dtype)

    backward = f._op_bwd

    def grad_tau(axis_name, opt, tuning, res, cotangents):
        g, *rest = backward(axis_name, opt, tuning, res, cotangents)
        return (times_tau(g, opt.temperature), *rest)

    linear_backward = lin._op_bwd

    def linear_grad_tau(axis_name, cfg, res, cotangents):
        dh, dw, *rest = linear_backward(axis_name, cfg, res, cotangents)
        return (times_tau(dh, cfg.opt.temperature), times_tau(dw, cfg.opt.temperature), *rest)

    f._op.defvjp(f._op_fwd, grad_tau)
    lin._op.defvjp(lin._op_fwd, linear_grad_tau)
    _installed.add(name)


def install_from_env() -> Optional[str]:
    """Install the fault named by ``$DUALVP_TEST_FAULT`` (if set); returns its name."""
    name = os.environ.get(ENV, "")
    if name:
        install(name)
    return name or None
