"""Rank, client and hand-off faults under load (`pytest -m chaos`)."""
