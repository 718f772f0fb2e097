"""Two revisions side by side on this machine: tower-only and served images/s, alternating.

    python -m benchmarks.revisions BASE [HEAD] [--checkpoint small] [--repeats 3]

Answers "did this change make the CPU path slower?" with both revisions measured
in one run. Each revision is exported with ``git archive`` into a temporary
directory and run from there with this checkout's Python environment:

- tower: a subprocess importing that revision's ``kimi_encoder`` times
  ``VisionEncoder.forward`` (tower + projector) on bench_encoder's fixed mix,
  one torch thread, preprocessing done before the clock starts;
- served: that revision's own ``configs/config.yaml`` under ``serve run`` (only
  the checkpoint and the HTTP port replaced), fed by bench_serve's closed-loop
  clients; every server starts fresh and no image is sent twice, so nothing is
  a cache hit.

Repeats alternate the revisions (A B A B ...); a ratio is HEAD / BASE per
repeat, printed as median (min–max). Not part of ``make bench``: it needs two
revisions and restarts a Ray cluster for every served window.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .checkout import ctrl_c_reaches_it
from .common import Section, alternate, ratio, spread, table
from .inputs import mode_mix
from .page import ROOT, arguments, git, standalone
from .serving import (
    CLIENTS,
    PER_REQUEST,
    Encode,
    Http,
    HttpError,
    closed_loop,
    free_port,
    request_stream,
)

# Runs inside the revision's tree: argv = checkpoint, images folder, seconds.
TOWER = """
import sys, time, pathlib, torch
from kimi_encoder.encoder import VisionEncoder
torch.set_num_threads(1)
images = [p.read_bytes() for p in sorted(pathlib.Path(sys.argv[2]).glob("*.png"))]
encoder = VisionEncoder.from_pretrained(sys.argv[1], device="cpu", backend="cpu")
items = [encoder.plan(data) for data in images]
pixels = encoder.materialize(items)
encoder.forward(pixels, items)
calls, start = 0, time.perf_counter()
while time.perf_counter() - start < float(sys.argv[3]):
    encoder.forward(pixels, items)
    calls += 1
print(len(items) * calls / (time.perf_counter() - start))
"""


class Revision:
    """One revision exported to ``root``; runs with this checkout's interpreter."""

    def __init__(self, rev: str, root: Path):
        self.rev = git("rev-parse", "--short", rev)
        self.root = root
        root.mkdir(parents=True)
        archive = subprocess.run(
            ["git", "archive", "--format=tar", self.rev], cwd=ROOT, capture_output=True, check=True
        )
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
        self.env = {
            **os.environ,
            "PYTHONPATH": str(root),
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
        }

    def tower(self, checkpoint: str, images: Path, seconds: float) -> float:
        """Tower + projector images/s, one torch thread."""
        out = subprocess.run(
            [sys.executable, "-c", TOWER, checkpoint, str(images), str(seconds)],
            cwd=self.root,
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
        )
        return float(out.stdout.strip().splitlines()[-1])

    def served(self, checkpoint: str, stream: list[list[bytes]], seconds: float) -> float:
        """Served images/s of ``serve run`` with this revision's shipped config."""
        import yaml

        port = free_port()
        config = yaml.safe_load((self.root / "configs" / "config.yaml").read_text())
        config["http_options"]["port"] = port
        args = config["applications"][0]["args"]
        # Revisions since the arguments were grouped by component name it under model:.
        (args["model"] if isinstance(args.get("model"), dict) else args)["checkpoint"] = checkpoint
        path = self.root / "configs" / "_revisions.yaml"
        path.write_text(yaml.safe_dump(config))
        log = (self.root / "serve.log").open("ab")
        proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("serve")), "run", str(path)],
            cwd=self.root,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=ctrl_c_reaches_it,
        )
        try:
            encode = Encode(Http(port), "", stream)
            _wait_until_answering(encode, proc, path)
            window = closed_loop(_once(encode), CLIENTS, seconds)
            return window.images_per_s
        finally:
            _stop(proc)
            log.close()


def _once(encode: Encode):
    """``encode.send`` that refuses to send a request twice (a cache hit is no measurement)."""

    def send(k: int) -> tuple[int, int]:
        # Request 0 warmed the server up; the window's requests start at 1.
        if k + 1 >= len(encode.bodies):
            raise RuntimeError(
                f"the window needed more than {len(encode.bodies)} distinct requests: "
                "raise --requests or shorten --seconds."
            )
        return encode.send(k + 1)

    return send


def _wait_until_answering(encode: Encode, proc: subprocess.Popen, config: Path) -> None:
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"serve run {config} exited with {proc.returncode}; see its log.")
        try:
            encode.send(0)
            return
        except (OSError, HttpError):
            pass  # not listening yet, or the proxy answers 404/503 until the app is up
        if time.monotonic() > deadline:
            raise RuntimeError(f"serve run {config} did not answer within 300 s.")
        time.sleep(1)


def _stop(proc: subprocess.Popen) -> None:
    """Ctrl-C the whole ``serve run`` session (it shuts its cluster down), then wait."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def compare(base: str, head: str, checkpoint: str, repeats: int, seconds: float, requests: int):
    with tempfile.TemporaryDirectory(prefix="kimi-revisions-") as tmp:
        revisions = [Revision(rev, Path(tmp) / name) for name, rev in (("a", base), ("b", head))]
        images = Path(tmp) / "mix"
        images.mkdir()
        mix = mode_mix()
        for i, data in enumerate(mix):
            (images / f"{i}.png").write_bytes(data)
        stream = request_stream(requests)
        tower = alternate(
            {r.rev: lambda r=r: r.tower(checkpoint, images, seconds) for r in revisions}, repeats
        )
        served = alternate(
            {r.rev: lambda r=r: r.served(checkpoint, stream, seconds) for r in revisions}, repeats
        )
    a, b = (r.rev for r in revisions)
    rows = [
        [
            name,
            spread(rates[a]).fmt(2),
            spread(rates[b]).fmt(2),
            f"**{ratio(rates[b], rates[a]).fmt(2, 'x')}**",
        ]
        for name, rates in (
            ("tower + projector, in-process", tower),
            ("served, `serve run`", served),
        )
    ]
    note = (
        f"Preset {checkpoint}; {repeats} repeats alternating {a} and {b}, {seconds:g} s per "
        f"window. Tower: bench_encoder's mix of {len(mix)} images in one forward, one "
        f"torch thread. Served: each revision's shipped configs/config.yaml, {CLIENTS} clients, "
        f"{PER_REQUEST} distinct images per request (JSON), a fresh server per window (no cache "
        "hits). Figures: images/s, median (min–max); the ratio is per repeat."
    )
    return note, table(["measurement", f"{a}, images/s", f"{b}, images/s", f"{b} / {a}"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__)
    parser.add_argument("base", help="the revision before (any git revision)")
    parser.add_argument("head", nargs="?", default="HEAD", help="the revision after")
    parser.add_argument("--checkpoint", default="small", help="preset or checkpoint folder")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=15.0, help="per window")
    parser.add_argument("--requests", type=int, default=400, help="distinct requests per server")

    def make(args) -> list[Section]:
        note, rows = compare(
            args.base, args.head, args.checkpoint, args.repeats, args.seconds, args.requests
        )
        command = f"python -m benchmarks.revisions {args.base} {args.head}"
        return [Section("Two revisions side by side", command, [note, rows])]

    return standalone(__doc__, make, argv, parser)


if __name__ == "__main__":
    sys.exit(main())
