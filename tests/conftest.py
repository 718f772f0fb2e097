"""Shared fixtures: the oracle data, seeded checkpoints and encoders."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))  # tests/images.py

ORACLE = TESTS / "data" / "oracle-k3"


@pytest.fixture(scope="session")
def oracle_dir() -> Path:
    return ORACLE


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from kimi_encoder.config import get_preset
    from kimi_encoder.weights import write_checkpoint

    preset = get_preset("tiny")
    return write_checkpoint(tmp_path_factory.mktemp("tiny"), preset.vision, preset.preprocess, 7)


@pytest.fixture(scope="session")
def oracle_encoder():
    from kimi_encoder.encoder import VisionEncoder

    return VisionEncoder.from_pretrained(ORACLE / "checkpoint", device="cpu", backend="cpu")
