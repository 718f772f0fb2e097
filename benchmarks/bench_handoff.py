"""Engine hand-off throughput: feature bytes delivered per second to a ZMQ PULL on loopback.

    python -m benchmarks.bench_handoff [--quick]

One run, four paths carrying the same feature bytes, side by side:

1. hand-off: sglang ``POST /encode`` parts (zmq_to_tokenizer) whose frames the
   ingress replica pushes to one PULL socket in this process;
2. HTTP body: ``POST /v1/encode`` of the same images, answered as safetensors
   through Serve's HTTP proxy;
3. plain ZMQ: PUSH/PULL on loopback of messages of the parts' size, no server;
4. Serve floor: the same ``/encode`` bodies to a trivial Serve deployment that reads
   the part, asks two inner deployments (one process each, as dp 2 has two ranks)
   for half the part's bytes each, both at once, joins them into one frame, as our
   ingress gathers a part, and pushes it to the same PULL socket: the floor of a
   dp 2 hand-off in Serve, with nothing else of ours (no admission, hashing,
   assignment, checks).

Production width: a checkpoint with the tiny tower, Kimi-K3's ``text_hidden_size``
7168 and K3's preprocessing, written here with the library and served in
bfloat16 (K3's dtype), so compute is cheap and the bytes are real: 14 KiB per
token, 1024 tokens (14.7 MB) per 896x896 image, sent as a JPEG of about 0.3 MB.
The feature cache is on and warmed by a first pass, so both served paths move
features rather than compute them. Closed loop, ``CLIENTS`` senders; MB/s counts
feature bytes (frame 1; the safetensors ``features.*`` tensors) as they arrive.
Both served paths post the same prepared JSON bodies with the same client
(``serving.Http``: ``http.client``, one kept-alive connection per thread), which
reads a 29 MB answer for about 10 ms of CPU where ``requests``' ``.content``
takes about 140 ms: on this machine's two cores a slow client would slow the
HTTP path by its own CPU, not the server's.

Each window also records the CPU time of every process (``benchmarks/cpu.py``):
CPU-ms per part by role, and the rate those milliseconds allow on this machine's
cores (the CPU-bound limit), so a path's distance from plain ZMQ is explained by
measurement.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures as cf
import dataclasses
import io
import json
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import zmq
from PIL import Image

from kimi_encoder.config import PreprocessConfig, get_preset
from kimi_encoder.weights import write_checkpoint

from . import bench_bytes, bench_serve, cpu
from .common import Section, alternate, image, ratio, spread, standalone, table
from .serving import Http, free_port, server_failed

WIDTH = 7168  # Kimi-K3's text_hidden_size
SIDE = 896  # 64 x 64 patches, 1024 tokens
IMAGES_PER_PART = 2
PARTS = 4  # distinct parts, sent round robin (all cached after the warm-up)
CLIENTS = 4
HEADER = ["path", "MB/s", "parts/s", "vs plain ZMQ (MB/s)"]
APP = "handoff"
FLOOR = "floor"


@dataclasses.dataclass
class Run:
    """One window of a path: feature MB/s, parts (messages) per second, how many, and
    where the CPU went meanwhile."""

    mb_per_s: float
    per_s: float
    count: int
    usage: cpu.Usage
    app: str = APP  # whose replicas are the ingress and ranks of this path

    def cpu_ms(self, label: str | None = None) -> float:
        """CPU-ms per part of one process label (``bench_serve.labeller``), or of all ours."""
        labels = self.usage.grouped(bench_serve.labeller(self.app))
        seconds = self.usage.ours_s if label is None else labels.get(label, 0.0)
        return seconds * 1e3 / max(self.count, 1)


def with_cpu(run, app: str = APP) -> Run:
    """``run()`` -> (MB/s, per second, count), with the CPU of every process around it."""
    before = cpu.snapshot()
    mb, rate, count = run()
    return Run(mb, rate, count, cpu.usage(before, cpu.snapshot()), app)


def write_wide_checkpoint(root: Path) -> Path:
    """The tiny tower with a K3-width projector output and K3's preprocessing, seeded."""
    vision = dataclasses.replace(get_preset("tiny").vision, text_hidden_size=WIDTH)
    return write_checkpoint(root, vision, PreprocessConfig(), seed=0)


def jpeg(side: int, seed: int) -> bytes:
    """A seeded photo-like image as a JPEG (quality 90), as clients send photos."""
    out = io.BytesIO()
    Image.open(io.BytesIO(image(side, side, seed))).save(out, "JPEG", quality=90)
    return out.getvalue()


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


def part_images() -> list[list[bytes]]:
    """``PARTS`` parts of ``IMAGES_PER_PART`` seeded JPEGs each, the same in every run."""
    return [[jpeg(SIDE, seed=100 * p + i) for i in range(IMAGES_PER_PART)] for p in range(PARTS)]


def closed_loop(send, jobs: list, clients: int, seconds: float) -> int:
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


def part_body(index: int, images: list[bytes], port: int) -> dict:
    return {
        "req_id": f"bench{index}_local_part_0",
        "modality": "IMAGE",
        "mm_items": ["data:image/jpeg;base64," + base64.b64encode(b).decode() for b in images],
        "num_parts": 1,
        "part_idx": 0,
        "prefill_host": "127.0.0.1",
        "embedding_port": port,
    }


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
    client: Http, path: str, sink: Sink, parts: list[list[bytes]], seconds: float
) -> tuple[float, float, int]:
    """(MB/s, parts/s, parts) pushed to ``sink`` by the server at ``path`` (``/encode``)."""
    bodies = [
        json.dumps(part_body(i, images, sink.port)).encode() for i, images in enumerate(parts)
    ]

    def send(body: bytes) -> None:
        client.post(path, body, "application/json")

    messages, nbytes, start = sink.messages, sink.bytes, time.perf_counter()
    sent = closed_loop(send, bodies, CLIENTS, seconds)
    sink.wait_for(messages + sent)
    elapsed = sink.last - start
    return (sink.bytes - nbytes) / elapsed / 1e6, sent / elapsed, sent


def http_body(
    client: Http, prefix: str, parts: list[list[bytes]], seconds: float
) -> tuple[float, float, int]:
    """(MB/s, parts/s, parts) of feature bytes in /v1/encode safetensors answers."""
    bodies = [
        json.dumps(
            {
                "items": [{"type": "image", "image": base64.b64encode(b).decode()} for b in images],
                "response_format": "safetensors",
            }
        ).encode()
        for images in parts
    ]
    received = [0]
    lock = threading.Lock()

    def send(body: bytes) -> None:
        answer, _ = client.post(f"{prefix}/v1/encode", body, "application/json")
        with lock:
            received[0] += feature_bytes(answer)

    start = time.perf_counter()
    sent = closed_loop(send, bodies, CLIENTS, seconds)
    elapsed = time.perf_counter() - start
    return received[0] / elapsed / 1e6, sent / elapsed, sent


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
    half = bench_bytes.byte_arrays()
    first = half.options(name="EncoderRank_0").bind()
    second = half.options(name="EncoderRank_1").bind()
    return Floor.bind(first, second)


def warm_up(client: Http, prefix: str, sink: Sink, parts: list[list[bytes]]) -> None:
    """Every part once on both paths: the ranks' caches hold all images afterwards."""
    messages = sink.messages
    for i, images in enumerate(parts):
        body = part_body(i, images, sink.port)
        client.post(f"{prefix}/encode", json.dumps(body).encode(), "application/json")
        items = [{"type": "image", "image": item.split(",", 1)[1]} for item in body["mm_items"]]
        encode = json.dumps({"items": items}).encode()
        client.post(f"{prefix}/v1/encode", encode, "application/json")
    sink.wait_for(messages + len(parts))


def deploy(serve, checkpoint: Path) -> str:
    from deployments.app import bind_app
    from deployments.args import AppArgs

    args = AppArgs(
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
    )
    serve.run(bind_app(args), name=APP, route_prefix=f"/{APP}")
    return f"/{APP}"


def sections(quick: bool) -> list[Section]:
    import ray
    from ray import serve

    window = 3.0 if quick else 6.0
    repeats = 3 if quick else 5  # see bench_bytes.Settings.repeats
    parts = part_images()
    context = zmq.Context()
    sink = Sink(context)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_wide_checkpoint(Path(tmp) / "wide")
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        try:
            client = Http(port)
            prefix = deploy(serve, checkpoint)
            warm_up(client, prefix, sink, parts)
            part_size = sink.bytes // max(sink.messages, 1)
            serve.run(floor_app(), name=FLOOR, route_prefix=f"/{FLOOR}")
            floor = f"/{FLOOR}/encode?n={part_size}"
            paths = {
                "hand-off: /encode, pushed over ZMQ": lambda: with_cpu(
                    lambda: handoff(client, f"{prefix}/encode", sink, parts, window)
                ),
                "HTTP body: /v1/encode safetensors": lambda: with_cpu(
                    lambda: http_body(client, prefix, parts, window)
                ),
                "plain ZMQ PUSH/PULL, same sizes": lambda: with_cpu(
                    lambda: plain_zmq(context, sink, part_size, window)
                ),
                "Serve floor: trivial /encode, two hops joined, pushed": lambda: with_cpu(
                    lambda: handoff(client, floor, sink, parts, window), FLOOR
                ),
            }
            measured = alternate(paths, repeats, rerun_if=server_failed)
        finally:
            serve.shutdown()
            ray.shutdown()
            sink.close()
            context.term()
    mb = {path: [run.mb_per_s for run in runs] for path, runs in measured.items()}
    ours, http, plain, bare = mb.values()
    rows = [
        [
            path,
            spread(mb[path]).fmt(0),
            spread([run.per_s for run in runs]).fmt(1),
            ratio(mb[path], plain).fmt(2, "x"),
        ]
        for path, runs in measured.items()
    ]
    note = (
        f"Tiny tower with Kimi-K3's text_hidden_size {WIDTH} and K3 preprocessing, bfloat16, "
        f"dp 2 on this machine's CPU; {IMAGES_PER_PART} JPEG images of {SIDE}x{SIDE} px per "
        f"part ({part_size / 1e6:.1f} MB of features), {PARTS} parts round robin (cached "
        f"after a warm-up), {CLIENTS} clients, closed loop, the same `http.client` sender "
        f"and prepared JSON bodies on both served paths; {window:g} s per path, "
        f"{repeats} repeats alternating the paths: median (min–max)."
    )
    verdict = table(
        ["figure", "median (min–max)", "target"],
        [
            ["hand-off / plain ZMQ (MB/s)", f"**{ratio(ours, plain).fmt(2, 'x')}**", ">= 0.5x"],
            ["hand-off / HTTP body (MB/s)", f"**{ratio(ours, http).fmt(2, 'x')}**", ">= 2x"],
        ],
    )
    floors = table(
        ["figure", "median (min–max)"],
        [
            ["Serve floor / plain ZMQ", ratio(bare, plain).fmt(2, "x")],
            ["hand-off / Serve floor", ratio(ours, bare).fmt(2, "x")],
        ],
    )
    return [
        Section(
            "Engine hand-off",
            "python -m benchmarks.bench_handoff",
            [note, table(HEADER, rows), verdict, FLOORS, floors, *cpu_tables(measured)],
        )
    ]


FLOORS = (
    "What Serve allows (the floor runs on the same cluster in the same repeats, its "
    "requests the same `/encode` bodies, its replicas with the cluster's malloc settings): "
    "a target above the floor's own ratio cannot be met by a Serve application that takes "
    "the part over HTTP and asks two ranks for it."
)


def cpu_tables(measured: dict[str, list[Run]]) -> list[str]:
    """CPU-ms per part by role for each path, and the parts/s that CPU allows here."""
    cores = psutil.cpu_count() or 1
    names = list(measured)

    def row(label: str, figure, digits: int = 1) -> list[str]:
        return [label, *(spread([figure(r) for r in measured[n]]).fmt(digits) for n in names)]

    labels = [bench_serve.INGRESS, "rank 0", "rank 1", *bench_serve.AROUND[1:]]
    rows = [row(label, lambda r, x=label: r.cpu_ms(x)) for label in labels]
    rows += [
        row("**all of ours**", lambda r: r.cpu_ms()),
        row("machine busy (cores)", lambda r: r.usage.cores(r.usage.machine_busy_s), 2),
        row(f"CPU-bound limit on {cores} cores (parts/s)", lambda r: cores * 1e3 / r.cpu_ms()),
        row("measured (parts/s)", lambda r: r.per_s),
    ]
    note = (
        "CPU-ms per part (plain ZMQ: per message) by process (the ingress row includes the "
        "hand-off registry replica; for the floor it is the outer deployment, and its two inner "
        "ones are on the rank rows), over the same windows; the "
        f"limit is {cores} cores' milliseconds divided by all of ours per part. A path at its "
        "limit with every core busy gets faster only by spending fewer CPU-ms per part; the "
        "table shows whose they are."
    )
    return [note, table(["CPU-ms per part", *names], rows)]


def main(argv: list[str] | None = None) -> int:
    return standalone(__doc__, lambda a: sections(a.quick), argv)


if __name__ == "__main__":
    sys.exit(main())
