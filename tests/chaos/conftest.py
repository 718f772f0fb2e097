"""The chaos tests' shared image pool."""

from __future__ import annotations

import pytest

from chaos.load import pool


@pytest.fixture(scope="session")
def chaos_images(reference):
    """Seeded images of mixed sizes and modes, and the in-process encoder's features (the
    rank-fault modules'; tests/chaos/test_clients.py draws a pool of its own)."""
    return pool(reference)
