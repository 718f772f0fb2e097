"""Helpers of the serve tests: seeded images, wire formats, HTTP calls."""

from __future__ import annotations

import base64
import io
import os
import pickle
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import ray
import requests
import torch

from benchmarks.checkout import ctrl_c_reaches_it
from deployments.admission import Admission
from deployments.args import AppArgs, IngressArgs, RankArgs
from kimi_encoder.config import resolve_configs
from kimi_encoder.engines.sglang import EMBEDDING_DATA, MODALITY
from kimi_encoder.features import from_bytes, to_float32

# Fast teardown: no request is in flight when an app is deleted.
FAST_SHUTDOWN = {"graceful_shutdown_wait_loop_s": 0.1, "graceful_shutdown_timeout_s": 0.5}
# Limits of every test app: the 9-image request fits, the limit tests go over.
LIMITS = dict(
    max_request_bytes=4 << 20,
    max_images_per_request=10,
    max_image_pixels=1_000_000,
    max_patches_per_request=4096,
)
# What every test app runs with, in the nested shape of a config's `args:`: CPU ranks,
# the test limits, fast teardown (on top of the default Serve options).
TEST_APP = {
    "model": {"device": "cpu", "preprocess_backend": "cpu"},
    "ranks": {"serve_options": RankArgs().serve_options.model_dump() | FAST_SHUTDOWN},
    "ingress": {
        "serve_options": IngressArgs().serve_options.model_dump() | FAST_SHUTDOWN,
        "limits": LIMITS,
    },
}

# (mode, size, seed, format): mixed sizes, one far larger than the rest, RGBA, palette, JPEG.
IMAGE_SPECS = [
    ("RGB", (64, 48), 1, "PNG"),
    ("RGB", (700, 520), 2, "PNG"),  # the big one: scaled down to the tiny preset's patch budget
    ("RGBA", (40, 40), 3, "PNG"),
    ("P", (100, 60), 4, "PNG"),
    ("RGB", (90, 45), 5, "JPEG"),
    ("RGB", (128, 96), 6, "PNG"),
    ("RGBA", (30, 70), 7, "PNG"),
    ("L", (150, 110), 8, "PNG"),
    ("P", (56, 56), 9, "PNG"),
]

# Shared apps check features bit for bit against the in-process encoder, so a cache hit
# (features from another batch) must not stand in, and owners follow the reference rule
# (patch counts). The cache, fitted costs and batching have apps of their own
# (test_throughput.py).
REFERENCE_PATH = {"ranks": {"cache_bytes": 0}, "dispatch": {"cost_model": "patches"}}


def merged(base: dict, top: dict) -> dict:
    """``top`` over ``base``, key by key at every depth (a config's nested args)."""
    out = dict(base)
    for key, value in top.items():
        nest = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merged(out[key], value) if nest else value
    return out


def app_args(*layers: dict, **sections) -> AppArgs:
    """AppArgs of a test app: ``TEST_APP``, then each of ``layers``, then ``sections``
    (e.g. ``ranks={"cache_bytes": 0}``), each merged over what came before."""
    args = TEST_APP
    for layer in (*layers, sections):
        args = merged(args, layer)
    return AppArgs.model_validate(args)


def admission(args: AppArgs) -> Admission:
    """The admission an ingress of ``args`` runs (as ``EncodeServer`` builds it), for the
    tests that admit requests without Ray."""
    vision, preprocess, _ = resolve_configs(args.model.checkpoint)
    return Admission(
        vision,
        preprocess,
        args.ingress.limits,
        args.ingress.body_pace,
        args.model_as_run,
        vllm_ec=args.handoff.ec_root is not None,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def decode_features(item: dict) -> np.ndarray:
    """An item of a JSON answer as float32 values (every wire dtype, docs/api.md)."""
    raw = from_bytes(base64.b64decode(item["data"]), item["dtype"], tuple(item["shape"]))
    return to_float32(raw, item["dtype"])


@contextmanager
def one_thread() -> Iterator[None]:
    """Match a rank's torch thread count (num_cpus 0 -> 1 thread) for bit-exact references."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def encode(url: str, items: list[dict], **extra) -> requests.Response:
    return requests.post(f"{url}/v1/encode", json={"items": items, **extra}, timeout=120)


def rank_calls(url: str) -> list[int]:
    info = requests.get(f"{url}/v1/info", timeout=30).json()
    return [r["calls"] for r in info["ranks"]]


def replica_pids(url: str, app: str, headers: dict | None = None) -> dict[str, int]:
    """Rank pids from /v1/info, plus the ingress replica's pid from its process title."""
    info = requests.get(f"{url}/v1/info", headers=headers, timeout=30).json()
    assert all(r["state"] == "live" for r in info["ranks"]), info["ranks"]
    pids = {f"rank_{r['rank']}": r["pid"] for r in info["ranks"]}
    title = f"ServeReplica:{app}:EncodeServer".encode()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and title in (proc / "cmdline").read_bytes():
                pids["ingress"] = int(proc.name)
        except OSError:  # a process that exited while we looked
            pass
    assert "ingress" in pids, "ingress replica process not found"
    return pids


def serve_actors(app: str, deployment: str) -> list[dict]:
    """Ray's actor table rows (``Name``, ``State``, ``Pid``, ...) of every replica actor
    of ``deployment`` in ``app`` ever started, dead ones included."""
    tag = f"{app}#{deployment}#"
    return [a for a in ray._private.state.actors().values() if tag in a["Name"]]


def replica_actor_name(app: str, rank: int) -> str:
    """The actor name of the live Serve replica of ``rank`` in ``app``."""
    alive = [a for a in serve_actors(app, f"EncoderRank_{rank}") if a["State"] == "ALIVE"]
    assert len(alive) == 1, [a["Name"] for a in alive]
    return alive[0]["Name"]


def replica_actor(app: str, rank: int):
    """The live Serve replica actor of ``rank`` in ``app`` (a handle for ray.kill)."""
    return ray.get_actor(replica_actor_name(app, rank), namespace="serve")


class _FrameUnpickler(pickle.Unpickler):
    """Frame 0 without sglang: its two class names resolve to plain stand-ins."""

    def find_class(self, module, name):
        if (module, name) == EMBEDDING_DATA:
            return SimpleNamespace
        if (module, name) == MODALITY:
            return lambda value: ("Modality", value)
        return super().find_class(module, name)


def read_frame0(data: bytes) -> SimpleNamespace:
    """Frame 0 of a pushed part (sglang's ``EmbeddingData``) as plain attributes."""
    return _FrameUnpickler(io.BytesIO(data)).load()


def read_part(frames: list[bytes]) -> tuple[SimpleNamespace, torch.Tensor | None]:
    """A pushed part: frame 0's attributes and the embedding of frame 1 (None for an
    error frame, which comes alone)."""
    meta = read_frame0(frames[0])
    if meta.error_msg is not None:
        assert len(frames) == 1, f"an error frame comes alone, got {len(frames)} frames"
        return meta, None
    assert len(frames) == 2, f"a part is two frames, got {len(frames)}"
    embedding = torch.frombuffer(bytearray(frames[1]), dtype=meta.dtype).reshape(meta.shape)
    return meta, embedding


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + b64(data)


def sglang_part(req_id: str, refs: list[str], address: str | None = None, **fields) -> dict:
    """An /encode body as sglang 0.5.23 sends it; ``address`` set: zmq_to_tokenizer."""
    host, _, port = (address or "127.0.0.1:").partition(":")
    return {
        "encoder_idx": 0,
        "encoder_url": "http://encoder:8000",
        "mm_items": refs,
        "num_parts": 1,
        "part_idx": 0,
        "req_id": req_id,
        "modality": "IMAGE",
        "prefill_host": host,
        "embedding_port": int(port) if port else None,
        "time_stats_json": None,
        **fields,
    }


@contextmanager
def served(serve_url: str, name: str, args: AppArgs) -> Iterator[str]:
    """The app of ``args`` running under ``name`` (its route prefix too), deleted after:
    yields its base URL."""
    from ray import serve

    from deployments.app import bind_app

    serve.run(bind_app(args), name=name, route_prefix=f"/{name}")
    try:
        yield f"{serve_url}/{name}"
    finally:
        serve.delete(name)


def wait_for(predicate, within_s: float, what: str, every: float = 0.2):
    """Poll ``predicate`` (returns a truthy value when met) until it holds: that value;
    an assertion error naming ``what`` once ``within_s`` has passed."""
    deadline = time.monotonic() + within_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not within {within_s:g} s"
        time.sleep(every)


def replica_actors(app: str, deployment: str, alive: bool = True) -> list[str]:
    """Names of the Serve replica actors of ``deployment`` in ``app``: the running ones,
    or (``alive=False``) every one ever started, dead ones included."""
    return [a["Name"] for a in serve_actors(app, deployment) if a["State"] == "ALIVE" or not alive]


def rank_processes(app: str, ranks: int, alive: bool = True) -> dict[int, int]:
    """Replica actors of each of the app's ``ranks`` rank deployments (``replica_actors``)."""
    return {r: len(replica_actors(app, f"EncoderRank_{r}", alive)) for r in range(ranks)}


class Ramp:
    """Closed-loop clients, each sending requests of ``per_request`` fresh seeded JPEGs of
    ``side`` x ``side`` until stopped; every answer's status and features are kept, and
    each answered image's bytes for the check (making a 448x448 JPEG again costs about
    as much as encoding it)."""

    def __init__(self, url: str, per_request: int = 4, side: int = 448, first_seed: int = 0):
        self.url = url
        self.per_request, self.side, self.first_seed = per_request, side, first_seed
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.statuses: list[int] = []
        self.features: dict[int, np.ndarray] = {}  # image seed -> its features
        self.sent: dict[int, bytes] = {}  # image seed -> the JPEG sent

    def client(self, k: int) -> None:
        from images import image_bytes

        n = 0
        while not self.stop.is_set():
            base = self.first_seed + 100_000 * (k + 1) + self.per_request * n
            seeds = [base + j for j in range(self.per_request)]
            jpegs = [image_bytes("RGB", (self.side,) * 2, s, fmt="JPEG") for s in seeds]
            files = [("image", (f"{s}.jpg", jpeg)) for s, jpeg in zip(seeds, jpegs, strict=True)]
            answer = requests.post(f"{self.url}/v1/encode", files=files, timeout=120)
            with self.lock:
                self.statuses.append(answer.status_code)
                if answer.status_code == 200:
                    items = answer.json()["items"]
                    for seed, jpeg, item in zip(seeds, jpegs, items, strict=True):
                        self.features[seed] = decode_features(item)
                        self.sent[seed] = jpeg
            n += 1

    def check(self, reference) -> None:
        """Every answer 200, every image's features the in-process encoder's (1e-5)."""
        counts = {s: self.statuses.count(s) for s in set(self.statuses)}
        assert set(self.statuses) == {200}, counts
        with one_thread():
            for seed, got in self.features.items():
                (want,) = reference.encode([reference.plan(self.sent[seed])])
                np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-5, err_msg=str(seed))


ROOT = Path(__file__).resolve().parents[1]


def launch(command: list[str], log: Path, **popen) -> subprocess.Popen:
    """``command`` from the repository root in a session of its own and, with
    RAY_ADDRESS=local, a Ray cluster of its own even while the test session holds one;
    its output to ``log``. Stop it with ``interrupt``."""
    env = {**os.environ, "RAY_ADDRESS": "local", **popen.pop("env", {})}
    with log.open("wb") as out:
        return subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=popen.pop("stdout", out),
            stderr=subprocess.STDOUT if "stdout" not in popen else out,
            start_new_session=True,
            preexec_fn=ctrl_c_reaches_it,
            **popen,
        )


def interrupt(process: subprocess.Popen, within_s: float = 90) -> int:
    """Ctrl-C the launched process's session (as in its terminal); killed if it has not
    stopped within ``within_s`` (then TimeoutExpired is raised). Its exit code."""
    os.killpg(process.pid, signal.SIGINT)
    try:
        return process.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise


# Ray 2.60 gives a new node's raylet a fixed 30 s to register with its GCS (ray/_private/
# node.py, no setting). A cluster started in a subprocess beside the test session's two
# on two cores, one of them kept busy, has missed it: the machine's load, which no test
# is about, so such a start is made again (with a process of its own each time).
RAY_START_TIMED_OUT = "The current node timed out during startup"
RAY_START_TRIES = 3


def ray_start_timed_out(log: Path) -> bool:
    """Whether ``log`` holds Ray's node start-up timeout."""
    return RAY_START_TIMED_OUT in log.read_text(errors="replace")


def launch_healthy(
    start: Callable[[], tuple[subprocess.Popen, Path, str]], within_s: float
) -> tuple[subprocess.Popen, Path, str]:
    """``start()`` -> (process, log, url) once ``url`` is healthy (``healthy``); a start
    that ended on Ray's node start-up timeout is made again (``RAY_START_TRIES`` in all).
    A start that fails otherwise is stopped and its assertion raised."""
    attempt = 1
    while True:
        process, log, url = start()
        try:
            healthy(url, process, log, within_s)
            return process, log, url
        except AssertionError:
            if process.poll() is None:
                interrupt(process)
            if attempt == RAY_START_TRIES or not ray_start_timed_out(log):
                raise
        attempt += 1


def healthy(url: str, process: subprocess.Popen, log: Path, within_s: float) -> float:
    """Seconds until ``url``'s /healthz answers 200; an assertion error with the log's
    tail if the process ends first or ``within_s`` passes."""
    started = time.monotonic()
    while True:
        assert process.poll() is None, log.read_text(errors="replace")[-4000:]
        assert time.monotonic() - started < within_s, log.read_text(errors="replace")[-4000:]
        try:
            if requests.get(f"{url}/healthz", timeout=5).status_code == 200:
                return time.monotonic() - started
        except (requests.ConnectionError, requests.Timeout):  # proxy or route not up yet
            pass
        time.sleep(0.5)


def kill_ranks(app: str, ranks) -> None:
    """Kill the live replica of each of ``ranks`` of ``app`` (Serve starts replacements)."""
    for rank in ranks:
        ray.kill(replica_actor(app, rank), no_restart=True)
