"""Served benchmarks' harness: one-machine Ray Serve clusters, the apps on them, lean
HTTP clients and closed-loop windows with CPU accounting.

A cluster runs in this process (``Cluster``) or, behind the ingress a benchmark
picks (Serve's proxy or HAProxy, read once when Serve starts), in a process of
its own (``Server``). Every app's ``AppArgs`` is built by ``app_args``, the one
place that knows their shape; ``bench_args`` adds the benchmarks' defaults.

Throughput of a closed loop (``clients`` senders, each sending its next request
as soon as the last one is answered) is measured over a window that starts once
every client has had one answer (the pipeline is full) and ends while all of
them are still busy; each request counts for the share of its lifetime inside
the window, so a window holding few long requests is not off by a whole
request at either edge. The clients use ``http.client`` with a kept-alive
connection each and bodies built before the window: the client's own CPU per
request is a socket write and a read.
"""

from __future__ import annotations

import base64
import http.client
import json
import multiprocessing as mp
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from . import cpu
from .inputs import image

# Fast teardown of apps: nothing is in flight when the benchmark deletes one.
FAST_SHUTDOWN = {"graceful_shutdown_wait_loop_s": 0.1, "graceful_shutdown_timeout_s": 1}
# Unbounded queues: an overload point queues (it is measured), it is not refused.
OPEN_QUEUES = {"max_ongoing_requests": 256, "max_queued_requests": -1, **FAST_SHUTDOWN}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def app_args(**fields):
    """``AppArgs`` of ``fields`` (``nested_args``): every benchmark builds its apps'
    arguments here."""
    from deployments.args import AppArgs

    return AppArgs(**nested_args(fields))


def nested_args(fields: dict) -> dict:
    """A config's ``args:`` of ``fields``. The benchmarks name each field by its flat key
    (``dp_size``, ``feature_cache_bytes``, ...); where ``AppArgs`` groups them by
    component, each goes to the section ``deployments.args.MOVED`` names
    (``feature_cache_bytes`` -> ``ranks.cache_bytes``)."""
    from deployments.args import MOVED

    nested: dict = {}
    for key, value in fields.items():
        *sections, leaf = MOVED.get(key, key).split(".")
        node = nested
        for section in sections:
            node = node.setdefault(section, {})
        node[leaf] = value
    return nested


def bench_args(checkpoint: str, dp: int, **fields):
    """``AppArgs`` of a benchmark app: CPU ranks with one torch thread each (one logical
    CPU reserved), unbounded queues, no request timeout in practice, ``fields`` on top."""
    return app_args(
        **{
            "checkpoint": checkpoint,
            "dp_size": dp,
            "device": "cpu",
            "preprocess_backend": "cpu",
            "rank_actor_options": {"num_cpus": 1},
            "rank_options": OPEN_QUEUES,
            "ingress_options": OPEN_QUEUES,
            "request_timeout_s": 600,
            **fields,
        }
    )


def bind(args):
    """The application ``build_app`` makes of ``args``, ready for ``serve.run``."""
    from deployments.app import bind_app

    return bind_app(args)


def tmpfs() -> str | None:
    """/dev/shm where it is a writable folder with room for the encoder-cache files (they
    land in memory, as on a consumer's tmpfs); else the default temporary folder."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 4 << 30:
        return str(shm)
    return None


K3_WIDTH = 7168  # Kimi-K3's text_hidden_size: the features' width per token


def wide_checkpoint(folder: Path, k3_preprocess: bool = False, width: int = K3_WIDTH) -> Path:
    """The tiny tower with a ``width``-wide projector output and seeded weights, written
    with the library: cheap compute, production-sized features. Its preprocessing is the
    tiny preset's, or K3's with ``k3_preprocess``."""
    import dataclasses

    from kimi_encoder.config import PreprocessConfig, get_preset
    from kimi_encoder.weights import write_checkpoint

    tiny = get_preset("tiny")
    vision = dataclasses.replace(tiny.vision, text_hidden_size=width)
    preprocess = PreprocessConfig() if k3_preprocess else tiny.preprocess
    return write_checkpoint(folder, vision, preprocess, seed=0)


class Cluster:
    """A one-machine Ray cluster with Serve on a free loopback port (context manager).

    ``logical_cpus`` is what Ray may hand out, not the machine's cores: each rank
    reserves one, and several apps are deployed side by side. ``client`` posts to its
    Serve proxy.
    """

    def __init__(self, logical_cpus: int = 16):
        self.logical_cpus = logical_cpus
        self.port = 0
        self.client: Http | None = None

    def __enter__(self) -> Cluster:
        import ray
        from ray import serve

        ray.init(
            address="local",
            num_cpus=self.logical_cpus,
            include_dashboard=False,
            log_to_driver=False,
        )
        self.port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        self.client = Http(self.port)
        return self

    def deploy(self, name: str, app) -> str:
        """Run ``app`` as application ``name``; its route prefix."""
        from ray import serve

        serve.run(app, name=name, route_prefix=f"/{name}")
        return f"/{name}"

    def encode(self, name: str, args, stream: list[list[bytes]]) -> Encode:
        """The app of ``args`` (``bench_args``) run as ``name``: its ``/v1/encode`` with
        the bodies of ``stream``, sent by ``client``."""
        assert self.client is not None, "a Cluster deploys inside its with block"
        return Encode(self.client, self.deploy(name, bind(args)), stream)

    def delete(self, name: str) -> None:
        from ray import serve

        serve.delete(name)

    def __exit__(self, *exc) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()


HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
# Behind HAProxy a stopping ingress replica stays reachable this long (Serve's default
# 30 s, for load balancers in front); nothing stands in front of a benchmark's cluster.
QUICK_DRAIN = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}
INGRESSES = {"Serve proxy": "0", "HAProxy": "1"}  # the variable's value for each cluster
START_TIMEOUT_S = 600


def _serve(haproxy: str, logical_cpus: int, deploy: Callable, args: tuple, conn) -> None:
    """A cluster of its own running ``deploy(cluster, *args)``; sends its port and what
    ``deploy`` returned, then waits for any message and shuts down."""
    os.environ[HAPROXY_ENV] = haproxy  # before Ray and Serve are imported and started
    os.environ.update(QUICK_DRAIN)
    with Cluster(logical_cpus=logical_cpus) as cluster:
        conn.send((cluster.port, deploy(cluster, *args)))
        conn.recv()


class Server:
    """``_serve`` in a spawned process (a context manager): a cluster behind the ingress
    ``haproxy`` names (``INGRESSES``' values) running ``deploy(cluster, *args)``, a
    module-level function; once it serves, ``client`` posts to its port and ``deployed``
    is what ``deploy`` returned."""

    def __init__(self, haproxy: str, deploy: Callable, args: tuple, logical_cpus: int = 4):
        context = mp.get_context("spawn")
        self._conn, child = context.Pipe()
        self.proc = context.Process(
            target=_serve, args=(haproxy, logical_cpus, deploy, args, child)
        )

    def __enter__(self) -> Server:
        self.proc.start()
        if not self._conn.poll(START_TIMEOUT_S):
            self.proc.kill()
            raise RuntimeError(f"the app did not start within {START_TIMEOUT_S} s")
        port, self.deployed = self._conn.recv()
        self.client = Http(port)
        return self

    def __exit__(self, *exc) -> None:
        self._conn.send("stop")
        self.proc.join(120)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


class HttpError(RuntimeError):
    def __init__(self, status: int, path: str, body: bytes):
        self.status = status
        self.body = body
        super().__init__(f"POST {path} answered {status}: {body[:300]!r}")


def server_failed(exc: BaseException) -> bool:
    """Whether ``exc`` is a 5xx answer: the server failed (a replica died under the
    request, Serve's proxy answering 500 for it), not the benchmark's request."""
    return isinstance(exc, HttpError) and exc.status >= 500


class Http:
    """POSTs to one loopback server, one kept-alive connection per thread."""

    def __init__(self, port: int, host: str = "127.0.0.1", timeout_s: float = 600):
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self._local = threading.local()

    def post(self, path: str, body: bytes, content_type: str) -> tuple[bytes, dict[str, str]]:
        """The response body and headers of a 200; ``HttpError`` for any other status. A
        kept-alive connection the server has closed meanwhile is opened again, once."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            try:
                return self._post(conn, path, body, content_type)
            except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
                pass  # idle too long: the server closed it
        conn = self._local.conn = http.client.HTTPConnection(
            self.host, self.port, timeout=self.timeout_s
        )
        return self._post(conn, path, body, content_type)

    def _post(self, conn, path: str, body: bytes, content_type: str):
        try:
            conn.request("POST", path, body=body, headers={"Content-Type": content_type})
            response = conn.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException):
            conn.close()
            self._local.conn = None
            raise
        if response.status != 200:
            raise HttpError(response.status, path, data)
        return data, dict(response.getheaders())


@dataclass(frozen=True)
class Done:
    """One answered request: when it was sent and answered, its images and body bytes."""

    start: float
    end: float
    images: int
    nbytes: int


def in_window(done: Sequence[Done], t0: float, t1: float) -> tuple[float, float, float]:
    """(requests, images, bytes) answered in ``[t0, t1]``, each request counted for the
    share of its lifetime inside the window."""
    requests = images = nbytes = 0.0
    for d in done:
        overlap = min(d.end, t1) - max(d.start, t0)
        if overlap <= 0:
            continue
        share = overlap / (d.end - d.start) if d.end > d.start else 1.0
        requests += share
        images += share * d.images
        nbytes += share * d.nbytes
    return requests, images, nbytes


@dataclass
class Window:
    """A closed-loop window's rates and where the CPU went during it."""

    requests_per_s: float
    images_per_s: float
    bytes_per_s: float
    usage: cpu.Usage

    @property
    def images(self) -> float:
        return self.images_per_s * self.usage.wall_s

    def cpu_ms_per_image(self, seconds: float) -> float:
        return seconds * 1e3 / self.images


# Sends the k-th request of a stream; returns (images, response body bytes).
Send = Callable[[int], tuple[int, int]]


def closed_loop(
    send: Send, clients: int, seconds: float, labels: Mapping[int, str] | None = None
) -> Window:
    """``clients`` threads send back to back (client k sends requests k, k + clients, ...);
    the window opens once each has had an answer and lasts ``seconds``; then the
    clients finish what they have in flight (not counted) and stop."""
    done: list[Done] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    answered = threading.Semaphore(0)

    def client(k: int) -> None:
        i, first = k, True
        try:
            while not stop.is_set():
                start = time.perf_counter()
                images, nbytes = send(i)
                done.append(Done(start, time.perf_counter(), images, nbytes))
                if first:
                    answered.release()
                    first = False
                i += clients
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller's thread
            errors.append(exc)
            stop.set()
            answered.release()

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    for _ in range(clients):
        answered.acquire()
    before = cpu.snapshot(labels)
    stop.wait(seconds)
    after = cpu.snapshot(labels)
    stop.set()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    requests, images, nbytes = in_window(done, before.at, after.at)
    wall = after.at - before.at
    return Window(requests / wall, images / wall, nbytes / wall, cpu.usage(before, after))


# --- /v1/encode requests --------------------------------------------------------------

# The served benchmarks' images: sizes cycling through MIX, each image seeded by its place.
MIX = [(320, 240), (448, 336), (224, 224), (640, 480), (256, 192), (512, 384)]
PER_REQUEST = 2
CLIENTS = 4


def request_stream(count: int, per_request: int = PER_REQUEST) -> list[list[bytes]]:
    """``count`` requests of ``per_request`` distinct images cycling through MIX (the same
    images, in the same order, whatever ``per_request``)."""
    return [
        [
            image(*MIX[(r * per_request + i) % len(MIX)], seed=r * per_request + i)
            for i in range(per_request)
        ]
        for r in range(count)
    ]


def json_body(images: list[bytes], **fields) -> bytes:
    """A ``/v1/encode`` JSON request of ``images`` (base64), ``fields`` on top."""
    items = [{"type": "image", "image": base64.b64encode(b).decode()} for b in images]
    return json.dumps({"items": items, **fields}).encode()


class Encode:
    """``/v1/encode`` of one app: JSON bodies built once, sent by a lean client."""

    def __init__(self, client: Http, prefix: str, stream: list[list[bytes]]):
        self.client, self.prefix = client, prefix
        self.path = f"{prefix}/v1/encode"
        self.bodies = [(json_body(images), len(images)) for images in stream]

    def send(self, k: int) -> tuple[int, int]:
        body, images = self.bodies[k % len(self.bodies)]
        data, _ = self.client.post(self.path, body, "application/json")
        return images, len(data)

    def info(self) -> dict:
        return get_json(self.client, f"{self.prefix}/v1/info")


def get_json(client: Http, path: str, timeout_s: float = 60) -> dict:
    """``GET path`` of ``client``'s server, as JSON (a connection of its own)."""
    conn = http.client.HTTPConnection(client.host, client.port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()
