"""`serve run` of a config that overrides one rank's resources: refused, naming both.

The shipped config as a user runs it (`make serve`, the README's requests, Ctrl-C) is
tests/serve/test_readme.py."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import yaml
from serve_helpers import free_port, interrupt, launch

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 180


def start_serve_run(tmp_path: Path, config: dict) -> tuple[subprocess.Popen, Path]:
    """``serve run`` of ``config`` (written to a file) in a Ray cluster of its own."""
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log = tmp_path / "serve.log"
    serve_bin = Path(sys.executable).parent / "serve"
    return launch([str(serve_bin), "run", str(config_path)], log), log


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
        interrupt(process)
