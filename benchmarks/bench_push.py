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

import contextlib
import json
import socket
import sys
import tempfile
from collections.abc import Iterator

import zmq

from .common import Section, alternate, ratio, spread, table
from .cpu_line import SIDES, line_table, warmed_parts, with_cpu
from .page import arguments, standalone
from .paths import CLIENTS, IMAGES_PER_PART, PARTS, Sink, delivered, handoff_app, items, plain_zmq
from .serving import K3_WIDTH, Http, server_failed, tmpfs

# The ingress polls the ranks' load reports when older than this: 50 ms by default, so
# under load up to 20 polls a second per rank, whatever the request rate. Two paths at
# different rates would share that time-driven CPU out differently per request; polled
# once a second, the ingress's CPU per request is its work on the requests.
LOAD_REPORT_MS = 1000

RATE = 20  # requests a second of the CPU line's cells: below what either path sustains
FILES, PUSH = "vLLM files (/v1/encode, vllm_ec)", "vLLM push (/v1/encode, vllm_push)"


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


@contextlib.contextmanager
def app(ec_root: str) -> Iterator[tuple[Http, str, Sink, zmq.Context, str]]:
    """``paths.handoff_app``, its load reports polled every ``LOAD_REPORT_MS``, and a consumer
    worker's receiver in this process (the address to push to)."""
    from kimi_encoder.engines.ecreceive import Receiver, Staging

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        rx_port = sock.getsockname()[1]
    receiver = Receiver("127.0.0.1", rx_port, Staging(1 << 30, 600))
    try:
        with handoff_app(ec_root, load_report_interval_ms=LOAD_REPORT_MS) as served:
            yield (*served, f"127.0.0.1:{rx_port}")
    finally:
        receiver.close()


def sections(quick: bool, repeats: int | None = None) -> list[Section]:
    window = 3.0 if quick else 6.0
    repeats = repeats or (3 if quick else 5)
    with (
        tempfile.TemporaryDirectory(dir=tmpfs()) as ec_root,
        app(ec_root) as (client, prefix, sink, context, to),
    ):
        parts = warmed_parts(client, prefix, sink)
        setups = {}
        for size, images in parts.items():  # the CPU line: both paths at the same rate
            for path, kind in ((FILES, "vllm_ec"), (PUSH, "vllm_push")):
                jobs = bodies(kind, images, to)
                setups[(path, size)] = lambda jobs=jobs: with_cpu(
                    lambda: delivered(client, prefix, jobs, window, rate=RATE)
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
            [
                note,
                line_table(measured, (FILES, PUSH), "request", 2),
                rate_table(measured, one_image),
            ],
        )
    ]


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
