import os

# Hypothesis: a bounded profile for CI; DUALVP_FUZZ_EXAMPLES raises the budget
# for a longer opt-in run.
from hypothesis import HealthCheck, settings

_n = int(os.environ.get("DUALVP_FUZZ_EXAMPLES", "0") or 0)
settings.register_profile(
    "dualvp",
    max_examples=_n or 40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=not _n,
)
settings.load_profile("dualvp")
