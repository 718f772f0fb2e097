"""benchmarks/gpu_check.py: its CPU twin runs every section, and its FLOP count is right."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import gpu_check
from kimi_encoder.config import get_preset

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    script = ROOT / "benchmarks" / "gpu_check.py"
    command = [sys.executable, str(script), "--cpu-smoke", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    return done, out


def test_cpu_smoke_runs_every_section(smoke):
    done, out = smoke
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.startswith("versions: python ")
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["mode"] == "cpu-smoke"
    assert report["exit_code"] == 0
    assert list(report["sections"]) == list(gpu_check.SECTIONS)
    for name, section in report["sections"].items():
        assert section["status"] == "pass", (name, section.get("error"), section["notes"])
        assert all(c["status"] in ("pass", "skipped") for c in section["checks"]), name
    checks = {c["name"]: c for c in report["sections"]["correctness"]["checks"]}
    assert checks["gpu vs cpu preprocessing backends (bit-exact)"]["status"] == "pass"
    assert checks["float32 CUDA vs CPU"]["reason"] == "skipped: no CUDA"
    assert checks["pytest -m cuda"]["reason"] == "skipped: no CUDA"
    tower = report["sections"]["tower"]["results"]
    assert tower["mix 4 x 64 (sdpa)"]["patches"] == 256
    served = report["sections"]["served"]["results"]
    assert served["concurrency 2"]["images"] > 0
    assert served["concurrency 2"]["errors"] == []
    markdown = (out / "gpu_check.md").read_text()
    assert "## served: pass" in markdown
    assert "| concurrency 4 |" in markdown


def test_flop_formula_matches_torch_flop_counter():
    """Our formula against torch's counter on the tiny tower (math SDPA: counted as bmm)."""
    cfg = get_preset("tiny").vision
    net = gpu_check.device_random_model(cfg, seed=0, device="cpu", dtype=torch.float32)
    grids = [(1, 4, 6), (1, 8, 8), (1, 2, 2)]
    pixels = torch.randn(24 + 64 + 4, 3, 14, 14)
    with torch.inference_mode(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        net(pixels, grids)
    assert fc.get_total_flops() == gpu_check.tower_flops(cfg, grids)


def test_k3_flops_per_1024_patch_image():
    """The number the tower section divides by, for one 32 x 32-patch K3 image."""
    cfg = get_preset("k3").vision
    n, tokens = 1024, 256
    per_layer = (
        2 * n * 1024 * 3 * 1536 + 4 * n * n * 1536 + 2 * n * 1536 * 1024 + 4 * n * 1024 * 4096
    )
    expected = 2 * n * 588 * 1024 + 27 * per_layer + 2 * tokens * 4096 * (4096 + 7168)
    assert gpu_check.tower_flops(cfg, [(1, 32, 32)]) == expected
    assert 1.0e12 < expected < 1.02e12  # about a TFLOP per 448 x 448 image


@pytest.mark.parametrize(
    ("row", "flat"),
    [({"a": 1}, {"a": 1}), ({"a": {"b": 1, "c": [2]}, "d": 3}, {"a.b": 1, "a.c": [2], "d": 3})],
    ids=["flat", "nested"],
)
def test_flat_rows(row, flat):
    assert gpu_check._flat(row) == flat
