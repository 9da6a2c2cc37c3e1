"""The scheduler's own tests (admission, preemption, prefix caching, migration, static allocation, speculation) run
under every scheduling policy: the policy decides only the admission order."""

import pytest

from pagedserve_common.config import SCHEDULING_POLICIES
from tests.support import scheduler as support

POLICY_MATRIX = ("test_scheduler", "test_migration", "test_static_alloc", "test_speculation")


def pytest_generate_tests(metafunc):
    if metafunc.module.__name__.rsplit(".", 1)[-1] in POLICY_MATRIX:
        metafunc.parametrize("scheduling_policy", SCHEDULING_POLICIES, indirect=True)


@pytest.fixture(autouse=True)
def scheduling_policy(request, monkeypatch):
    """The policy tests/support/scheduler.make() builds with: each of them for the POLICY_MATRIX modules' tests."""
    policy = getattr(request, "param", support.DEFAULT_POLICY)
    monkeypatch.setattr(support, "DEFAULT_POLICY", policy)
    return policy
