"""Fixtures of the integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def dsn(embedded_postgres_dsn: str) -> str:
    """A fresh database on the session's real PostgreSQL server."""
    return embedded_postgres_dsn
