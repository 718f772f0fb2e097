"""Engine hand-off: feature bytes delivered per second, and the ingress's CPU per part.

    python -m benchmarks.bench_handoff [--quick] [--only throughput cpu]

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
token, 1024 tokens (14.7 MB) per 896x896 image, sent as a JPEG.
The feature cache is on and warmed by a first pass, so both served paths move
features rather than compute them. Closed loop, ``CLIENTS`` senders; MB/s counts
feature bytes (frame 1; the safetensors ``features.*`` tensors) as they arrive.
Both served paths post the same prepared JSON bodies with the same client
(``serving.Http``: ``http.client``, one kept-alive connection per thread), which
reads an answer for a small fraction of the CPU that ``requests``' ``.content``
takes: on a machine of few cores a slow client would slow the HTTP path by its
own CPU, not the server's.

The CPU line (``--only cpu``): on the same app, sglang parts and vLLM requests
(encoder-cache files onto a tmpfs ``ec_root``) of small and of large images,
every image cached, alternated in the same repeats; the ingress's CPU per part
through the two sizes is a line: CPU-ms per part whatever its size, plus CPU-ms
per MB of features, fitted per repeat.

Each window also records the CPU time of every process (``benchmarks/cpu.py``):
CPU-ms per part by role, and the rate those milliseconds allow on this machine's
cores (the CPU-bound limit), so a path's distance from plain ZMQ is explained by
measurement.
"""

from __future__ import annotations

import sys
import tempfile

import psutil

from . import cpu
from .common import Section, alternate, ratio, spread, table
from .cpu_line import SIDES, Run, line_table, warmed_parts, with_cpu
from .page import arguments, standalone
from .paths import (
    CLIENTS,
    IMAGES_PER_PART,
    PARTS,
    SIDE,
    Sink,
    floor_app,
    handoff,
    handoff_app,
    http_body,
    part_images,
    plain_zmq,
    vllm_files,
    warm_up,
)
from .serving import K3_WIDTH, Http, server_failed, tmpfs

HEADER = ["path", "MB/s", "parts/s", "vs plain ZMQ (MB/s)"]
FLOOR = "floor"


PARTS_OF = ("throughput", "cpu")  # --only: the sections' parts


def sections(quick: bool, only: tuple[str, ...] = PARTS_OF) -> list[Section]:
    window = 3.0 if quick else 6.0
    repeats = 3 if quick else 5  # see feature_bytes.Settings.repeats
    out = []
    with (
        tempfile.TemporaryDirectory(dir=tmpfs()) as ec_root,
        handoff_app(ec_root) as (client, prefix, sink, context),
    ):
        if "throughput" in only:
            out.append(throughput(client, prefix, sink, context, window, repeats))
        if "cpu" in only:
            out.append(cpu_line(client, prefix, sink, window, repeats))
    return out


def throughput(client: Http, prefix: str, sink: Sink, context, window: float, repeats: int):
    from ray import serve

    parts = part_images()
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
    serve.delete(FLOOR)
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
        f"Tiny tower with Kimi-K3's text_hidden_size {K3_WIDTH} and K3 preprocessing, bfloat16, "
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
    return Section(
        "Engine hand-off",
        "python -m benchmarks.bench_handoff --only throughput",
        [note, table(HEADER, rows), verdict, FLOORS, floors, *cpu_tables(measured)],
    )


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

    labels = [cpu.INGRESS, "rank 0", "rank 1", *cpu.AROUND[1:]]
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


LINE_PATHS = ("sglang parts (/encode, pushed)", "vLLM requests (/v1/encode, files)")


def cpu_line(client: Http, prefix: str, sink: Sink, window: float, repeats: int) -> Section:
    """The ingress's CPU per sglang part and per vLLM request through small and large parts,
    every image cached, the four cells alternated."""
    parts = warmed_parts(client, prefix, sink)
    setups = {}
    for size, images in parts.items():
        setups[(LINE_PATHS[0], size)] = lambda images=images: with_cpu(
            lambda: handoff(client, f"{prefix}/encode", sink, images, window)
        )
        setups[(LINE_PATHS[1], size)] = lambda images=images: with_cpu(
            lambda: vllm_files(client, prefix, images, window)
        )
    measured = alternate(setups, repeats, rerun_if=server_failed)
    note = (
        f"The hand-off app above (tiny tower, width {K3_WIDTH}, bfloat16, dp 2, every image "
        f"cached after a warm-up); parts (requests) of {IMAGES_PER_PART} JPEGs of "
        f"{SIDES['small']}x{SIDES['small']} (small) or {SIDES['large']}x{SIDES['large']} "
        f"px (large), {PARTS} of each round robin, {CLIENTS} clients; vLLM files under an "
        f"`ec_root` on a tmpfs; {window:g} s per cell, {repeats} repeats alternating the four "
        "cells: median (min–max). CPU of the ingress replicas (the hand-off registry's "
        "included) and of all of ours, per part; the fitted line goes through each repeat's "
        "small and large cell: CPU-ms per part whatever its size, plus CPU-ms per MB of "
        "features."
    )
    return Section(
        "Hand-off: ingress CPU per part, small and large",
        "python -m benchmarks.bench_handoff --only cpu",
        [note, line_table(measured, LINE_PATHS, "part", 1)],
    )


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("--only", nargs="+", choices=PARTS_OF, default=list(PARTS_OF))
    return standalone(__doc__, lambda a: sections(a.quick, tuple(a.only)), argv, parser)


if __name__ == "__main__":
    sys.exit(main())
