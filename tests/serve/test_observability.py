"""Metrics, the Grafana dashboard and request ids in the JSON logs, on an app of its own.

The app runs in a Ray cluster started by ``observability_server.py`` with a
fixed metrics export port; only this module sends it traffic, so every
counter must equal what the tests sent. A real Prometheus server
(``/usr/bin/prometheus``, Debian's ``prometheus``) scrapes that port and runs
every query of ``configs/grafana/kimi-encoder.json``; without it that test skips.
"""

from __future__ import annotations

import contextlib
import json
import math
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
from urllib.parse import urlsplit

import numpy as np
import pytest
import requests
from serve_helpers import RAY_START_TRIES, b64, encode, free_port, ray_start_timed_out

from deployments.metrics import (
    INGRESS_RANK,
    PREFIX,
    RANK_STAGES,
    exported_names,
)

ROOT = Path(__file__).resolve().parents[2]
SERVER = Path(__file__).with_name("observability_server.py")
DASHBOARD = ROOT / "configs" / "grafana" / "kimi-encoder.json"
PROMETHEUS = os.environ.get("PROMETHEUS", "/usr/bin/prometheus")
READY_TIMEOUT_S = 180
METRICS_TIMEOUT_S = 90
# Values of the dashboard's variables when its queries run here: the app's name (the
# variable is a regex on `application`), and Grafana's interval built-ins as windows
# holding many of Prometheus' 1 s scrapes.
QUERY_VARIABLES = {"application": "obs", "__rate_interval": "1m", "__interval": "15s"}
REQUESTS = f"ray_{PREFIX}requests_total"
STAGE_COUNT = f"ray_{PREFIX}stage_ms_count"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@pytest.fixture(scope="module")
def app(tmp_path_factory) -> Iterator[dict]:
    """The server's ready line; a server whose Ray cluster missed Ray's start-up timeout
    is started again, with ports of its own (serve_helpers.RAY_START_TIMED_OUT)."""
    folder = tmp_path_factory.mktemp("obs")
    for attempt in range(1, RAY_START_TRIES + 1):
        log = folder / f"server-{attempt}.log"
        process, line = start_server(log)
        if line or attempt == RAY_START_TRIES or not ray_start_timed_out(log):
            break
        stop_server(process)
    try:
        if not line:
            pytest.fail(f"observability app not ready:\n{log.read_text()[-4000:]}")
        yield json.loads(line)
    finally:
        stop_server(process)


def start_server(log: Path) -> tuple[subprocess.Popen, bytes]:
    """observability_server.py on free ports, and its ready line (empty if it ended or
    took more than READY_TIMEOUT_S)."""
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
    ready, _, _ = select.select([process.stdout], [], [], READY_TIMEOUT_S)
    return process, process.stdout.readline() if ready else b""


def stop_server(process: subprocess.Popen) -> None:
    """Close its stdin (it shuts down), wait up to 60 s, then kill what is left of its
    session (all of it after a hang; a failed start's Ray processes)."""
    process.stdin.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@pytest.fixture(scope="module")
def prometheus(app, tmp_path_factory) -> Iterator[str]:
    """Base URL of a Prometheus server of our own (free port, temporary storage) that
    scrapes the app's metrics endpoint every second."""
    if not Path(PROMETHEUS).exists():
        pytest.skip(
            f"no Prometheus at {PROMETHEUS} (apt-get install prometheus, or set $PROMETHEUS)"
        )
    workdir = tmp_path_factory.mktemp("prometheus")
    target = urlsplit(app["metrics_url"])
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {
                "job_name": "ray",
                "metrics_path": target.path,
                "static_configs": [{"targets": [target.netloc]}],
            }
        ],
    }
    (workdir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    url = f"http://127.0.0.1:{free_port()}"
    log = workdir / "prometheus.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address={urlsplit(url).netloc}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not prometheus_ready(url):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"Prometheus not ready:\n{log.read_text()[-4000:]}")
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def prometheus_ready(url: str) -> bool:
    try:
        return requests.get(f"{url}/-/ready", timeout=5).status_code == 200
    except requests.ConnectionError:
        return False


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside collapsed rows included."""
    return [q for p in dashboard["panels"] for q in (p, *p.get("panels", []))]


def queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(panel title, refId, expr) of every query of the dashboard."""
    return [
        (p["title"], t["refId"], t["expr"]) for p in panels(dashboard) for t in p.get("targets", [])
    ]


_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def substitute(expr: str) -> str:
    """``expr`` with each ``$name`` or ``${name}`` replaced by its ``QUERY_VARIABLES`` value."""
    return _VARIABLE.sub(lambda m: QUERY_VARIABLES[m.group(1) or m.group(2)], expr)


def instant_query(prometheus: str, expr: str) -> list[dict]:
    """The series ``expr`` evaluates to now, through Prometheus' HTTP API."""
    response = requests.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=30)
    body = response.json()
    assert body["status"] == "success", (expr, body)
    assert body["data"]["resultType"] == "vector", (expr, body)
    return body["data"]["result"]


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


def ours(samples) -> dict[tuple[str, frozenset], float]:
    """Our series of an endpoint scrape: (name, labels) -> value; labels with an empty
    value left out, as Prometheus stores them (an empty label is no label)."""
    return {
        (n, frozenset((k, w) for k, w in lab.items() if w)): v
        for n, lab, v in samples
        if n.startswith(f"ray_{PREFIX}")
    }


def ours_in_prometheus(prometheus: str) -> dict[tuple[str, frozenset], float]:
    """Our series as Prometheus holds them now, less the target labels it adds."""
    found = {}
    for series in instant_query(prometheus, f'{{__name__=~"ray_{PREFIX}.+"}}'):
        labels = {k: v for k, v in series["metric"].items() if k not in ("instance", "job")}
        name = labels.pop("__name__")
        found[(name, frozenset(labels.items()))] = float(series["value"][1])
    return found


def exported(
    metrics_url: str, requests_count: float, forward_calls: float, ranks: dict | None = None
) -> list:
    """The endpoint's samples once they count ``requests_count`` requests and
    ``forward_calls`` rank calls, and, given ``ranks`` (kind -> rank -> count), each rank's
    images, patches and tokens: the metrics agent exports every few seconds, and one
    export can carry a rank's stage counts before its counters of the same call."""
    deadline = time.monotonic() + METRICS_TIMEOUT_S
    while True:
        samples = scrape(metrics_url)
        short = {}  # (kind, rank) -> (have, want), for the rank counters not there yet
        for kind, by_rank in (ranks or {}).items():
            for rank, want in by_rank.items():
                have = total(samples, f"ray_{PREFIX}{kind}_total", rank=rank)
                if have != want:
                    short[(kind, rank)] = (have, want)
        if (
            total(samples, REQUESTS) == requests_count
            and total(samples, STAGE_COUNT, stage="forward") == forward_calls
            and not short
        ):
            return samples
        if time.monotonic() > deadline:
            pytest.fail(
                f"metrics not exported after {METRICS_TIMEOUT_S} s: want {requests_count} "
                f"requests and {forward_calls} forward calls, have {total(samples, REQUESTS)} "
                f"and {total(samples, STAGE_COUNT, stage='forward')}; rank counters "
                f"(have, want) not there yet: {short}"
            )
        time.sleep(1)


def image_items(images: list[bytes]) -> list[dict]:
    return [{"type": "image", "image": b64(b)} for b in images]


def send_accepted(url: str, images: list[bytes]) -> list[dict]:
    """Three JSON requests and one upload, each answered 200: their bodies."""
    bodies = []
    for part in (images[:3], images[3:5], images[5:9]):
        response = encode(url, image_items(part))
        assert response.status_code == 200, response.text
        bodies.append(response.json())
    upload = requests.post(f"{url}/v1/encode", files=[("image", ("a.png", images[0]))], timeout=120)
    assert upload.status_code == 200, upload.text
    return [*bodies, upload.json()]


def send_refused(url: str, images: list[bytes]) -> Counter:
    """Five requests the app refuses, each checked for its error type: the count of each."""
    refused = [  # (body, content type or None for JSON, outcome)
        ({"items": [{"type": "video", "video": "x"}]}, None, "invalid_request"),
        ({"items": [{"type": "image", "image": "%%%"}]}, None, "invalid_request"),
        ({"items": image_items([images[2]] * 11)}, None, "limit_exceeded"),
        ({"items": []}, None, "validation_error"),
        (b"hello", "text/plain", "unsupported_media_type"),
    ]
    for body, kind, outcome in refused:
        if kind is None:
            response = requests.post(f"{url}/v1/encode", json=body, timeout=60)
        else:
            response = requests.post(
                f"{url}/v1/encode", data=body, headers={"content-type": kind}, timeout=60
            )
        assert response.json()["error"]["type"] == outcome, response.text
    return Counter(outcome for _, _, outcome in refused)


def rank_counts(bodies: list[dict]) -> dict[str, Counter]:
    """Per rank label ("0", "1"): the images, patches and tokens ``bodies`` say it encoded,
    and its calls (one per request it owns an image of)."""
    want = {kind: Counter() for kind in ("images", "patches", "tokens", "calls")}
    for body in bodies:
        for rank in {str(i["owner_rank"]) for i in body["items"]}:
            want["calls"][rank] += 1
        for item in body["items"]:
            rank = str(item["owner_rank"])
            want["images"][rank] += 1
            want["patches"][rank] += int(np.prod(item["grid_thw"]))
            want["tokens"][rank] += item["num_tokens"]
    return want


def rank_series(samples, name: str, rank: str) -> list[float]:
    return [v for n, lab, v in samples if n == name and lab.get("rank") == rank]


def assert_rank_counted(samples, rank: str, want: dict[str, Counter]) -> None:
    """``rank``'s counters and stage counts equal ``want``; nothing of it is in flight."""
    for kind in ("images", "patches", "tokens"):
        assert total(samples, f"ray_{PREFIX}{kind}_total", rank=rank) == want[kind][rank], kind
    calls = want["calls"][rank]
    for stage in RANK_STAGES:  # one observation per call of that rank
        assert total(samples, STAGE_COUNT, stage=stage, rank=rank) == calls, (stage, rank)
    assert total(samples, STAGE_COUNT, stage="preprocess", rank=rank, backend="cpu") == calls
    for gauge in ("inflight_patches", "inflight_bytes"):  # nothing in flight now
        series = rank_series(samples, f"ray_{PREFIX}{gauge}", rank)
        assert series == [0.0], (gauge, rank, series)
    batch = rank_series(samples, f"ray_{PREFIX}batch_images", rank)
    assert len(batch) == 1, (rank, batch)
    assert batch[0] >= 1, (rank, batch)


def test_metrics_count_the_traffic(app, images, dashboard):
    accepted = send_accepted(app["url"], images)
    want_outcomes = Counter({"ok": len(accepted)}) + send_refused(app["url"], images)
    requests_count = sum(want_outcomes.values())
    want = rank_counts(accepted)
    assert set(want["images"]) == {"0", "1"}, "the traffic must reach both ranks"

    started = time.monotonic()
    counters = {kind: want[kind] for kind in ("images", "patches", "tokens")}
    samples = exported(app["metrics_url"], requests_count, sum(want["calls"].values()), counters)
    print(f"\nmetrics visible {time.monotonic() - started:.1f} s after the traffic")

    names = {n for n, _, _ in samples}
    missing = exported_names() - names
    assert not missing, f"not exported: {sorted(missing)}"
    for outcome, count in want_outcomes.items():
        assert total(samples, REQUESTS, outcome=outcome) == count, outcome
    for rank in ("0", "1"):
        assert_rank_counted(samples, rank, want)
    assert total(samples, f"ray_{PREFIX}images_total") == sum(want["images"].values()) == 10
    for stage, count in (
        ("admission", len(accepted)),
        ("gather", len(accepted)),
        ("end_to_end", requests_count),
    ):
        assert total(samples, STAGE_COUNT, stage=stage, rank=INGRESS_RANK) == count, stage
    tagged = {
        (lab.get("deployment"), lab.get("application"))
        for n, lab, _ in samples
        if n.startswith(f"ray_{PREFIX}")
    }
    assert {("EncodeServer", "obs"), ("EncoderRank_0", "obs"), ("EncoderRank_1", "obs")} <= tagged

    # Every query of the Grafana dashboard names a series the app exports.
    queried = set().union(*(metric_names(expr) for _, _, expr in queries(dashboard)))
    assert queried, "the dashboard queries no series"
    assert queried <= names, sorted(queried - names)


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bray_[a-z0-9_]+", expr))


def caught_up(prometheus: str, metrics_url: str) -> None:
    """Wait until Prometheus holds each of our series with the endpoint's value."""
    deadline = time.monotonic() + METRICS_TIMEOUT_S
    while (held := ours_in_prometheus(prometheus)) != (want := ours(scrape(metrics_url))):
        differ = sorted({k[0] for k in want.keys() | held.keys() if want.get(k) != held.get(k)})
        assert time.monotonic() < deadline, f"Prometheus never held the endpoint's {differ}"
        time.sleep(0.5)


def send_round(url: str, images: list[bytes]) -> None:
    """Two requests: one encoded by both ranks (a forward call on each), one refused."""
    response = encode(url, image_items(images[:3]))
    assert response.status_code == 200, response.text
    assert {item["owner_rank"] for item in response.json()["items"]} == {0, 1}
    response = encode(url, [])
    assert response.status_code == 422, response.text


def test_dashboard_queries_in_prometheus(app, prometheus, dashboard, images):
    """Prometheus scrapes the app; every query of the dashboard returns finite series.

    A rate needs two samples that differ inside its window, so Prometheus first holds
    the series as they are after one round of traffic, then as they are after another.
    """
    samples = scrape(app["metrics_url"])  # the traffic of the tests above, all exported
    requests_count = total(samples, REQUESTS)
    forward_calls = total(samples, STAGE_COUNT, stage="forward")
    for _ in range(2):
        send_round(app["url"], images)
        requests_count, forward_calls = requests_count + 2, forward_calls + 2
        exported(app["metrics_url"], requests_count, forward_calls)
        caught_up(prometheus, app["metrics_url"])

    # The dashboard's `application` variable lists our app.
    (variable,) = [v for v in dashboard["templating"]["list"] if v["name"] == "application"]
    metric, label = re.fullmatch(r"label_values\((\w+), *(\w+)\)", variable["definition"]).groups()
    response = requests.get(
        f"{prometheus}/api/v1/label/{label}/values", params={"match[]": metric}, timeout=30
    )
    assert response.json()["data"] == [QUERY_VARIABLES["application"]], response.text

    # A gauge lives in Ray's metrics agent for two of its emitter's export intervals after
    # each export: on a busy machine an export can come late and the series is gone from
    # a scrape or two until the next. Each query is asked again until it has its series.
    failed = []
    deadline = time.monotonic() + METRICS_TIMEOUT_S
    for title, ref, expr in queries(dashboard):
        while True:
            result = instant_query(prometheus, substitute(expr))
            values = {
                ",".join(f"{k}={v}" for k, v in sorted(s["metric"].items())): float(s["value"][1])
                for s in result
            }
            if values and all(math.isfinite(v) for v in values.values()):
                break
            if time.monotonic() > deadline:
                failed.append((title, ref, substitute(expr), values))
                break
            time.sleep(0.5)
        print(f"{title} [{ref}]: {values}")
    assert not failed, failed


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
    assert summary["outcome"] == "ok"
    assert summary["status"] == 200
    assert summary["images"] == 3
    assert summary["patches"] == body["usage"]["patches"]
    assert summary["owners"] == [item["owner_rank"] for item in body["items"]]
    assert set(summary["stages_ms"]) == {"admission", "gather", "end_to_end"}
    assert {int(r) for r in summary["ranks_ms"]} == owners
    for rank in owners:
        assert set(summary["ranks_ms"][str(rank)]) == set(RANK_STAGES)
        encoded = [r for r in found[f"EncoderRank_{rank}"] if "kimi_encoder_rank" in r]
        assert len(encoded) == 1
        assert encoded[0]["kimi_encoder_rank"]["rank"] == rank


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


def test_is_a_dashboard(dashboard):
    assert {"title", "uid", "panels", "templating", "schemaVersion", "time"} <= set(dashboard)
    assert dashboard["uid"] == "kimi-encoder"
    assert isinstance(dashboard["schemaVersion"], int)
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"}, panel["title"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel["title"], panel["id"]
        if panel["type"] == "row":
            continue
        assert panel["type"] == "timeseries"
        assert panel["datasource"]["uid"] == "${datasource}"
        refs = [t["refId"] for t in panel["targets"]]
        assert refs, panel["title"]
        assert len(refs) == len(set(refs)), panel["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])


def test_variables_are_defined(dashboard):
    """Each variable a panel uses is the dashboard's own or Grafana's (``$__...``), and
    ``QUERY_VARIABLES`` has a value for each one a query uses."""
    defined = {v["name"] for v in dashboard["templating"]["list"]}
    used = {a or b for a, b in _VARIABLE.findall(json.dumps(dashboard["panels"]))}
    assert {u for u in used if not u.startswith("__")} <= defined, used - defined
    queried = {a or b for _, _, expr in queries(dashboard) for a, b in _VARIABLE.findall(expr)}
    assert queried <= set(QUERY_VARIABLES), queried - set(QUERY_VARIABLES)


def test_every_query_names_an_exported_metric(dashboard):
    named = [metric_names(expr) for _, _, expr in queries(dashboard)]
    assert all(named), "every query names a metric"
    assert set().union(*named) <= exported_names(), set().union(*named) - exported_names()


def test_covers_load_latency_throughput_and_errors(dashboard):
    text = "\n".join(expr for _, _, expr in queries(dashboard))
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
    assert 'outcome!="ok"' in text
    assert "histogram_quantile(0.99" in text
