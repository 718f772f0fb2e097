"""vLLM without shared storage: features pushed by the ranks, against files and a plain socket.

    python -m benchmarks.bench_push [--quick]

One run on the hand-off app (the tiny tower at Kimi-K3's width 7168, bfloat16, dp 2,
every image cached after a warm-up), these cells alternated in the same repeats:

- vLLM files: ``/v1/encode`` with output kind ``vllm_ec``, written under an ``ec_root``
  on a tmpfs;
- vLLM push: ``/v1/encode`` with output kind ``vllm_push``, each image pushed by its rank
  to a consumer worker's receiver in this process (``ecreceive.Receiver``, what our vLLM
  connector runs), answered once acknowledged;
- plain ZMQ PUSH/PULL on loopback of messages of one image's features (the size of one
  push), no server.

Each served path with requests of small (448 px) and of large (896 px) JPEGs, all four
cells at the same request rate: the ingress's CPU per request through the two sizes is a
line, CPU-ms per request whatever its size plus CPU-ms per MB of features, fitted per
repeat (as ``bench_handoff --only cpu``). At one rate for all, the CPU the ingress spends
per second whatever it serves weighs the same on every request; closed loop, two paths
of different speeds would share it out differently and tilt the line. MB/s (closed loop,
large requests) counts the feature bytes each path delivered (written, or acknowledged).
The app is ``paths.deploy_handoff``'s with its load reports polled once a second.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import json
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import zmq

from . import cpu
from .common import Section, alternate, line_through, ratio, spread, table
from .page import arguments, standalone
from .paths import (
    CLIENTS,
    HANDOFF_APP,
    IMAGES_PER_PART,
    PARTS,
    Sink,
    items,
    part_images,
    plain_zmq,
    run_for,
    warm_up,
)
from .serving import (
    K3_WIDTH,
    Http,
    app_args,
    bind,
    free_port,
    server_failed,
    tmpfs,
    wide_checkpoint,
)

# The ingress polls the ranks' load reports when older than this: 50 ms by default, so
# under load up to 20 polls a second per rank, whatever the request rate. Two paths at
# different rates would share that time-driven CPU out differently per request; polled
# once a second, the ingress's CPU per request is its work on the requests.
LOAD_REPORT_MS = 1000

SIDES = {"small": 448, "large": 896}
RATE = 20  # requests a second of the CPU line's cells: below what either path sustains
FILES, PUSH = "vLLM files (/v1/encode, vllm_ec)", "vLLM push (/v1/encode, vllm_push)"


@dataclasses.dataclass
class Run:
    """One window: feature MB/s, requests (messages) per second, how many, and the CPU of
    every process meanwhile."""

    mb_per_s: float
    per_s: float
    count: int
    usage: cpu.Usage

    def cpu_ms(self, label: str | None = None) -> float:
        labels = self.usage.grouped(cpu.labeller(HANDOFF_APP))
        seconds = self.usage.ours_s if label is None else labels.get(label, 0.0)
        return seconds * 1e3 / max(self.count, 1)


def with_cpu(run) -> Run:
    before = cpu.snapshot()
    mb, rate, count = run()
    return Run(mb, rate, count, cpu.usage(before, cpu.snapshot()))


def bodies(kind: str, parts, to: str) -> list[bytes]:
    """``/v1/encode`` bodies of ``parts`` with output ``kind``; each part's images keep their
    uuids, so the files (or the staged items) of a part replace the previous ones."""
    out = []
    for p, images in enumerate(parts):
        output = {"kind": kind, "uuids": [f"{kind}-{p}-{i}" for i in range(len(images))]}
        if kind == "vllm_push":
            output["to"] = [to]
        out.append(json.dumps({"items": items(images), "output": output}).encode())
    return out


def delivered(client: Http, prefix: str, jobs: list[bytes], seconds: float, rate=None):
    """(MB/s, requests/s, requests) of feature bytes written or acknowledged: closed loop
    of ``CLIENTS`` senders, or with ``rate`` that many requests a second, spread over them
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
        sent = run_for(send, jobs, CLIENTS, seconds)
    else:
        sent = paced(send, jobs, rate, seconds)
    elapsed = time.perf_counter() - start
    return done[0] / elapsed / 1e6, sent / elapsed, sent


def paced(send, jobs: list, rate: float, seconds: float) -> int:
    """``send(job)`` at ``rate`` a second from ``CLIENTS`` threads for ``seconds``."""
    start, total = time.perf_counter(), int(rate * seconds)

    def client(k: int) -> int:
        sent = 0
        for i in range(k, total, CLIENTS):
            time.sleep(max(0.0, start + i / rate - time.perf_counter()))
            send(jobs[i % len(jobs)])
            sent += 1
        return sent

    with cf.ThreadPoolExecutor(CLIENTS) as pool:
        return sum(pool.map(client, range(CLIENTS)))


@contextlib.contextmanager
def app(ec_root: str) -> Iterator[tuple[Http, str, Sink, zmq.Context, str]]:
    """The hand-off app, a ZMQ sink and a consumer worker's receiver in this process."""
    import ray
    from ray import serve

    from kimi_encoder.engines.ecreceive import Receiver, Staging

    context = zmq.Context()
    sink = Sink(context)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        rx_port = sock.getsockname()[1]
    receiver = Receiver("127.0.0.1", rx_port, Staging(1 << 30, 600))
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = wide_checkpoint(Path(tmp) / "wide", k3_preprocess=True)
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        try:
            prefix = deploy(checkpoint, ec_root)
            yield Http(port), prefix, sink, context, f"127.0.0.1:{rx_port}"
        finally:
            serve.shutdown()
            ray.shutdown()
            receiver.close()
            sink.close()
            context.term()


def deploy(checkpoint: Path, ec_root: str) -> str:
    """``paths.deploy_handoff``'s app, its load reports polled every ``LOAD_REPORT_MS``."""
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
        feature_cache_bytes=1 << 30,  # every image stays cached
        load_report_interval_ms=LOAD_REPORT_MS,
        ec_root=ec_root,
    )
    serve.run(bind(args), name=HANDOFF_APP, route_prefix=f"/{HANDOFF_APP}")
    return f"/{HANDOFF_APP}"


def sections(quick: bool, repeats: int | None = None) -> list[Section]:
    window = 3.0 if quick else 6.0
    repeats = repeats or (3 if quick else 5)
    with (
        tempfile.TemporaryDirectory(dir=tmpfs()) as ec_root,
        app(ec_root) as (client, prefix, sink, context, to),
    ):
        parts = {size: part_images(side) for size, side in SIDES.items()}
        for images in parts.values():
            warm_up(client, prefix, sink, images)
        setups = {}
        for size, images in parts.items():  # the CPU line: both paths at the same rate
            for path, kind in ((FILES, "vllm_ec"), (PUSH, "vllm_push")):
                jobs = bodies(kind, images, to)
                setups[(path, size)] = lambda jobs=jobs: with_cpu(
                    lambda: delivered(client, prefix, jobs, window, RATE)
                )
        for path, kind in ((FILES, "vllm_ec"), (PUSH, "vllm_push")):  # closed loop: MB/s
            jobs = bodies(kind, parts["large"], to)
            setups[(path, "closed")] = lambda jobs=jobs: with_cpu(
                lambda: delivered(client, prefix, jobs, window)
            )
        # One push carries one large image's features: plain ZMQ sends messages of that size.
        one_image = image_bytes(client, prefix, parts["large"][0], to)
        setups[("plain", "closed")] = lambda: with_cpu(
            lambda: plain_zmq(context, sink, one_image, window)
        )
        measured = alternate(setups, repeats, rerun_if=server_failed)
    note = (
        f"Tiny tower, width {K3_WIDTH}, bfloat16, dp 2 on this machine's CPU, every image "
        f"cached after a warm-up, load reports polled every {LOAD_REPORT_MS} ms; requests of "
        f"{IMAGES_PER_PART} JPEGs of {SIDES['small']} (small) or {SIDES['large']} px "
        f"(large), {PARTS} of each round robin from {CLIENTS} clients; files onto a tmpfs "
        "`ec_root`, pushes to one receiver in the benchmark's process (acknowledged before "
        f"each answer). CPU line: every cell at {RATE} requests/s, so that CPU the ingress "
        "spends per second (Serve's own upkeep) weighs the same on every request; MB/s: "
        f"closed loop. {window:g} s per cell, {repeats} repeats alternating the seven cells "
        "(plain ZMQ: messages of one large image's features, the size of one push): median "
        "(min–max)."
    )
    return [
        Section(
            "Engine hand-off: vLLM push against files",
            "python -m benchmarks.bench_push",
            [note, line_table(measured), rate_table(measured, one_image)],
        )
    ]


def line_table(measured) -> str:
    rows = []
    for path in (FILES, PUSH):
        small, large = measured[(path, "small")], measured[(path, "large")]
        mb = [[r.mb_per_s / r.per_s for r in runs] for runs in (small, large)]
        for label in (cpu.INGRESS, None):
            ms = [[r.cpu_ms(label) for r in runs] for runs in (small, large)]
            fits = [line_through([a, b], [c, d]) for a, b, c, d in zip(*mb, *ms, strict=True)]
            rows.append(
                [
                    path,
                    label or "all of ours",
                    *(spread(m).fmt(1) for m in mb),
                    *(spread(m).fmt(2) for m in ms),
                    spread([zero for zero, _ in fits]).fmt(2),
                    f"**{spread([per_mb for _, per_mb in fits]).fmt(3)}**",
                ]
            )
    header = ["path", "CPU of", "MB per request: small", "large", "CPU-ms per request: small"]
    header += ["large", "fitted: CPU-ms per request", "+ CPU-ms per MB"]
    return table(header, rows)


def rate_table(measured, size: int) -> str:
    """Large requests' MB/s on both paths beside plain ZMQ's, closed loop, same repeats."""
    mb = {path: [r.mb_per_s for r in measured[(path, "closed")]] for path in (FILES, PUSH)}
    plain = [r.mb_per_s for r in measured[("plain", "closed")]]
    rows = [
        [path, spread(v).fmt(0), spread([r.per_s for r in measured[(path, "closed")]]).fmt(1)]
        for path, v in mb.items()
    ]
    rows += [
        [f"plain ZMQ PUSH/PULL, {size / 1e6:.1f} MB messages", spread(plain).fmt(0), "-"],
        ["push / files (MB/s)", ratio(mb[PUSH], mb[FILES]).fmt(2, "x"), ""],
        ["push / plain ZMQ (MB/s)", ratio(mb[PUSH], plain).fmt(2, "x"), ""],
    ]
    return table(["large requests, closed loop", "MB/s", "requests/s"], rows)


def image_bytes(client: Http, prefix: str, images: list[bytes], to: str) -> int:
    """Feature bytes of the first of ``images``, as one push request reports them."""
    output = {"kind": "vllm_push", "uuids": ["size-0"], "to": [to]}
    body = json.dumps({"items": items(images[:1]), "output": output}).encode()
    answer, _ = client.post(f"{prefix}/v1/encode", body, "application/json")
    return json.loads(answer)["items"][0]["bytes"]


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--repeats", type=int, help="repeats of every cell (default 5)")
    return standalone(__doc__, lambda a: sections(a.quick, a.repeats), argv, parser)


if __name__ == "__main__":
    sys.exit(main())
