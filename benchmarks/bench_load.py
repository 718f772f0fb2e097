"""Load test on loopback: nothing lost, nothing wrong, no unexpected 5xx.

    python -m benchmarks.bench_load [--clients 16] [--seconds 60] [--dp 2] [--url URL]

Closed loop: ``clients`` threads each send requests back to back for
``seconds``. A request carries 1 to 4 images drawn from a seeded catalog of
mixed sizes (so images repeat across requests, and sometimes within one) and
is JSON or multipart, JSON or safetensors response, at random. Every
response's features are checked against the in-process ``VisionEncoder``'s
features of *its own* images: same grid, same shape, and a digest of the
features rounded to ``DIGITS`` decimals, falling back to ``atol`` when a
value sits on a rounding edge (batched and cached features may differ from
one-image encodes in the last bits; tests/kimi_encoder/test_encoder.py bounds that at 1e-5).

Counted per request: ``ok``; ``wrong`` (a 200 whose features or grids are not
its images'); ``lost`` (no answer: connection error or client timeout);
``unexpected_5xx`` (a 5xx other than a 503 with ``Retry-After``, or any 4xx);
``retried_503`` (a 503 with ``Retry-After``: backpressure, retried after the
given delay, at most ``MAX_RETRIES`` times, then counted lost). Throughput is
images (and requests) answered 200 per second; latency percentiles include
retries. Without ``--url`` a one-machine Ray cluster and a dp-``--dp`` app
(tiny preset, CPU, cache on) are started here. tests/serve/test_load.py runs
a short version (4 clients x 15 s) in CI.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures as cf
import hashlib
import json
import random
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import requests
import torch
from safetensors.numpy import load as load_safetensors

from kimi_encoder.encoder import VisionEncoder

from .inputs import image
from .serving import app_args, bind, free_port

# (width, height): tiny thumbnails to the tiny preset's largest (it scales 500x375 down).
SIZES = [(28, 28), (64, 48), (100, 37), (128, 96), (224, 224), (320, 240), (500, 375)]
CATALOG = 24  # distinct images; requests draw from them, so images repeat
MAX_IMAGES = 4
MAX_RETRIES = 20
DIGITS = 4  # digest precision (features are O(1); batching differs below 1e-5)
ATOL = 1e-5


def catalog(count: int = CATALOG, seed: int = 0) -> list[bytes]:
    return [image(*SIZES[i % len(SIZES)], seed=seed + i) for i in range(count)]


def digest(features: np.ndarray) -> str:
    rounded = np.round(features.astype(np.float64), DIGITS) + 0.0  # -0.0 -> 0.0
    return hashlib.sha256(rounded.tobytes() + str(features.shape).encode()).hexdigest()


@dataclass
class Expected:
    grid: list[int]
    features: np.ndarray
    digest: str


def references(images: list[bytes], checkpoint: str = "tiny") -> list[Expected]:
    """In-process features of each catalog image (one torch thread, as a rank with num_cpus 0)."""
    encoder = VisionEncoder.from_pretrained(
        checkpoint, device="cpu", dtype="float32", backend="cpu"
    )
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = []
        for data in images:
            item = encoder.plan(data)
            features = encoder.encode([item])[0].numpy()
            out.append(Expected(list(item.grid), features, digest(features)))
        return out
    finally:
        torch.set_num_threads(before)


@dataclass
class Tally:
    ok: int = 0
    wrong: int = 0
    lost: int = 0
    unexpected_5xx: int = 0
    unexpected_4xx: int = 0
    retried_503: int = 0
    images: int = 0
    bit_exact: int = 0  # images whose digest matched (the rest matched within ATOL)
    latencies: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def merge(self, other: Tally) -> None:
        for name in ("ok", "wrong", "lost", "unexpected_5xx", "unexpected_4xx", "retried_503"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.images += other.images
        self.bit_exact += other.bit_exact
        self.latencies += other.latencies
        self.problems += other.problems[:5]


def _send(
    session: requests.Session, url: str, images: list[bytes], multipart: bool, fmt: str
) -> requests.Response:
    if multipart:
        files = [("image", (f"{i}.png", data, "image/png")) for i, data in enumerate(images)]
        return session.post(
            f"{url}/v1/encode", files=files, data={"response_format": fmt}, timeout=120
        )
    items = [{"type": "image", "image": base64.b64encode(b).decode()} for b in images]
    return session.post(
        f"{url}/v1/encode", json={"items": items, "response_format": fmt}, timeout=120
    )


def _answers(response: requests.Response, fmt: str, count: int) -> list[tuple[list, np.ndarray]]:
    """(grid, features) per item of a 200 response."""
    if fmt == "safetensors":
        tensors = load_safetensors(response.content)
        return [
            (tensors[f"grid_thw.{i}"][0].tolist(), tensors[f"features.{i}"]) for i in range(count)
        ]
    items = response.json()["items"]
    assert [item["index"] for item in items] == list(range(len(items)))
    return [
        (
            item["grid_thw"],
            np.frombuffer(base64.b64decode(item["data"]), "<f4").reshape(item["shape"]),
        )
        for item in items
    ]


def check(answers: list[tuple[list, np.ndarray]], expected: list[Expected], tally: Tally) -> bool:
    if len(answers) != len(expected):
        tally.problems.append(f"{len(answers)} items for {len(expected)} images")
        return False
    for i, ((grid, features), want) in enumerate(zip(answers, expected, strict=True)):
        if list(grid) != want.grid or features.shape != want.features.shape:
            tally.problems.append(f"item {i}: grid {grid} {features.shape}, want {want.grid}")
            return False
        if digest(features) == want.digest:
            tally.bit_exact += 1
        elif not np.allclose(features, want.features, rtol=0, atol=ATOL):
            err = float(np.abs(features - want.features).max())
            tally.problems.append(f"item {i}: features differ by {err:.3g}")
            return False
    return True


def client(
    url: str,
    images: list[bytes],
    expected: list[Expected],
    deadline: float,
    seed: int,
    at_least: int = 0,
) -> Tally:
    """One closed-loop client until ``deadline``, and on past it until it has sent
    ``at_least`` requests (a busy machine answers fewer in the window)."""
    rng = random.Random(seed)
    tally = Tally()
    session = requests.Session()
    sent = 0
    while time.monotonic() < deadline or sent < at_least:
        sent += 1
        picks = [rng.randrange(len(images)) for _ in range(rng.randint(1, MAX_IMAGES))]
        multipart, fmt = rng.random() < 0.3, rng.choice(["json", "json", "safetensors"])
        started = time.perf_counter()
        for attempt in range(MAX_RETRIES + 1):
            try:
                response = _send(session, url, [images[p] for p in picks], multipart, fmt)
            except requests.RequestException as exc:
                tally.lost += 1
                tally.problems.append(f"lost: {type(exc).__name__}: {exc}")
                break
            if response.status_code == 503 and "retry-after" in response.headers:
                if attempt == MAX_RETRIES:
                    tally.lost += 1
                    tally.problems.append(f"lost: still 503 after {MAX_RETRIES} retries")
                    break
                tally.retried_503 += 1
                time.sleep(min(float(response.headers["retry-after"]), 2.0))
                continue
            if response.status_code >= 500:
                tally.unexpected_5xx += 1
                tally.problems.append(f"{response.status_code}: {response.text[:200]}")
            elif response.status_code != 200:
                tally.unexpected_4xx += 1
                tally.problems.append(f"{response.status_code}: {response.text[:200]}")
            elif check(_answers(response, fmt, len(picks)), [expected[p] for p in picks], tally):
                tally.ok += 1
                tally.images += len(picks)
                tally.latencies.append(time.perf_counter() - started)
            else:
                tally.wrong += 1
            break
    return tally


def run_load(
    url: str,
    clients: int,
    seconds: float,
    seed: int = 0,
    checkpoint: str = "tiny",
    at_least: int = 0,
) -> dict:
    """Run the load and return its figures (see the module docstring): for ``seconds``,
    and on until ``at_least`` requests were sent in all."""
    images = catalog(seed=seed)
    expected = references(images, checkpoint)
    started = time.monotonic()
    deadline = started + seconds
    total = Tally()
    with cf.ThreadPoolExecutor(clients) as pool:
        futures = [
            pool.submit(
                client, url, images, expected, deadline, seed * 1000 + k, -(-at_least // clients)
            )
            for k in range(clients)
        ]
        for future in futures:
            total.merge(future.result())
    elapsed = time.monotonic() - started
    lat = np.array(total.latencies) * 1e3 if total.latencies else np.zeros(1)
    return {
        "clients": clients,
        "seconds": round(elapsed, 1),
        "requests_ok": total.ok,
        "images_ok": total.images,
        "images_bit_exact": total.bit_exact,
        "lost": total.lost,
        "wrong": total.wrong,
        "unexpected_5xx": total.unexpected_5xx,
        "unexpected_4xx": total.unexpected_4xx,
        "retried_503": total.retried_503,
        "requests_per_s": round(total.ok / elapsed, 2),
        "images_per_s": round(total.images / elapsed, 2),
        "p50_ms": round(float(np.percentile(lat, 50)), 1),
        "p99_ms": round(float(np.percentile(lat, 99)), 1),
        "max_ms": round(float(lat.max()), 1),
        "problems": total.problems[:10],
    }


def _local_app(dp: int) -> str:
    """Start a one-machine Ray cluster and a dp-``dp`` app on a free loopback port."""
    import ray
    from ray import serve

    port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = app_args(dp_size=dp, device="cpu", preprocess_backend="cpu")
    serve.run(bind(args), name="load", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--dp", type=int, default=2, help="ranks of the local app (no --url)")
    parser.add_argument("--url", help="a running server instead of a local app")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    url = args.url or _local_app(args.dp)
    figures = run_load(url, args.clients, args.seconds, args.seed)
    print(json.dumps(figures, indent=2))
    bad = figures["lost"] + figures["wrong"] + figures["unexpected_5xx"]
    return 1 if bad or figures["unexpected_4xx"] else 0


if __name__ == "__main__":
    sys.exit(main())
