"""benchmarks/gpu_served.py's sections, each in a process of its own (benchmarks/isolated.py):
a CPU rehearsal of a bad device run, faults injected into the sections' own processes
(``--inject``: a section that hangs where no alarm reaches it, one that raises, one that
runs past its deadline, one whose process dies), and the parts around it: which steps
run, the deadlines, the tower's figures handed on through files, the bucket check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from benchmarks import common, device, gpu_served, isolated, tower_modes
from benchmarks.device_apps import Context, denominators
from kimi_encoder.encoder import VisionEncoder
from kimi_encoder.execution import BucketRunner, default_buckets

ROOT = Path(__file__).resolve().parents[2]
FAULT_S = 20.0  # the faulty sections' deadline: more than a child's imports on a busy machine
REHEARSAL = {  # section -> the fault injected into its process (None: the section itself)
    "site": None,
    "tower, compiled": "hang",
    "switches": "raise",
    "http, cache off": "timeout",
    "sglang parts": "crash",
    "batcher": None,
}


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    out = tmp_path_factory.mktemp("rehearsal")
    script = ROOT / "benchmarks" / "gpu_served.py"
    command = [sys.executable, str(script), "--cpu-smoke", "--out", str(out)]
    command += ["--sections", *REHEARSAL]
    for name, fault in REHEARSAL.items():
        command += ["--inject", f"{name}={fault}"] if fault else []
    for name in ("tower, compiled", "http, cache off"):
        command += ["--share", f"{name}={FAULT_S:g}"]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    report = json.loads((out / "gpu_served.json").read_text())
    return done, out, report


def test_a_hang_is_killed_at_its_deadline_and_keeps_what_it_measured(rehearsal):
    _, _, report = rehearsal
    hang = report["sections"]["tower, compiled"]
    grace = isolated.grace_s(FAULT_S)
    assert hang["status"] == "timeout"
    assert hang["error"].startswith(f"killed {grace:.0f} s past its deadline of {FAULT_S:.0f} s")
    assert hang["results"] == {"before the fault": 1.0}
    assert FAULT_S + grace <= hang["elapsed_s"] <= FAULT_S + grace + 5


def test_a_raise_a_timeout_and_a_crash_cost_their_section_alone(rehearsal):
    done, _, report = rehearsal
    sections = report["sections"]
    assert (done.returncode, report["exit_code"]) == (1, 1), done.stderr[-3000:]
    raised, late, crashed = (sections[n] for n in ("switches", "http, cache off", "sglang parts"))
    assert raised["status"] == "error"
    assert "RuntimeError: injected fault: the section raised" in raised["error"]
    assert late["status"] == "timeout"
    assert late["error"].startswith("deadline of ")  # its own alarm, before any kill
    assert late["elapsed_s"] <= FAULT_S + isolated.grace_s(FAULT_S) + 5
    assert crashed["status"] == "error"
    assert crashed["error"].startswith("its process ended (exit status 3) without returning")
    for section in (raised, late, crashed):
        assert section["results"] == {"before the fault": 1.0}


def test_every_other_section_reports_its_figures(rehearsal):
    """Site and the batcher pass after the faults; with no tower section run, the batcher
    runs eager and says its ratios have no denominator."""
    _, _, report = rehearsal
    site = report["sections"]["site"]
    assert site["status"] == "pass", site.get("error")
    assert site["results"]["ray"]["version"]
    batcher = report["sections"]["batcher"]
    assert batcher["status"] == "pass", batcher.get("error")
    results = batcher["results"]
    assert results["setup"]["execution"]["mode"] == "eager"
    for clients in gpu_served.SMOKE.clients:
        row = results[f"concurrency {clients}"]
        assert row["images"] > 0
        assert row["of_tower"] is None
    assert results["tower denominators"]["square"] == {"mode": None, "images_per_s": None}
    assert "no tower figure for the square set: its ratios are left empty" in batcher["notes"]


def test_the_report_files_are_complete_and_nothing_is_left_running(rehearsal):
    _, out, report = rehearsal
    assert list(report["sections"]) == list(REHEARSAL)  # no serve run: no section needed one
    assert report["driver_touched_cuda"] is False
    assert sorted(p.name for p in out.iterdir()) == ["gpu_served.json", "gpu_served.md"]
    markdown = (out / "gpu_served.md").read_text()
    for name, section in report["sections"].items():
        assert f"## {name}: {section['status']} (" in markdown
    assert markdown.count("- before the fault: 1.0") == 4
    left = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if any(str(out) == arg for arg in (p.info["cmdline"] or []))
    ]
    assert left == []


# --------------------------------------------------------------------------- the driver's plan


def test_a_serve_run_starts_only_for_the_sections_that_measure_it():
    steps = gpu_served.steps
    assert steps(["tower, eager"], {}) == ["tower, eager"]
    assert steps(["switches"], {}) == ["serve run (proxy)", "switches"]
    assert steps(["switches"], {"switches": "raise"}) == ["switches"]
    haproxy = ["batcher", "serve run (haproxy)", "http via haproxy"]
    assert steps(["batcher", "http via haproxy"], {}) == haproxy
    default = [n for n in gpu_served.SECTIONS if n not in gpu_served.FULL.optional]
    assert steps(default, {}) == default
    assert "serve run (haproxy)" not in default


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["switches=melt"], "unknown fault 'melt'; allowed: hang, raise, timeout, crash"),
        (["switches"], "expected NAME=FAULT with NAME one of"),
        (["serve run (proxy)=hang"], "expected NAME=FAULT with NAME one of"),
    ],
    ids=["unknown fault", "no fault", "a step of the driver's"],
)
def test_an_injection_names_what_is_allowed(values, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        isolated.parse_faults(values, gpu_served.CHILDREN)


def test_a_bad_share_is_refused_with_the_sections_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_served.main(["--cpu-smoke", "--out", str(tmp_path), "--share", "towers=30"])
    assert "--share 'towers=30': expected NAME=SECONDS with NAME one of" in capsys.readouterr().err


def test_a_share_given_on_the_command_line_is_that_sections_deadline():
    deadlines = device.Rolling({"a": 10.0, "b": 5.0}, ["a", "b"], exact={"b"})
    assert deadlines["b"] == 5.0  # not a's unused 10 s on top
    assert deadlines["a"] == pytest.approx(10.0, abs=1.0)


def test_a_section_survives_its_trip_through_a_file():
    section = common.Section("tower, graphs", deadline_s=30.0, status="pass", elapsed_s=2.5)
    section.record("row", {"images_per_s": 2.0})
    section.check("fine", True, value=1)
    section.note("a note")
    back = common.Section.from_dict(json.loads(json.dumps(section.as_dict())))
    assert back.as_dict() == section.as_dict()


# --------------------------------------------------------------------------- the hand-off


def test_a_ratio_uses_whatever_tower_figure_exists(tmp_path):
    ctx = Context(gpu_served.SMOKE, tmp_path, tmp_path)
    assert ctx.tower("square") == (None, None)
    assert ctx.of_tower(10.0, "square") is None
    ctx.put_tower("eager", {"square images_per_s": 5.0})
    ctx.put_tower("eager, varlen", {"square images_per_s": 50.0})  # no rank runs it
    assert ctx.tower("square") == ("eager", 5.0)
    ctx.put_tower("graphs", {"status": "measuring", "square images_per_s": 8.0})
    assert ctx.tower("square") == ("graphs", 8.0)
    assert ctx.of_tower(4.0, "square") == 0.5
    sec = common.Section("http")
    denominators(sec, ctx)
    assert sec.results["tower denominators"]["square"] == {"mode": "graphs", "images_per_s": 8.0}
    assert sec.notes == ["no tower figure for the mixed set: its ratios are left empty"]
    ctx.put_tower("compiled", {"error": "RuntimeError: no compiler"})
    assert ctx.mode_errors() == {"compiled": "RuntimeError: no compiler"}


def test_the_context_reaches_a_sections_process_through_the_work_folder(tmp_path):
    ctx = Context(gpu_served.SMOKE, tmp_path, tmp_path, [b"a", b"b"], [b"c"], {"square": 1.5})
    ctx.unsupported = {"graphs": "no CUDA", "eager": None}
    ctx.variant_apps = {"eager-threads": {"execution": "eager"}}
    ctx.save()
    back = Context.load(gpu_served.SMOKE, tmp_path, tmp_path)
    assert (back.images, back.mixed, back.decode_ms) == (ctx.images, ctx.mixed, ctx.decode_ms)
    assert (back.unsupported, back.variant_apps) == (ctx.unsupported, ctx.variant_apps)


# --------------------------------------------------------------------------- the bucket check


@pytest.mark.parametrize("budget", [2048, 65536], ids=["smoke", "k3-8gpu"])
def test_each_check_batch_lands_in_its_own_bucket(budget):
    buckets = default_buckets(budget)
    previous = 0
    for bucket in buckets:
        small, large = tower_modes.check_batches(bucket, previous, 64)
        assert previous < tower_modes.patches(small) <= bucket
        assert bucket // 2 < tower_modes.patches(large) <= bucket
        assert len(small) <= 64
        assert len(large) <= 64
        assert all(h % 2 == 0 and w % 2 == 0 for _, h, w in small + large)
        previous = bucket


class Stale(BucketRunner):
    """Answers the third batch a little off, as a bucket that kept the batch before would."""

    calls = 0

    def __call__(self, pixels, grids):
        out = super().__call__(pixels, grids)
        self.calls += 1
        return out + 1e-3 if self.calls % 3 == 0 else out


@pytest.mark.parametrize(("runner", "passed"), [(BucketRunner, True), (Stale, False)])
def test_the_bucket_check_passes_the_buckets_and_catches_a_stale_answer(tmp_path, runner, passed):
    ctx = Context(gpu_served.SMOKE, tmp_path, tmp_path)
    enc = VisionEncoder.from_pretrained("tiny", device="cpu", dtype="float32", execution="eager")
    sec = common.Section("tower, graphs", deadline_s=300)
    tower_modes.bucket_check(sec, ctx, enc, runner(enc.model, (512, 1024), 64, capture=False))
    assert [c["status"] for c in sec.checks] == ["pass" if passed else "fail"]
    rows = sec.results["graphs vs eager, small-large-small"]
    assert [row["small_equal"] for row in rows.values()] == [passed, passed]
    assert all(row["in_its_bucket"] and row["finite"] for row in rows.values())
    assert sec.results["buckets after the check"]["bucket_batches"] == {"512": 3, "1024": 3}
