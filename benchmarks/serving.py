"""Served benchmarks' harness: a one-machine Ray Serve cluster, apps on it, lean HTTP
clients and closed-loop windows with CPU accounting.

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

import http.client
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from . import cpu

# Fast teardown of apps: nothing is in flight when the benchmark deletes one.
FAST_SHUTDOWN = {"graceful_shutdown_wait_loop_s": 0.1, "graceful_shutdown_timeout_s": 1}
# Unbounded queues: an overload point queues (it is measured), it is not refused.
OPEN_QUEUES = {"max_ongoing_requests": 256, "max_queued_requests": -1, **FAST_SHUTDOWN}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def app_args(checkpoint: str, dp: int, **fields):
    """``AppArgs`` of a benchmark app: CPU ranks with one torch thread each (one logical
    CPU reserved), unbounded queues, no request timeout in practice, ``fields`` on top."""
    from deployments.args import AppArgs

    return AppArgs(
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


class Cluster:
    """A one-machine Ray cluster with Serve on a free loopback port (context manager).

    ``logical_cpus`` is what Ray may hand out, not the machine's cores: each rank
    reserves one, and several apps are deployed side by side.
    """

    def __init__(self, logical_cpus: int = 16):
        self.logical_cpus = logical_cpus
        self.port = 0

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
        return self

    def deploy(self, name: str, app) -> str:
        """Run ``app`` as application ``name``; its route prefix."""
        from ray import serve

        serve.run(app, name=name, route_prefix=f"/{name}")
        return f"/{name}"

    def delete(self, name: str) -> None:
        from ray import serve

        serve.delete(name)

    def __exit__(self, *exc) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()


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
