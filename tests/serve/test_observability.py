"""Metrics on the Prometheus endpoint and request ids in the JSON logs, on an app of its own.

The app runs in a Ray cluster started by ``observability_server.py`` with a
fixed metrics export port; only this module sends it traffic, so every
counter must equal what the tests sent.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
from serve_helpers import b64, encode, free_port

from deployments.metrics import (
    INGRESS_RANK,
    PREFIX,
    RANK_STAGES,
    exported_names,
)

pytestmark = pytest.mark.serve

ROOT = Path(__file__).resolve().parents[2]
SERVER = Path(__file__).with_name("observability_server.py")
DASHBOARD = ROOT / "configs" / "grafana" / "kimi-encoder.json"
READY_TIMEOUT_S = 180
METRICS_TIMEOUT_S = 90
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@pytest.fixture(scope="module")
def app(tmp_path_factory) -> Iterator[dict]:
    log = tmp_path_factory.mktemp("obs") / "server.log"
    with log.open("wb") as err:
        process = subprocess.Popen(
            [sys.executable, str(SERVER), str(free_port()), str(free_port())],
            cwd=ROOT,
            env={**os.environ, "RAY_ADDRESS": "local"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            start_new_session=True,
        )
    try:
        ready, _, _ = select.select([process.stdout], [], [], READY_TIMEOUT_S)
        line = process.stdout.readline() if ready else b""
        if not line:
            pytest.fail(f"observability app not ready:\n{log.read_text()[-4000:]}")
        yield json.loads(line)
    finally:
        process.stdin.close()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    samples = []
    for line in requests.get(url, timeout=10).text.splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            labels = dict(_LABEL.findall(match.group(2) or ""))
            samples.append((match.group(1), labels, float(match.group(3))))
    return samples


def total(samples, name: str, **labels: str) -> float:
    return sum(
        v for n, lab, v in samples if n == name and all(lab.get(k) == w for k, w in labels.items())
    )


def image_items(images: list[bytes]) -> list[dict]:
    return [{"type": "image", "image": b64(b)} for b in images]


def test_metrics_count_the_traffic(app, images):
    url = app["url"]
    ok_bodies = []
    for chunk in (images[:3], images[3:5], images[5:9]):
        response = encode(url, image_items(chunk))
        assert response.status_code == 200, response.text
        ok_bodies.append(response.json())
    upload = requests.post(f"{url}/v1/encode", files=[("image", ("a.png", images[0]))], timeout=120)
    assert upload.status_code == 200, upload.text
    ok_bodies.append(upload.json())
    bad = [  # (body, content type or None for JSON, outcome)
        ({"items": [{"type": "video", "video": "x"}]}, None, "invalid_request"),
        ({"items": [{"type": "image", "image": "%%%"}]}, None, "invalid_request"),
        ({"items": image_items([images[2]] * 11)}, None, "limit_exceeded"),
        ({"items": []}, None, "validation_error"),
        (b"hello", "text/plain", "unsupported_media_type"),
    ]
    for body, kind, outcome in bad:
        if kind is None:
            response = requests.post(f"{url}/v1/encode", json=body, timeout=60)
        else:
            response = requests.post(
                f"{url}/v1/encode", data=body, headers={"content-type": kind}, timeout=60
            )
        assert response.json()["error"]["type"] == outcome, response.text

    items = [item for body in ok_bodies for item in body["items"]]
    want_outcomes = Counter({"ok": len(ok_bodies)}) + Counter(b[2] for b in bad)
    want_images = Counter(str(i["owner_rank"]) for i in items)
    want_patches, want_tokens, want_calls = Counter(), Counter(), Counter()
    for body in ok_bodies:
        for rank in {str(i["owner_rank"]) for i in body["items"]}:
            want_calls[rank] += 1
        for item in body["items"]:
            want_patches[str(item["owner_rank"])] += int(np.prod(item["grid_thw"]))
            want_tokens[str(item["owner_rank"])] += item["num_tokens"]
    assert set(want_images) == {"0", "1"}, "the traffic must reach both ranks"

    requests_total = f"ray_{PREFIX}requests_total"
    deadline = time.monotonic() + METRICS_TIMEOUT_S
    started = time.monotonic()
    while True:  # the metrics agent exports every few seconds
        samples = scrape(app["metrics_url"])
        if total(samples, requests_total) == sum(want_outcomes.values()) and total(
            samples, f"ray_{PREFIX}stage_ms_count", stage="forward"
        ) == sum(want_calls.values()):
            break
        if time.monotonic() > deadline:
            pytest.fail(f"metrics not exported after {METRICS_TIMEOUT_S} s")
        time.sleep(1)
    print(f"\nmetrics visible {time.monotonic() - started:.1f} s after the traffic")

    names = {n for n, _, _ in samples}
    missing = exported_names() - names
    assert not missing, f"not exported: {sorted(missing)}"
    for outcome, count in want_outcomes.items():
        assert total(samples, requests_total, outcome=outcome) == count, outcome
    for rank in ("0", "1"):
        assert total(samples, f"ray_{PREFIX}images_total", rank=rank) == want_images[rank]
        assert total(samples, f"ray_{PREFIX}patches_total", rank=rank) == want_patches[rank]
        assert total(samples, f"ray_{PREFIX}tokens_total", rank=rank) == want_tokens[rank]
        for stage in RANK_STAGES:  # one observation per call of that rank
            count = total(samples, f"ray_{PREFIX}stage_ms_count", stage=stage, rank=rank)
            assert count == want_calls[rank], (stage, rank)
        assert (
            total(
                samples, f"ray_{PREFIX}stage_ms_count", stage="preprocess", rank=rank, backend="cpu"
            )
            == want_calls[rank]
        )
        for gauge in ("inflight_patches", "inflight_bytes"):  # nothing in flight now
            series = [
                v
                for n, lab, v in samples
                if n == f"ray_{PREFIX}{gauge}" and lab.get("rank") == rank
            ]
            assert series == [0.0], (gauge, rank, series)
        batch = [
            v
            for n, lab, v in samples
            if n == f"ray_{PREFIX}batch_images" and lab.get("rank") == rank
        ]
        assert len(batch) == 1 and batch[0] >= 1, (rank, batch)
    assert total(samples, f"ray_{PREFIX}images_total") == len(items) == 10
    requests_count = sum(want_outcomes.values())
    for stage, count in (
        ("admission", len(ok_bodies)),
        ("gather", len(ok_bodies)),
        ("end_to_end", requests_count),
    ):
        assert (
            total(samples, f"ray_{PREFIX}stage_ms_count", stage=stage, rank=INGRESS_RANK) == count
        ), stage
    tagged = {
        (lab.get("deployment"), lab.get("application"))
        for n, lab, _ in samples
        if n.startswith(f"ray_{PREFIX}")
    }
    assert {("EncodeServer", "obs"), ("EncoderRank_0", "obs"), ("EncoderRank_1", "obs")} <= tagged

    # Every query of the Grafana dashboard names a series the app exports.
    queried = set()
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            queried |= set(re.findall(r"\bray_[a-z0-9_]+", target["expr"]))
    assert queried and queried <= names, sorted(queried - names)


def read_log_lines(session_dir: str, request_id: str) -> dict[str, list[dict]]:
    """JSON log records mentioning ``request_id``, by the replica log file's deployment."""
    found: dict[str, list[dict]] = {}
    for path in sorted(Path(session_dir, "logs", "serve").glob("replica_obs_*.log")):
        deployment = path.name.removeprefix("replica_obs_").rsplit("_", 1)[0]
        for line in path.read_text().splitlines():
            if request_id in line:
                found.setdefault(deployment, []).append(json.loads(line))
    return found


def test_request_id_reaches_every_owner_rank(app, images):
    url, request_id = app["url"], f"trace-{uuid.uuid4().hex[:12]}"
    response = requests.post(
        f"{url}/v1/encode",
        json={"items": image_items(images[:3])},
        headers={"X-Request-ID": request_id},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == request_id
    owners = {item["owner_rank"] for item in response.json()["items"]}
    assert owners == {0, 1}, "one multi-rank request"
    want = {"EncodeServer"} | {f"EncoderRank_{r}" for r in owners}
    deadline = time.monotonic() + 20
    while set(found := read_log_lines(app["session_dir"], request_id)) < want:
        assert time.monotonic() < deadline, f"request id only in {sorted(found)}"
        time.sleep(0.5)
    for deployment, records in found.items():
        assert all(r.get("request_id") == request_id for r in records), deployment
    summaries = [r for r in found["EncodeServer"] if "kimi_encoder_summary" in r]
    assert len(summaries) == 1, summaries
    summary = summaries[0]["kimi_encoder_summary"]
    body = response.json()
    assert summary["outcome"] == "ok" and summary["status"] == 200
    assert summary["images"] == 3 and summary["patches"] == body["usage"]["patches"]
    assert summary["owners"] == [item["owner_rank"] for item in body["items"]]
    assert set(summary["stages_ms"]) == {"admission", "gather", "end_to_end"}
    assert {int(r) for r in summary["ranks_ms"]} == owners
    for rank in owners:
        assert set(summary["ranks_ms"][str(rank)]) == set(RANK_STAGES)
        encoded = [r for r in found[f"EncoderRank_{rank}"] if "kimi_encoder_rank" in r]
        assert len(encoded) == 1 and encoded[0]["kimi_encoder_rank"]["rank"] == rank


def test_generated_request_id_is_returned_and_logged(app):
    response = requests.post(f"{app['url']}/v1/encode", json={"items": []}, timeout=60)
    assert response.status_code == 422
    request_id = response.headers["x-request-id"]
    assert request_id
    deadline = time.monotonic() + 20
    while True:
        records = read_log_lines(app["session_dir"], request_id).get("EncodeServer", [])
        summaries = [r["kimi_encoder_summary"] for r in records if "kimi_encoder_summary" in r]
        if summaries:
            break
        assert time.monotonic() < deadline, "no summary line for the generated request id"
        time.sleep(0.5)
    assert summaries == [
        {
            "outcome": "validation_error",
            "status": 422,
            "backend": "none",
            "images": 0,
            "patches": 0,
            "owners": [],
            "stages_ms": {"end_to_end": summaries[0]["stages_ms"]["end_to_end"]},
            "ranks_ms": {},
        }
    ]
