"""The served path: real Ray Serve over HTTP on this machine.

    python -m benchmarks.bench_serve [--quick]

One Ray cluster; apps with dp 1 and dp 2, each rank reserving one logical CPU
(so one torch thread), deployed side by side; every comparison uses the same
request stream in the same run.

1. Serving overhead: dp 1 over HTTP at saturation (closed loop, 4 clients) vs
   the same requests encoded in-process, one at a time, one torch thread.
2. DP scaling: dp 2 vs dp 1 at saturation (closed loop, 8 clients).
4. Cache: latency of a first request for an image vs the same image again;
   hit rate of a Zipf(1.1) stream over a catalog of images.
5. Latency vs offered load: open-loop Poisson arrivals at fractions of dp 1's
   saturated throughput; p50/p95/p99 per dp size; the knee is the first load
   whose p95 is over twice the lightest load's.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures as cf
import socket
import sys
import threading
import time

import numpy as np
import requests
import torch

from kimi_encoder.encoder import VisionEncoder

from .common import conditions, image, pyplot, save_plot, table

MIX = [(320, 240), (448, 336), (224, 224), (640, 480), (256, 192), (512, 384)]
PER_REQUEST = 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def request_stream(count: int, seed: int = 0) -> list[list[bytes]]:
    """``count`` requests of PER_REQUEST distinct images cycling through MIX."""
    out = []
    for r in range(count):
        out.append(
            [
                image(*MIX[(r * PER_REQUEST + i) % len(MIX)], seed=seed + r * PER_REQUEST + i)
                for i in range(PER_REQUEST)
            ]
        )
    return out


def body(images: list[bytes]) -> dict:
    return {"items": [{"type": "image", "image": base64.b64encode(b).decode()} for b in images]}


def post(session: requests.Session, url: str, images: list[bytes]) -> float:
    start = time.perf_counter()
    r = session.post(f"{url}/v1/encode", json=body(images), timeout=600)
    r.raise_for_status()
    return time.perf_counter() - start


_local = threading.local()


def _session() -> requests.Session:
    if not hasattr(_local, "s"):
        _local.s = requests.Session()
    return _local.s


def closed_loop(url: str, stream: list[list[bytes]], clients: int, seconds: float) -> float:
    """Images per second with ``clients`` back-to-back senders for about ``seconds``."""
    stop = time.perf_counter() + seconds
    done = [0]
    lock = threading.Lock()

    def client(k: int) -> None:
        i = k
        while time.perf_counter() < stop:
            post(_session(), url, stream[i % len(stream)])
            with lock:
                done[0] += 1
            i += clients

    start = time.perf_counter()
    with cf.ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    return done[0] * PER_REQUEST / (time.perf_counter() - start)


def _try_post(url: str, images: list[bytes]) -> float:
    """Latency, or NaN for a failed request (overload past the timeout: counted, not fatal)."""
    try:
        return post(_session(), url, images)
    except requests.RequestException:
        return float("nan")


def open_loop(url: str, stream, rate: float, seconds: float, seed: int) -> list[float]:
    """Latencies of Poisson arrivals at ``rate`` requests/s for ``seconds`` (NaN: failed)."""
    rng = np.random.default_rng(seed)
    futures = []
    with cf.ThreadPoolExecutor(64) as pool:
        start = time.perf_counter()
        t, i = 0.0, 0
        while t < seconds:
            delay = start + t - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(_try_post, url, stream[i % len(stream)]))
            i += 1
            t += rng.exponential(1 / rate)
        return [f.result() for f in futures]


def in_process(preset: str, stream, seconds: float) -> float:
    torch.set_num_threads(1)
    enc = VisionEncoder.from_pretrained(preset, device="cpu", backend="cpu")
    enc.encode([enc.plan(b) for b in stream[0]])  # warm-up
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        enc.encode([enc.plan(b) for b in stream[count % len(stream)]])
        count += 1
    return count * PER_REQUEST / (time.perf_counter() - start)


def deploy(serve, base: str, name: str, preset: str, dp: int, **overrides) -> str:
    from deployments.app import bind_app
    from deployments.args import AppArgs

    args = AppArgs(
        checkpoint=preset,
        dp_size=dp,
        device="cpu",
        preprocess_backend="cpu",
        rank_actor_options={"num_cpus": 1},
        request_timeout_s=600,  # overload points queue for long; measure, do not time out
        **overrides,
    )
    fast = {"graceful_shutdown_wait_loop_s": 0.1, "graceful_shutdown_timeout_s": 1}
    app = bind_app(args, fast, {"max_ongoing_requests": 256})
    serve.run(app, name=name, route_prefix=f"/{name}")
    return f"{base}/{name}"


def rank_counters(url: str) -> list[dict]:
    return requests.get(f"{url}/v1/info", timeout=30).json()["ranks"]


def run(quick: bool) -> dict:
    import ray
    from ray import serve

    preset = "tiny" if quick else "small"
    window = 6.0 if quick else 20.0
    stream = request_stream(24)
    mix = f"{PER_REQUEST} images per request, sizes {MIX} (px)"
    out: dict = {"preset": preset}

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    try:
        nocache = dict(feature_cache_bytes=0)
        dp1 = deploy(serve, base, "dp1", preset, 1, **nocache)
        dp2 = deploy(serve, base, "dp2", preset, 2, **nocache)
        for url in (dp1, dp2):
            post(_session(), url, stream[0])  # warm-up

        local = in_process(preset, stream, window)
        served1 = closed_loop(dp1, stream, 4, window)
        out["overhead"] = (
            conditions(preset, mix, "1 (served) vs in-process, 1 torch thread", quick),
            [
                ["in-process encode", f"{local:.2f}", "1.00"],
                ["HTTP, dp 1 (4 clients)", f"{served1:.2f}", f"{served1 / local:.2f}"],
            ],
        )
        sat1 = closed_loop(dp1, stream, 8, window)
        sat2 = closed_loop(dp2, stream, 8, window)
        out["scaling"] = (
            conditions(preset, mix, "1 and 2, one torch thread per rank", quick),
            [
                ["dp 1 (8 clients)", f"{sat1:.2f}", "1.00"],
                ["dp 2 (8 clients)", f"{sat2:.2f}", f"{sat2 / sat1:.2f}"],
            ],
        )

        cached = deploy(serve, base, "cached", preset, 1, feature_cache_bytes=256 << 20)
        firsts, repeats = [], []
        for k in range(4 if quick else 10):
            images = [image(640, 480, seed=5000 + k)]
            firsts.append(post(_session(), cached, images))
            repeats.append(min(post(_session(), cached, images) for _ in range(3)))
        catalog = [image(*MIX[k % len(MIX)], seed=6000 + k) for k in range(50)]
        rng = np.random.default_rng(0)
        draws = [min(int(rng.zipf(1.1)), len(catalog)) - 1 for _ in range(60 if quick else 200)]
        before = rank_counters(cached)[0]
        for d in draws:
            post(_session(), cached, [catalog[d]])
        after = rank_counters(cached)[0]
        hits = after["cache_hits"] - before["cache_hits"]
        first_ms, again_ms = np.median(firsts) * 1e3, np.median(repeats) * 1e3
        out["cache"] = (
            conditions(preset, "one 640x480 image per request", "1", quick),
            [
                ["first request (miss), median ms", f"{first_ms:.1f}"],
                ["same image again (hit), median ms", f"{again_ms:.1f}"],
                ["speed-up", f"{first_ms / again_ms:.1f}x"],
                [
                    f"Zipf(1.1) over 50 images, {len(draws)} requests: hit rate",
                    f"{hits / len(draws):.2f} (distinct: {len(set(draws))})",
                ],
            ],
        )

        fractions = [0.2, 0.5, 0.8, 1.0, 1.3] if quick else [0.1, 0.3, 0.5, 0.7, 0.9, 1.1, 1.4]
        curves = {}
        for dp, url in ((1, dp1), (2, dp2)):
            points = []
            for j, f in enumerate(fractions):
                rate = f * sat1 / PER_REQUEST
                lat = np.asarray(open_loop(url, stream, rate, window, seed=j)) * 1e3
                failed = int(np.isnan(lat).sum())
                assert failed < len(lat), f"every request failed at {rate:.2f} req/s"
                if failed:
                    print(f"dp {dp}, {rate:.2f} req/s: {failed} of {len(lat)} requests failed")
                ok = lat[~np.isnan(lat)]
                points.append((rate * PER_REQUEST, *np.percentile(ok, [50, 95, 99])))
            curves[dp] = points
        out["latency"] = (
            conditions(preset, mix, "1 and 2", quick),
            curves,
        )
    finally:
        serve.shutdown()
        ray.shutdown()
    return out


def knee(points) -> int | None:
    base = points[0][2]
    return next((i for i, p in enumerate(points) if p[2] > 2 * base), None)


def latency_rows(curves) -> list[list]:
    rows = []
    for dp, points in curves.items():
        k = knee(points)
        for i, (rate, p50, p95, p99) in enumerate(points):
            mark = " (knee)" if i == k else ""
            rows.append([dp, f"{rate:.2f}{mark}", f"{p50:.0f}", f"{p95:.0f}", f"{p99:.0f}"])
    return rows


def latency_plot(curves, note: str) -> str:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4), sharey=True)
    for ax, (dp, points) in zip(np.atleast_1d(axes), curves.items(), strict=True):
        rates = [p[0] for p in points]
        for col, label in ((1, "p50"), (2, "p95"), (3, "p99")):
            ax.plot(rates, [p[col] for p in points], marker="o", label=label)
        k = knee(points)
        if k is not None:
            ax.axvline(rates[k], color="gray", linestyle="--", label="knee")
        ax.set_title(f"dp {dp}")
        ax.set_xlabel("offered load (images/s)")
        ax.set_yscale("log")
        ax.legend()
    np.atleast_1d(axes)[0].set_ylabel("latency (ms)")
    fig.suptitle(note, fontsize=7, wrap=True)
    path = save_plot(fig, "latency_vs_load.png")
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    out = run(args.quick)
    for key in ("overhead", "scaling"):
        note, rows = out[key]
        print(note)
        print(table(["setup", "images/s", "ratio"], rows))
    note, rows = out["cache"]
    print(note)
    print(table(["measure", "value"], rows))
    note, curves = out["latency"]
    print(note)
    print(table(["dp", "offered images/s", "p50 ms", "p95 ms", "p99 ms"], latency_rows(curves)))
    print(latency_plot(curves, note))
    return 0


if __name__ == "__main__":
    sys.exit(main())
