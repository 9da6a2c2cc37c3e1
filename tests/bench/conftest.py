"""The real scheduler+worker fixtures of tests/service, reused by the end-to-end bench test."""

from tests.service.conftest import service, tiny_served_model  # noqa: F401  (pytest finds fixtures by name)
