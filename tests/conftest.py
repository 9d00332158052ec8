import os

# JAX reads XLA_FLAGS once, at import: give every test process (and the torch
# ranks it spawns, which inherit the environment) 8 host devices before any
# test module imports jax.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

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
