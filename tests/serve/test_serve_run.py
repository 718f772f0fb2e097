"""`serve run` of a config that overrides one rank's resources: refused, naming both.

The shipped config as a user runs it (`make serve`, the README's requests, Ctrl-C) is
tests/serve/test_readme.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml
from serve_helpers import ctrl_c_reaches_it, free_port

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 180


def wait_ready(url: str, process: subprocess.Popen, log: Path) -> float:
    started = time.monotonic()
    while time.monotonic() - started < STARTUP_TIMEOUT_S:
        if process.poll() is not None:
            pytest.fail(f"serve run exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if requests.get(f"{url}/healthz", timeout=5).status_code == 200:
                return time.monotonic() - started
        except (requests.ConnectionError, requests.Timeout):  # proxy or route not up yet
            pass
        time.sleep(0.5)
    pytest.fail(f"not ready after {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


def start_serve_run(tmp_path: Path, config: dict) -> tuple[subprocess.Popen, Path]:
    """``serve run`` of ``config`` (written to a file) in a Ray cluster of its own."""
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log = tmp_path / "serve.log"
    # RAY_ADDRESS=local: a cluster of its own, even while the test session holds one.
    env = {**os.environ, "RAY_ADDRESS": "local"}
    serve_bin = Path(sys.executable).parent / "serve"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [str(serve_bin), "run", str(config_path)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=ctrl_c_reaches_it,
        )
    return process, log


def shipped_config(port: int) -> dict:
    config = yaml.safe_load((ROOT / "configs" / "config.yaml").read_text())
    config["http_options"]["port"] = port
    return config


def test_config_giving_one_rank_other_resources_is_refused(tmp_path):
    """A `deployments:` entry that changes one rank's ray_actor_options disagrees with
    ranks.actor_options (which set the device and threads): that rank refuses to start,
    naming both."""
    config = shipped_config(free_port())
    override = {"name": "EncoderRank_1", "ray_actor_options": {"num_cpus": 0.5}}
    config["applications"][0]["deployments"] = [override]
    process, log = start_serve_run(tmp_path, config)
    want = (
        "rank 1 was started with Ray resources {'CPU': 0.5}, but ranks.actor_options asks "
        "for {'CPU': 0.0, 'GPU': 0.0}"
    )
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while want not in log.read_text(errors="replace"):
            assert process.poll() is None or want in log.read_text(), log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
