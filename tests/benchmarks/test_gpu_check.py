"""benchmarks/gpu_check.py: its CPU twin runs every section, its FLOP count is right, and the
budgeted report it writes (``common.Report``) records what ran, what failed and what did not fit."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import common, device, gpu_check
from kimi_encoder.config import get_preset


@pytest.fixture(scope="module")
def smoke(cpu_smoke):
    return cpu_smoke("gpu_check", timeout=300)


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
    assert checks["pytest -m cuda"]["reason"] == "skipped: no CUDA"
    tower = report["sections"]["tower"]["results"]
    assert tower["mix 4 x 64 (sdpa)"]["patches"] == 256
    # The settings are reported as the process has them: the script sets none.
    assert tower["fp32_precision"] == report["versions"]["fp32_precision"]
    assert set(tower["fp32_precision"]) == {"matmul", "cudnn_conv", "global"}
    served = report["sections"]["served"]["results"]
    assert served["setup"]["execution"]["mode"] == "eager"  # pinned, never auto's choice
    assert served["concurrency 2"]["images"] > 0
    assert served["concurrency 2"]["errors"] == []
    markdown = (out / "gpu_check.md").read_text()
    assert "## served: pass" in markdown
    assert "| concurrency 4 |" in markdown


@pytest.mark.parametrize("name", ["gpu_check", "gpu_served"])
def test_a_spawned_child_of_the_script_imports_from_the_checkout(name):
    """multiprocessing's spawn runs the script again in the child, as ``__mp_main__`` and
    with the parent's ``sys.path`` (the checkout's root first, benchmarks/ gone)."""
    root = Path(__file__).resolve().parents[2]
    script = root / "benchmarks" / f"{name}.py"
    child = (
        f"import runpy, sys; sys.path[0] = {str(root)!r}; "
        f"runpy.run_path({str(script)!r}, run_name='__mp_main__')"
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]


def test_flop_formula_matches_torch_flop_counter():
    """Our formula against torch's counter on the tiny tower (math SDPA: counted as bmm)."""
    cfg = get_preset("tiny").vision
    net = device.device_random_model(cfg, seed=0, device="cpu", dtype=torch.float32)
    grids = [(1, 4, 6), (1, 8, 8), (1, 2, 2)]
    pixels = torch.randn(24 + 64 + 4, 3, 14, 14)
    with torch.inference_mode(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        net(pixels, grids)
    assert fc.get_total_flops() == device.tower_flops(cfg, grids)


def test_k3_flops_per_1024_patch_image():
    """The number the tower section divides by, for one 32 x 32-patch K3 image."""
    cfg = get_preset("k3").vision
    n, tokens = 1024, 256
    per_layer = (
        2 * n * 1024 * 3 * 1536 + 4 * n * n * 1536 + 2 * n * 1536 * 1024 + 4 * n * 1024 * 4096
    )
    expected = 2 * n * 588 * 1024 + 27 * per_layer + 2 * tokens * 4096 * (4096 + 7168)
    assert device.tower_flops(cfg, [(1, 32, 32)]) == expected
    assert 1.0e12 < expected < 1.02e12  # about a TFLOP per 448 x 448 image


@pytest.mark.parametrize(
    ("row", "flat"),
    [({"a": 1}, {"a": 1}), ({"a": {"b": 1, "c": [2]}, "d": 3}, {"a.b": 1, "a.c": [2], "d": 3})],
    ids=["flat", "nested"],
)
def test_flat_rows(row, flat):
    assert common.flat(row) == flat


def test_the_check_sets_no_float32_precision_of_its_own():
    """What users get is what it measures: the library sets float32 on CUDA; this script
    assigns no precision setting and never touches the legacy ``allow_tf32`` flags."""
    for module in (gpu_check, device):
        tree = ast.parse(Path(module.__file__).read_text())
        legacy = [
            n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "allow_tf32"
        ]
        assigned = [
            target
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign)
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Attribute) and "precision" in target.attr
        ]
        assert (legacy, assigned) == ([], []), module.__name__


class QuickReport(common.Report):
    GRACE_S = 0.0  # the alarm fires at the deadline itself


def test_report_runs_each_section_under_its_deadline_and_records_why_not(tmp_path):
    """A passing, a failing, an erroring and a stuck section, then one that no longer fits
    the budget: each is recorded with its status, and the files are rewritten as it goes."""
    report = QuickReport(tmp_path, "run", "A run", {"mode": "test"}, budget_s=60)
    seen = []

    def passing(sec):
        sec.record("row", {"images_per_s": 2.0, "nested": {"a": 1}})
        seen.append(json.loads((tmp_path / "run.json").read_text())["sections"]["ok"])
        sec.check("two is two", True, value=2)

    def failing(sec):
        sec.check("one is two", False, value=1)

    def erring(sec):
        raise ValueError("a bug")

    def stuck(sec):
        sec.record("before", 1)
        threading.Event().wait(30)  # the section's alarm ends the wait

    report.run("ok", passing, deadline_s=30, min_s=0)
    report.run("bad", failing, deadline_s=30, min_s=0)
    report.run("bug", erring, deadline_s=30, min_s=0)
    report.run("stuck", stuck, deadline_s=0.2, min_s=0)
    report.run("late", passing, deadline_s=30, min_s=120)
    assert seen[0]["status"] == "running"
    assert seen[0]["results"]["row"]["images_per_s"] == 2.0
    data = json.loads((tmp_path / "run.json").read_text())
    status = {name: s["status"] for name, s in data["sections"].items()}
    assert status == {
        "ok": "pass",
        "bad": "fail",
        "bug": "error",
        "stuck": "timeout",
        "late": status["late"],
    }
    assert status["late"].startswith("skipped: ")
    assert "it needs 120" in status["late"]
    assert "ValueError: a bug" in data["sections"]["bug"]["error"]
    assert data["sections"]["stuck"]["results"] == {"before": 1}
    assert data["exit_code"] == report.exit_code() == 1
    markdown = (tmp_path / "run.md").read_text()
    assert markdown.startswith("# A run\n")
    assert "## ok: pass" in markdown
    assert '- **fail** one is two: {"value": 1}' in markdown
    assert "| row | 2.0 | 1 |" in markdown  # a row's nested entries spelled out as columns
