"""Clients that attack or go away: trickling bodies, image bombs and foreign formats, a
flood abandoned mid-way, an ingress replica killed under a running client job.

Each test runs its own dp-2 app with two ingress replicas beside checked load
(``load.py``); bounds are docs/api.md's ("Faults and limits"), figures printed.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import ray
import requests
from images import ico_bomb, image_bytes, zero_png
from ray import serve
from serve_helpers import app_args, b64

from chaos.load import Load, pool, summary
from deployments.app import bind_app
from deployments.args import BodyPace, RequestLimits

SLOW_CONNECTIONS = 100
BODY_GRACE_S = BodyPace().grace_s  # the chaos apps keep it
DEFAULT_LIMITS = {"ingress": {"limits": RequestLimits().model_dump()}}


@pytest.fixture
def apps(serve_url):
    """``apps(name, *layers)``: a dp-2 app of the test's own, deleted when the test ends, so
    that no idle app of an earlier test shares the machine with the next one's load."""
    created = []

    def run(name: str, *layers: dict) -> str:
        args = app_args(
            {"ingress": {"replicas": 2}, "ranks": {"cache_bytes": 0}}, *layers, dp_size=2
        )
        serve.run(bind_app(args), name=name, route_prefix=f"/{name}")
        created.append(name)
        return f"{serve_url}/{name}"

    yield run
    for name in created:
        serve.delete(name)


@pytest.fixture(scope="module")
def chaos_images(reference):
    return pool(reference, seed=100)


def replica_pids(app: str, deployment: str) -> list[int]:
    title = f"ServeReplica:{app}:{deployment}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and title in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:  # a process that exited while we looked
            pass
    return pids


def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


def open_post(url: str, length: int, timeout_s: float) -> socket.socket:
    """A connection to ``url``'s server that has sent the head of a JSON POST to it
    announcing a ``length``-byte body, and none of the body yet."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout_s)
    sock.sendall(
        f"POST {parts.path} HTTP/1.1\r\nHost: {parts.hostname}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n".encode()
    )
    return sock


class SlowBodies:
    """``count`` connections that each send one body byte every 2 s, re-opened when the
    server answers; every answer is recorded with how long its connection lived."""

    def __init__(self, url: str, count: int):
        self.url = f"{url}/v1/encode"
        self.count = count
        self.answers: list[tuple[int, float, str]] = []  # (status, seconds, error type)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SlowBodies:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def _open(self) -> tuple[socket.socket, float]:
        sock = open_post(self.url, 100000, timeout_s=10)
        sock.sendall(b"{")
        sock.setblocking(False)
        return sock, time.monotonic()

    def _run(self) -> None:
        # Opened over the first 5 s, as an attacker's would be, then re-opened as answered.
        conns: dict[socket.socket, float] = {}
        next_open = next_byte = time.monotonic()
        while not self._stop.is_set():
            if len(conns) < self.count and time.monotonic() >= next_open:
                sock, started = self._open()
                conns[sock] = started
                next_open += 5 / self.count
            readable, _, _ = select.select(list(conns), [], [], 0.02)
            for sock in readable:
                opened = conns.pop(sock)
                self._record(sock, time.monotonic() - opened)
                sock.close()
                new, started = self._open()
                conns[new] = started
            if time.monotonic() >= next_byte:
                for sock in conns:
                    # Answered and closed meanwhile: read on the next turn.
                    with contextlib.suppress(OSError):
                        sock.send(b" ")
                next_byte += 2
        for sock in conns:
            sock.close()

    def _record(self, sock: socket.socket, seconds: float) -> None:
        sock.setblocking(True)
        sock.settimeout(5)
        data = b""
        try:
            while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        except OSError:
            pass
        head, _, body = data.partition(b"\r\n\r\n")
        status = int(head.split()[1]) if head else 0
        try:
            kind = json.loads(body)["error"]["type"]
        except (ValueError, KeyError, TypeError):
            kind = "not-json"
        self.answers.append((status, seconds, kind))


def test_trickling_bodies_hold_no_slot_of_the_encode_path(apps, chaos_images):
    url = apps("chaos_slow")
    with Load(url, *chaos_images, clients=4) as load:
        time.sleep(11)
        unloaded = summary(load.since(time.monotonic() - 10))
        started = time.monotonic()
        with SlowBodies(url, SLOW_CONNECTIONS) as slow:
            time.sleep(25)
            healthz = requests.get(f"{url}/healthz", timeout=5)
        during = summary(load.since(started, started + 25))
    ok = during["statuses"].get(200, 0) / max(during["requests"], 1)
    refused = [a for a in slow.answers]
    print(f"\nslow bodies: unloaded {unloaded}; with {SLOW_CONNECTIONS} trickling {during}; "
          f"{len(refused)} trickling answered, e.g. {refused[:2]}")  # fmt: skip
    assert healthz.status_code == 200
    assert during["wrong"] == 0
    assert ok >= 0.95
    # A held slot shows as 503s (above) or as normal requests waiting for a trickling
    # body's deadline (body_pace.grace_s, 10 s from its start; tricklers start 50 ms apart,
    # so a held request waits 5 s on average, and with every slot held
    # every request waits up to 10 s). The trickling sockets' own CPU (proxy, ingress,
    # this process) slows normal requests too on 2 cores: 2x on a quiet machine, 4x with
    # a busy core (p99 0.79 -> 3.19 s and 0.92 -> 3.55 s in two runs). The bound is that
    # average wait of a held request on top of the unloaded p99.
    assert during["p99_s"] <= max(2 * unloaded["p99_s"], unloaded["p99_s"] + BODY_GRACE_S / 2)
    assert refused, "no trickling connection was answered"
    assert all(status in (408, 413) for status, _, _ in refused), refused[:5]
    assert all(kind in ("body_timeout", "limit_exceeded") for _, _, kind in refused)
    assert all(seconds <= BODY_GRACE_S + 3 for _, seconds, _ in refused)  # + the 2 s tick


def test_bombs_and_foreign_formats_never_reach_a_rank(apps):
    url = apps("chaos_formats", DEFAULT_LIMITS)
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    psd = b"8BPS\x00\x01" + bytes(20)
    before = [r["calls"] for r in requests.get(f"{url}/v1/info", timeout=30).json()["ranks"]]
    pids = replica_pids("chaos_formats", "EncodeServer")
    rss_before = rss_mb(pids)
    bomb = ico_bomb()

    def healthz_s() -> float:
        sent = time.monotonic()
        assert requests.get(f"{url}/healthz", timeout=5).status_code == 200
        return time.monotonic() - sent

    # The machine's own hiccups set the bar: /healthz polled as often without bombs.
    unloaded = max(healthz_s() for _ in range(40))
    worst_healthz = 0.0
    with_bombs = threading.Event()

    def send_bombs():
        for _ in range(8):
            answer = requests.post(f"{url}/v1/encode", files={"image": ("x.ico", bomb)})
            assert answer.status_code == 415, answer.text
            assert "ICO" in answer.text, answer.text
        with_bombs.set()

    thread = threading.Thread(target=send_bombs)
    thread.start()
    while not with_bombs.is_set():
        worst_healthz = max(worst_healthz, healthz_s())
    thread.join()
    for name, data in [("x.eps", eps), ("x.psd", psd), ("renamed.png", eps)]:
        answer = requests.post(f"{url}/v1/encode", files={"image": (name, data)})
        assert answer.status_code == 415, answer.text
        assert answer.json()["error"]["type"] == "unsupported_media_type"
    after = [r["calls"] for r in requests.get(f"{url}/v1/info", timeout=30).json()["ranks"]]
    growth = rss_mb(pids) - rss_before
    print(
        f"\nICO bombs: /healthz at worst {worst_healthz * 1e3:.1f} ms (without bombs "
        f"{unloaded * 1e3:.1f} ms); ingress RSS +{growth:.1f} MB"
    )
    assert after == before  # nothing reached a rank
    # Decoding one bomb (169 MB of pixels) on the event loop would stall it for longer
    # than the 0.2 s allowed over the machine's own worst.
    assert worst_healthz <= max(2 * unloaded, unloaded + 0.2)
    assert growth <= 50


def rank_counts(url: str) -> dict[str, int]:
    """The ranks' summed counters, and their outstanding images, from ``/v1/info``."""
    ranks = requests.get(f"{url}/v1/info", timeout=30).json()["ranks"]
    counts = {k: sum(r[k] for r in ranks) for k in ("forwarded", "dropped")}
    return {**counts, "outstanding": sum(r["outstanding"]["images"] for r in ranks)}


@contextlib.contextmanager
def abandoned_post(url: str, body: bytes) -> Iterator[None]:
    """POST ``body`` to ``url`` and hang up, unanswered, when the block ends."""
    sock = open_post(url, len(body), timeout_s=30)
    try:
        sock.sendall(body)
        yield
    finally:
        sock.close()


def test_an_abandoned_flood_is_dropped(apps, chaos_images):
    url = apps("chaos_flood", DEFAULT_LIMITS)
    # 48 distinct zero-filled 7000 x ~7000 PNGs (a few MB in all; ~2.3 GB of pixels):
    # three batches' worth (16 x 1024 patches each), each image a long decode.
    pngs = [zero_png(7000, 7000 - k) for k in range(48)]
    flood = {"items": [{"type": "image", "image": b64(png)} for png in pngs]}
    before = rank_counts(url)
    # The client goes away once the ranks hold all 48 (queued and decoding; a forward
    # needs 16 of them decoded first), whatever the machine's speed.
    sent = time.monotonic()
    with abandoned_post(f"{url}/v1/encode", json.dumps(flood).encode()):
        while rank_counts(url)["outstanding"] < 48:
            assert time.monotonic() - sent < 120, "the flood never reached the ranks"
            time.sleep(0.05)
    gone_at = time.monotonic()
    small = [{"type": "image", "image": b64(chaos_images[0][0])}]
    answer = requests.post(f"{url}/v1/encode", json={"items": small}, timeout=120)
    small_s = time.monotonic() - gone_at
    while (after := rank_counts(url))["outstanding"]:
        assert time.monotonic() - gone_at < 120, "the flood's images stayed outstanding"
        time.sleep(0.1)
    drained_s = time.monotonic() - gone_at
    forwarded = after["forwarded"] - before["forwarded"]
    dropped = after["dropped"] - before["dropped"]
    print(f"\nflood abandoned: a small request took {small_s:.2f} s; outstanding work 0 "
          f"after {drained_s:.2f} s; {dropped} queued images taken back, {forwarded} "
          f"forwarded (the small one included)")  # fmt: skip
    assert answer.status_code == 200, answer.text
    # The promise is counted, not timed: a rank takes back every image of the abandoned
    # call whose forward has not begun, also those of a batch still decoding; a forward
    # that has begun (at most one batch of 16 per rank) runs to its end. Kept, all 48
    # flood images would go through the tower, the small request's behind most of them.
    assert forwarded <= 2 * 16 + len(small) * 2  # the small image, hedged at most once
    assert dropped >= 48 - 2 * 16  # hedged copies only add to them


def test_ingress_replica_killed_under_a_client_job(apps, chaos_images, tmp_path):
    url = apps("chaos_ingress")
    files = tmp_path / "in"
    files.mkdir()
    for k in range(160):
        (files / f"{k:03d}.png").write_bytes(image_bytes("RGB", (40 + k % 50, 30 + k % 40), k))
    client = Path(sys.executable).parent / "kimi-encoder"
    load = Load(url, *chaos_images, clients=4).__enter__()
    job = subprocess.Popen(
        [str(client), "client", "--url", url, "--batch-size", "2", "--concurrency", "4",
         "--out", str(tmp_path / "out"), str(files)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    while not any((tmp_path / "out").rglob("*.safetensors")):
        assert job.poll() is None, job.stderr.read()
        time.sleep(0.05)
    victim = next(
        a["Name"]
        for a in ray._private.state.actors().values()
        if a["State"] == "ALIVE" and "chaos_ingress#EncodeServer#" in a["Name"]
    )
    killed_at = time.monotonic()
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    _, err = job.communicate(timeout=300)
    time.sleep(2)  # the load goes on past the job: a window of answers after the kill
    load.stop()
    after = [o for o in load.outcomes if o.sent + o.seconds >= killed_at]
    failed = [o for o in after if o.status != 200]
    written = sorted(p.name for p in (tmp_path / "out").rglob("*.safetensors"))
    causes = [(o.status, o.error[:60]) for o in failed]
    print(f"\ningress replica killed: client job {err.strip().splitlines()[-1]}; load after "
          f"the kill {summary(after)}; failed {causes}")  # fmt: skip
    assert job.returncode == 0, err
    assert len(written) == 160  # nothing lost: the client retried what the kill failed
    assert sum(o.wrong for o in after) == 0
    assert len(failed) <= 4  # at most the load's requests in flight on the killed replica
    assert all(o.status is None or o.status >= 500 for o in failed)
