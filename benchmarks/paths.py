"""The feature paths the benchmarks drive, and the reference servers they are held against.

Paths (a closed loop of ``clients`` threads each, bodies built before the clock):

- ``/v1/encode`` answered as safetensors (``http_body``);
- sglang hand-off parts, ``POST /encode``, whose frames the server pushes to a ZMQ
  PULL socket here (``Sink``, ``handoff``);
- vLLM encoder-cache files, ``/v1/encode`` with output kind ``vllm_ec``, written
  under the server's ``ec_root`` (``vllm_files``); any ``/v1/encode`` output, closed
  loop or at a set rate (``delivered``).

References, each doing only what the path must do:

- ``PlainServer``: a stdlib HTTP server answering ``n`` bytes;
- ``ceiling_apps``: a trivial Serve deployment answering the body, and one that
  gets it from an inner deployment first (one hop, or two halves at once);
- ``floor_app``: the Serve floor of a dp 2 hand-off (two halves joined, pushed);
- ``plain_zmq``: PUSH/PULL on loopback, no server.

``deploy_handoff`` runs the app the hand-off benchmarks share: the tiny tower at
Kimi-K3's width, bfloat16, dp 2, every image cached after a warm-up; ``handoff_app``
runs it on a cluster of its own beside a ``Sink``.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures as cf
import contextlib
import http.server
import json
import multiprocessing as mp
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import zmq

from .inputs import jpeg
from .serving import Cluster, Http, app_args, bind, free_port, wide_checkpoint

# The hand-off app's requests: 2 JPEGs of 896 x 896 px (1024 tokens each) per part or
# request, 4 distinct parts sent round robin, 4 clients.
SIDE = 896
IMAGES_PER_PART = 2
PARTS = 4
CLIENTS = 4
HANDOFF_APP = "handoff"


def part_images(side: int = SIDE, parts: int = PARTS) -> list[list[bytes]]:
    """``parts`` parts of ``IMAGES_PER_PART`` seeded JPEGs each, the same in every run."""
    return [[jpeg(side, seed=100 * p + i) for i in range(IMAGES_PER_PART)] for p in range(parts)]


def deploy_handoff(
    checkpoint: Path, ec_root: str | None = None, name: str = HANDOFF_APP, **fields
) -> str:
    """The hand-off app on the running Serve instance, with ``fields`` (more ``app_args``);
    its route prefix."""
    from ray import serve

    args = app_args(
        checkpoint=str(checkpoint),
        dp_size=2,
        device="cpu",
        dtype="bfloat16",
        preprocess_backend="cpu",
        cost_model="patches",
        calibration_grids=[],
        request_timeout_s=600,
        handoff_wait_s=60,
        feature_cache_bytes=1 << 30,  # every image of every part stays cached
        **({"ec_root": ec_root} if ec_root else {}),
        **fields,
    )
    serve.run(bind(args), name=name, route_prefix=f"/{name}")
    return f"/{name}"


def deploy_handoff_in(cluster, checkpoint: str) -> str:
    """``deploy_handoff`` as ``serving.Server`` calls a deploy function."""
    return deploy_handoff(Path(checkpoint))


# --- the sink and the clients ---------------------------------------------------------


class Sink:
    """A PULL socket on loopback that counts the last frame's bytes of each message."""

    def __init__(self, context: zmq.Context):
        self.sock = context.socket(zmq.PULL)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.messages = 0
        self.bytes = 0
        self.last = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(50):
                frames = self.sock.recv_multipart(copy=False)
                self.bytes += len(frames[-1])
                self.messages += 1
                self.last = time.perf_counter()

    def wait_for(self, messages: int, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while self.messages < messages:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.messages} of {messages} messages arrived")
            time.sleep(0.01)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close(linger=0)


@contextlib.contextmanager
def handoff_app(ec_root: str, **fields) -> Iterator[tuple[Http, str, Sink, zmq.Context]]:
    """A one-machine cluster running ``deploy_handoff``'s app on a checkpoint written here
    (files under ``ec_root``, with ``fields``): (client, the app's prefix, a ZMQ sink here,
    its context)."""
    context = zmq.Context()
    sink = Sink(context)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = wide_checkpoint(Path(tmp) / "wide", k3_preprocess=True)
            with Cluster(logical_cpus=4) as cluster:
                prefix = deploy_handoff(checkpoint, ec_root, **fields)
                yield cluster.client, prefix, sink, context
    finally:
        sink.close()
        context.term()


def run_for(send: Callable, jobs: list, clients: int, seconds: float) -> int:
    """Calls ``send(job)`` back to back from ``clients`` threads for ``seconds``; how many."""
    stop = time.perf_counter() + seconds
    done = [0]
    lock = threading.Lock()

    def client(k: int) -> None:
        i = k
        while time.perf_counter() < stop:
            send(jobs[i % len(jobs)])
            with lock:
                done[0] += 1
            i += clients

    with cf.ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    return done[0]


def paced(send: Callable, jobs: list, clients: int, rate: float, seconds: float) -> int:
    """Calls ``send(job)`` at ``rate`` a second from ``clients`` threads for ``seconds``;
    how many."""
    start, total = time.perf_counter(), int(rate * seconds)

    def client(k: int) -> int:
        sent = 0
        for i in range(k, total, clients):
            time.sleep(max(0.0, start + i / rate - time.perf_counter()))
            send(jobs[i % len(jobs)])
            sent += 1
        return sent

    with cf.ThreadPoolExecutor(clients) as pool:
        return sum(pool.map(client, range(clients)))


def part_body(index: int, images: list[bytes], port: int) -> dict:
    """An sglang 0.5.23 ``/encode`` part of ``images`` to push to ``port`` on loopback."""
    return {
        "req_id": f"bench{index}_local_part_0",
        "modality": "IMAGE",
        "mm_items": ["data:image/jpeg;base64," + base64.b64encode(b).decode() for b in images],
        "num_parts": 1,
        "part_idx": 0,
        "prefill_host": "127.0.0.1",
        "embedding_port": port,
    }


def items(images: list[bytes]) -> list[dict]:
    return [{"type": "image", "image": base64.b64encode(b).decode()} for b in images]


def feature_bytes(body: bytes) -> int:
    """Bytes of the ``features.*`` tensors of a safetensors body."""
    (length,) = struct.unpack("<Q", body[:8])
    header = json.loads(body[8 : 8 + length])
    return sum(
        end - start
        for name, entry in header.items()
        if name.startswith("features.")
        for start, end in [entry["data_offsets"]]
    )


def handoff(
    client: Http,
    path: str,
    sink: Sink,
    parts: list[list[bytes]],
    seconds: float,
    clients: int = CLIENTS,
) -> tuple[float, float, int]:
    """(MB/s, parts/s, parts) pushed to ``sink`` by the server at ``path`` (``/encode``)."""
    bodies = [
        json.dumps(part_body(i, images, sink.port)).encode() for i, images in enumerate(parts)
    ]

    def send(body: bytes) -> None:
        client.post(path, body, "application/json")

    messages, nbytes, start = sink.messages, sink.bytes, time.perf_counter()
    sent = run_for(send, bodies, clients, seconds)
    sink.wait_for(messages + sent)
    elapsed = sink.last - start
    return (sink.bytes - nbytes) / elapsed / 1e6, sent / elapsed, sent


def http_body(
    client: Http, prefix: str, parts: list[list[bytes]], seconds: float
) -> tuple[float, float, int]:
    """(MB/s, parts/s, parts) of feature bytes in /v1/encode safetensors answers."""
    bodies = [
        json.dumps({"items": items(images), "response_format": "safetensors"}).encode()
        for images in parts
    ]
    received = [0]
    lock = threading.Lock()

    def send(body: bytes) -> None:
        answer, _ = client.post(f"{prefix}/v1/encode", body, "application/json")
        with lock:
            received[0] += feature_bytes(answer)

    start = time.perf_counter()
    sent = run_for(send, bodies, CLIENTS, seconds)
    elapsed = time.perf_counter() - start
    return received[0] / elapsed / 1e6, sent / elapsed, sent


def vllm_files(
    client: Http, prefix: str, parts: list[list[bytes]], seconds: float, clients: int = CLIENTS
) -> tuple[float, float, int]:
    """(MB/s, requests/s, requests) of vLLM encoder-cache files the server writes under its
    ``ec_root`` for ``/v1/encode`` requests with output kind ``vllm_ec``; each part's images
    keep their uuids, so every request replaces the same files (a bounded tmpfs)."""
    bodies = []
    for p, images in enumerate(parts):
        uuids = [f"bench-{p}-{i}" for i in range(len(images))]
        output = {"kind": "vllm_ec", "uuids": uuids}
        bodies.append(json.dumps({"items": items(images), "output": output}).encode())
    return delivered(client, prefix, bodies, seconds, clients)


def delivered(
    client: Http,
    prefix: str,
    bodies: list[bytes],
    seconds: float,
    clients: int = CLIENTS,
    rate: float | None = None,
) -> tuple[float, float, int]:
    """(MB/s, requests/s, requests) of the feature bytes that ``/v1/encode`` requests with
    an ``output`` had written or acknowledged (each answer's items' ``bytes``): closed loop
    of ``clients`` senders, or with ``rate`` that many requests a second, spread over them
    (each waits for its slot: a path that keeps up runs at exactly ``rate``)."""
    done = [0]
    lock = threading.Lock()

    def send(body: bytes) -> None:
        answer, _ = client.post(f"{prefix}/v1/encode", body, "application/json")
        nbytes = sum(entry["bytes"] for entry in json.loads(answer)["items"])
        with lock:
            done[0] += nbytes

    start = time.perf_counter()
    if rate is None:
        sent = run_for(send, bodies, clients, seconds)
    else:
        sent = paced(send, bodies, clients, rate, seconds)
    elapsed = time.perf_counter() - start
    return done[0] / elapsed / 1e6, sent / elapsed, sent


def warm_up(client: Http, prefix: str, sink: Sink, parts: list[list[bytes]]) -> None:
    """Every part once on both paths: the ranks' caches hold all images afterwards."""
    messages = sink.messages
    for i, images in enumerate(parts):
        body = part_body(i, images, sink.port)
        client.post(f"{prefix}/encode", json.dumps(body).encode(), "application/json")
        encode = json.dumps({"items": items(images)}).encode()
        client.post(f"{prefix}/v1/encode", encode, "application/json")
    sink.wait_for(messages + len(parts))


# --- references -----------------------------------------------------------------------


def plain_zmq(
    context: zmq.Context, sink: Sink, size: int, seconds: float
) -> tuple[float, float, int]:
    """(MB/s, messages/s, messages) of two-frame messages of ``size`` bytes, one PUSH to
    ``sink``."""
    push = context.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{sink.port}")
    payload = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    messages, nbytes = sink.messages, sink.bytes
    sent, start = 0, time.perf_counter()
    stop = start + seconds
    while time.perf_counter() < stop:
        push.send_multipart([b"meta", memoryview(payload)], copy=False)
        sent += 1
    sink.wait_for(messages + sent)
    elapsed = sink.last - start
    push.close(linger=0)
    return (sink.bytes - nbytes) / elapsed / 1e6, sent / elapsed, sent


def _plain_server(port: int, ready) -> None:
    """Stdlib HTTP/1.1 server: reads the request body, answers ``n`` bytes for ``POST /n``."""
    bodies: dict[int, bytes] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            n = int(self.path.strip("/"))
            body = bodies.setdefault(n, np.random.default_rng(n).bytes(n))
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(n))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    ready.set()
    server.serve_forever()


class PlainServer:
    """``_plain_server`` in a process of its own (a context manager)."""

    def __enter__(self) -> PlainServer:
        context = mp.get_context("spawn")
        self.port = free_port()
        ready = context.Event()
        self.proc = context.Process(target=_plain_server, args=(self.port, ready), daemon=True)
        self.proc.start()
        while not ready.wait(0.5):
            if not self.proc.is_alive():
                raise RuntimeError(f"the plain HTTP server exited ({self.proc.exitcode})")
        return self

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.join()


def byte_arrays():
    """A Serve deployment answering ``n`` seeded random bytes as a numpy array (through the
    object store), prepared once per size: the inner side of a hop."""
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
    class Inner:
        def __init__(self):
            self.arrays: dict[int, np.ndarray] = {}

        def __call__(self, n: int) -> np.ndarray:
            if n not in self.arrays:
                self.arrays[n] = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
            return self.arrays[n]

    return Inner


def ceiling_apps():
    """(echo app, hop app): a Serve deployment that answers ``n`` bytes for ``?n=``, and
    one that gets them from an inner deployment as a numpy array first; with
    ``&hops=2`` it asks for each half in a call of its own, both at once, and joins
    the two arrays into the body (the shape of a dp 2 answer: two rank calls, one
    join)."""
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import Response

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
    class Echo:
        def __init__(self):
            self.bodies: dict[int, bytes] = {}

        async def __call__(self, request: Request) -> Response:
            await request.body()
            n = int(request.query_params["n"])
            body = self.bodies.setdefault(n, np.random.default_rng(n).bytes(n))
            return Response(body, media_type="application/octet-stream")

    Inner = byte_arrays()

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
    class Outer:
        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, request: Request) -> Response:
            await request.body()
            n = int(request.query_params["n"])
            if request.query_params.get("hops") == "2":
                halves = await asyncio.gather(
                    self.inner.remote(n // 2), self.inner.remote(n - n // 2)
                )
                body = b"".join(memoryview(half) for half in halves)
            else:
                body = (await self.inner.remote(n)).tobytes()
            return Response(body, media_type="application/octet-stream")

    return Echo.bind(), Outer.bind(Inner.bind())


def floor_app():
    """The Serve floor of a dp 2 hand-off: ``POST /encode?n=N`` reads the part, gets
    ``N`` bytes as two halves from two inner deployments (each a numpy array, through
    the object store), joins them and pushes them to the part's ``embedding_port``; a
    socket per part and the same linger as ours (``ZmqPusher``, one-off port)."""
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import Response

    @serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
    class Floor:
        def __init__(self, first, second):
            import zmq.asyncio

            self.halves = (first, second)
            self.context = zmq.asyncio.Context()

        async def __call__(self, request: Request) -> Response:
            part = json.loads(await request.body())
            n = int(request.query_params["n"])
            first, second = self.halves
            halves = await asyncio.gather(first.remote(n // 2), second.remote(n - n // 2))
            payload = b"".join(memoryview(half) for half in halves)
            sock = self.context.socket(zmq.PUSH)
            sock.connect(f"tcp://{part['prefill_host']}:{part['embedding_port']}")
            await sock.send_multipart([b"meta", payload], copy=False)
            sock.close(linger=30_000)
            return Response(b"{}", media_type="application/json")

    # Named like ranks, so the CPU tables put each inner deployment on a rank's row.
    half = byte_arrays()
    first = half.options(name="EncoderRank_0").bind()
    second = half.options(name="EncoderRank_1").bind()
    return Floor.bind(first, second)
