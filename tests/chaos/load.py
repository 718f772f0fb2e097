"""Closed-loop clients for the chaos tests: every answer checked, every outcome timed.

Each client thread sends requests of 1 or 2 images drawn from a seeded pool, waits
for the answer and sends the next. A 200's features must equal the in-process
encoder's for its own images (bit for bit up to 1e-5; the ranks run the same
tiny model on one thread); anything else is recorded as it came (status,
``Retry-After``), and a request that got no HTTP answer at all is *lost*.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np
import requests
from images import image_bytes
from serve_helpers import b64, decode_features, one_thread

SIZES = [(96, 64), (64, 48), (120, 90), (80, 56), (56, 84), (70, 70), (150, 100), (40, 40)]


def pool(reference, count: int = 16, seed: int = 0) -> tuple[list[bytes], list[np.ndarray]]:
    """``count`` seeded images of mixed sizes and modes, and their expected features."""
    images = [
        image_bytes("RGBA" if i % 3 == 0 else "RGB", SIZES[i % len(SIZES)], 20_000 + seed + i)
        for i in range(count)
    ]
    with one_thread():
        features = [f.numpy() for f in reference.encode([reference.plan(b) for b in images])]
    return images, features


@dataclass
class Outcome:
    sent: float  # time.monotonic()
    seconds: float
    status: int | None  # None: no HTTP answer (lost)
    owners: list[int] = field(default_factory=list)
    retry_after: str | None = None
    wrong: bool = False
    error: str = ""


class Load:
    """``clients`` threads sending requests to ``url`` until ``stop()``."""

    def __init__(self, url: str, images, features, clients: int = 8, timeout_s: float = 30):
        self.url = url
        self.images, self.features = images, features
        self.clients = clients
        self.timeout_s = timeout_s
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(clients)
        ]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(self.timeout_s + 10)
        return self.outcomes

    def since(self, start: float, until: float = float("inf")) -> list[Outcome]:
        """Outcomes of requests sent in [start, until) (``time.monotonic()``)."""
        with self._lock:
            return [o for o in self.outcomes if start <= o.sent < until]

    def _client(self, k: int) -> None:
        rng = np.random.default_rng(k)
        while not self._stop.is_set():
            picks = rng.choice(len(self.images), size=int(rng.integers(1, 3)), replace=False)
            outcome = self._one([int(i) for i in picks])
            with self._lock:
                self.outcomes.append(outcome)

    def _one(self, picks: list[int]) -> Outcome:
        items = [{"type": "image", "image": b64(self.images[i])} for i in picks]
        sent = time.monotonic()
        try:
            response = requests.post(
                f"{self.url}/v1/encode", json={"items": items}, timeout=self.timeout_s
            )
        except requests.RequestException as exc:
            return Outcome(sent, time.monotonic() - sent, None, error=type(exc).__name__)
        seconds = time.monotonic() - sent
        if response.status_code != 200:
            return Outcome(
                sent,
                seconds,
                response.status_code,
                retry_after=response.headers.get("Retry-After"),
                error=response.text[:200],
            )
        body = response.json()["items"]
        wrong = len(body) != len(picks) or any(
            not np.allclose(decode_features(item), self.features[i], rtol=0, atol=1e-5)
            for item, i in zip(body, picks, strict=False)
        )
        return Outcome(sent, seconds, 200, [item["owner_rank"] for item in body], wrong=wrong)


def summary(outcomes: list[Outcome]) -> dict:
    """Counts and latency percentiles (seconds) of ``outcomes``, for the test's printout."""
    seconds = np.array([o.seconds for o in outcomes]) if outcomes else np.zeros(1)
    statuses: dict = {}
    for o in outcomes:
        statuses[o.status] = statuses.get(o.status, 0) + 1
    return {
        "requests": len(outcomes),
        "statuses": statuses,
        "wrong": sum(o.wrong for o in outcomes),
        "lost": sum(o.status is None for o in outcomes),
        "p50_s": round(float(np.percentile(seconds, 50)), 3),
        "p99_s": round(float(np.percentile(seconds, 99)), 3),
        "max_s": round(float(seconds.max()), 3),
    }


def wait_rejoined(load: Load, rank: int, since: float, within_s: float) -> float:
    """Seconds after ``since`` until a checked answer came from ``rank``."""
    deadline = since + within_s
    while time.monotonic() < deadline:
        answered = [o for o in load.since(since) if o.status == 200 and rank in o.owners]
        if answered:
            return min(o.sent + o.seconds for o in answered) - since
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} did not take work within {within_s} s")
