"""Interop fixtures: the engine's code runs here, our side in a subprocess.

The test process is the engine's environment (``.venv-sglang`` or
``.venv-vllm``). Our side runs under ``KIMI_ENCODER_PYTHON``, the project's own
interpreter (``make interop`` passes ``.venv/bin/python``); without it, under
this interpreter. Tests that start the served application find the project's
``serve`` beside that interpreter (``kimi_tool("serve")``); the service runs in
the project's environment, where neither engine is installed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml
from keyed import AUTH, KEY
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
PRODUCE = Path(__file__).with_name("produce.py")
sys.path.insert(0, str(ROOT / "tests"))  # tests/images.py, the seeded image generator

STARTUP_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 30
PUSH_ACK_TIMEOUT_S = 5
# The served applications: float32 with dp 2 behind two ingress replicas, and bfloat16.
APPS = {
    "f32": {"dp_size": 2, "replicas": 2, "dtype": "float32"},
    "bf16": {"dp_size": 1, "replicas": 1, "dtype": "bfloat16"},
}
FAST_SHUTDOWN = {"graceful_shutdown_wait_loop_s": 0.1, "graceful_shutdown_timeout_s": 1}


@dataclass(frozen=True)
class Service:
    """``serve run`` of our applications: their URLs and encoder-cache roots by name."""

    urls: dict[str, str]
    ec_roots: dict[str, Path]
    request_timeout_s: float  # every part is answered within it
    push_ack_timeout_s: float  # a vllm_push item not acknowledged in it fails the request
    log: Path


def _ctrl_c_reaches_it() -> None:
    """A shell's background jobs ignore SIGINT and children inherit it: restore it, so
    the service stops on the test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _config(port: int, tmp: Path) -> dict:
    apps = []
    for name, fields in APPS.items():
        (tmp / f"ec-{name}").mkdir()
        args = {
            "model": {
                "checkpoint": "tiny",
                "device": "cpu",
                "preprocess_backend": "cpu",
                "dtype": fields["dtype"],
            },
            "dp_size": fields["dp_size"],
            # Features compared bit for bit: no cache, owners by patch count.
            "ranks": {
                "cache_bytes": 0,
                "calibration_grids": [],
                "serve_options": {"max_ongoing_requests": 64, "max_queued_requests": 64}
                | FAST_SHUTDOWN,
            },
            "ingress": {
                "replicas": fields["replicas"],
                "request_timeout_s": REQUEST_TIMEOUT_S,
                "serve_options": {"max_ongoing_requests": 32, "max_queued_requests": 64}
                | FAST_SHUTDOWN,
            },
            "dispatch": {"cost_model": "patches"},
            "handoff": {
                "wait_s": 20,
                "ec_root": str(tmp / f"ec-{name}"),
                "vllm_push": {"ack_timeout_s": PUSH_ACK_TIMEOUT_S},
            },
        }
        apps.append(
            {
                "name": name,
                "route_prefix": f"/{name}",
                "import_path": "deployments.app:build_app",
                "args": args,
            }
        )
    return {
        "proxy_location": "HeadOnly",
        # '::': IPv6 callers, and IPv4 ones as IPv4-mapped addresses (the engines' routes)
        "http_options": {"host": "::", "port": port, "request_timeout_s": 120},
        "applications": apps,
    }


def _ready(url: str) -> bool:
    try:
        if requests.get(f"{url}/health", timeout=5).status_code != 200:
            return False
        ranks = requests.get(f"{url}/v1/info", headers=AUTH, timeout=30).json()["ranks"]
    except (requests.RequestException, ValueError, KeyError):  # proxy or app not up yet
        return False
    return all(rank["state"] == "live" for rank in ranks)


@pytest.fixture(scope="session")
def service(kimi_tool, tmp_path_factory) -> Service:
    """Our service, started with the project's ``serve run`` in a Ray cluster of its own."""
    serve_bin = kimi_tool("serve")
    tmp = tmp_path_factory.mktemp("service")
    port = _free_port()
    config = tmp / "config.yaml"
    config.write_text(yaml.safe_dump(_config(port, tmp)))
    log = tmp / "serve.log"
    # Keyed: sglang's receivers call keyless from loopback, as the docs' launch lines do.
    env = os.environ | {
        "PYTHONPATH": str(ROOT),
        "RAY_ADDRESS": "local",
        "KIMI_ENCODER_API_KEY": KEY,
    }
    env.setdefault("RAY_AUTH_MODE", "disabled")
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(serve_bin), "run", str(config)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_ctrl_c_reaches_it,
        )
    urls = {name: f"http://127.0.0.1:{port}/{name}" for name in APPS}
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not all(_ready(url) for url in urls.values()):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"our service did not start:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        ec_roots = {name: tmp / f"ec-{name}" for name in APPS}
        yield Service(urls, ec_roots, REQUEST_TIMEOUT_S, PUSH_ACK_TIMEOUT_S, log)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="session")
def kimi_python() -> str:
    return os.environ.get("KIMI_ENCODER_PYTHON", sys.executable)


@pytest.fixture(scope="session")
def kimi_tool(kimi_python):
    """Path of a program installed with the project (e.g. ``serve``); skips if absent."""

    def find(name: str) -> Path:
        path = Path(kimi_python).with_name(name)
        if not path.exists():
            pytest.skip(f"{name} is not installed beside {kimi_python}; set KIMI_ENCODER_PYTHON")
        return path

    return find


@pytest.fixture
def produce(kimi_python, tmp_path):
    """Run ``produce.py MODE OUT ...`` under our interpreter; returns (spec, features)."""

    def command(mode: str, *args: str) -> list[str]:
        return [kimi_python, str(PRODUCE), mode, str(tmp_path / "out"), *args]

    def env() -> dict:
        return os.environ | {"PYTHONPATH": str(ROOT)}

    def run(mode: str, *args: str):
        result = subprocess.run(
            command(mode, *args), env=env(), capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr
        return read()

    def read():
        out = tmp_path / "out"
        return json.loads((out / "spec.json").read_text()), load_file(out / "expected.safetensors")[
            "features"
        ]

    run.command, run.env, run.read, run.out = command, env, read, tmp_path / "out"
    return run
