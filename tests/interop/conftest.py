"""Interop fixtures: the engine's code runs here, our side in a subprocess.

The test process is the engine's environment (``.venv-sglang`` or
``.venv-vllm``). Our side runs under ``KIMI_ENCODER_PYTHON``, the project's own
interpreter (``make interop`` passes ``.venv/bin/python``); without it, under
this interpreter. Tests that start the served application find the project's
``serve`` beside that interpreter (``kimi_tool("serve")``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
PRODUCE = Path(__file__).with_name("produce.py")


@pytest.fixture(scope="session")
def kimi_python() -> str:
    return os.environ.get("KIMI_ENCODER_PYTHON", sys.executable)


@pytest.fixture(scope="session")
def kimi_tool(kimi_python):
    """Path of a program installed with the project (e.g. ``serve``); skips if absent."""

    def find(name: str) -> Path:
        path = Path(kimi_python).with_name(name)
        if not path.exists():
            pytest.skip(f"{name} is not installed beside {kimi_python}; set KIMI_ENCODER_PYTHON")
        return path

    return find


@pytest.fixture
def produce(kimi_python, tmp_path):
    """Run ``produce.py MODE OUT ...`` under our interpreter; returns (spec, features)."""

    def command(mode: str, *args: str) -> list[str]:
        return [kimi_python, str(PRODUCE), mode, str(tmp_path / "out"), *args]

    def env() -> dict:
        return os.environ | {"PYTHONPATH": str(ROOT)}

    def run(mode: str, *args: str):
        result = subprocess.run(
            command(mode, *args), env=env(), capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr
        return read()

    def read():
        out = tmp_path / "out"
        return json.loads((out / "spec.json").read_text()), load_file(out / "expected.safetensors")[
            "features"
        ]

    run.command, run.env, run.read, run.out = command, env, read, tmp_path / "out"
    return run
