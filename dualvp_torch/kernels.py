"""Former name of :mod:`dualvp_torch.engines` (the compiled / eager stage dispatch), kept for importers
that have not moved yet (``dualvp_torch.compat``); new code imports :mod:`dualvp_torch.engines`."""

from .engines import select  # noqa: F401
from .stages import compute_dtype  # noqa: F401
