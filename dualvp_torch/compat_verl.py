"""Former home of verl's fused ``linear_cross_entropy`` drop-in; now :mod:`dualvp_torch.compat.verl`.

Kept so that ``from dualvp_torch.compat_verl import linear_cross_entropy`` keeps working.
"""

from .compat.verl_fused import REDUCTIONS, linear_cross_entropy  # noqa: F401

__all__ = ["linear_cross_entropy"]
