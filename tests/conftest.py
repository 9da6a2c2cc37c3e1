"""Suite-wide settings: property tests replay the same examples on every run (a red CI must be reproducible)."""

from hypothesis import HealthCheck, settings

# NOTE: derandomize: each run draws the same examples, so a failure seen in CI replays on any machine (a test that
# wants fresh examples every run is a search, not a check). No deadline and no too_slow check: a loaded 2-core
# machine may take seconds over one example, and speed is for bench/, never for a test.
settings.register_profile("pagedserve", derandomize=True, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("pagedserve")
