"""Shared pytest configuration: Hypothesis profiles."""
import os

from hypothesis import HealthCheck, settings

settings.register_profile("default", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True, max_examples=60,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("nightly", deadline=None, max_examples=500, stateful_step_count=100)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
