"""pytest configuration: hypothesis profiles (CI runs the same number of examples as here)."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "default", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
