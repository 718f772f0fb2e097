"""configs/grafana/kimi-encoder.json: a valid dashboard whose queries name exported metrics.

The serve test ``test_observability.py`` checks the same names against a live
Prometheus endpoint; this one needs no Ray cluster.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from deployments.metrics import PREFIX, exported_names

DASHBOARD = Path(__file__).resolve().parents[1] / "configs" / "grafana" / "kimi-encoder.json"


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_is_a_dashboard(dashboard):
    assert {"title", "uid", "panels", "templating", "schemaVersion", "time"} <= set(dashboard)
    assert dashboard["uid"] == "kimi-encoder" and isinstance(dashboard["schemaVersion"], int)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"} and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["type"] == "timeseries" and panel["datasource"]["uid"] == "${datasource}"
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]


def test_variables_are_defined(dashboard):
    defined = {v["name"] for v in dashboard["templating"]["list"]}
    used = set(re.findall(r"\$(\w+)", json.dumps(dashboard["panels"])))
    assert used - {"__rate_interval"} <= defined, used - defined


def test_every_query_names_an_exported_metric(dashboard):
    exported = exported_names()
    named = [set(re.findall(r"\bray_[a-z0-9_]+", q)) for q in queries(dashboard)]
    assert all(named), "every query names a metric"
    assert set().union(*named) <= exported, set().union(*named) - exported


def test_covers_load_latency_throughput_and_errors(dashboard):
    text = "\n".join(queries(dashboard))
    for name in (
        "inflight_patches",
        "inflight_bytes",
        "batch_images",
        "images_total",
        "patches_total",
        "tokens_total",
        "stage_ms_bucket",
        "requests_total",
    ):
        assert f"ray_{PREFIX}{name}" in text, name
    assert 'outcome!="ok"' in text and "histogram_quantile(0.99" in text


def test_queries_are_balanced(dashboard):
    for query in queries(dashboard):
        for left, right in ("()", "{}", "[]"):
            assert query.count(left) == query.count(right), query
