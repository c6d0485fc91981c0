from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# "ci" is deterministic so a failure in CI replays the same way on a laptop.
settings.register_profile(
    "ci",
    max_examples=500,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
