"""`serve run` of a hub checkpoint (``hf://REPO@REVISION``) against a hub on loopback.

dp 2 on one node: the ranks fetch the vision weights once (one rank fetches under the
node's lock, the other reads its result), the safetensors bytes are served once, every
answer is the local checkpoint's features, and ``/v1/info`` says where each rank's weights
came from. A second ``serve run`` on that node, of the commit, makes no request at all.
The multi-node case (a rank on a fresh node fetching) is in test_multinode.py.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import requests
import yaml
from images import image_bytes
from serve_helpers import b64, decode_features, free_port, interrupt, launch, launch_healthy

from benchmarks.loopback_hub import LoopbackHub, write_k3_layout
from kimi_encoder.encoder import VisionEncoder

REPO = "moonshotai/Kimi-K3"
STARTUP_TIMEOUT_S = 180
# The served features against the in-process encoder's: other processes and other batches
# (the ranks split the four images; the second start encodes one), so within
# tests/serve/test_parity.py's tolerance: bit for bit held in most runs, and once differed
# by 1.7e-6 in a loaded parallel pass.
ATOL = 1e-5


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("k3-layout")
    layout = write_k3_layout(root, "tiny", seed=5, shards=6, language_ratio=20)
    with LoopbackHub() as server:
        server.commit = server.add(REPO, root)
        server.root, server.layout = root, layout
        yield server


def config(port: int, checkpoint: str) -> dict:
    model = {"checkpoint": checkpoint, "device": "cpu", "dtype": "float32"}
    app = {
        "name": "hub",
        "route_prefix": "/",
        "import_path": "deployments.app:build_app",
        "args": {
            "model": {**model, "preprocess_backend": "cpu"},
            "dp_size": 2,
            "ranks": {"actor_options": {"num_cpus": 0}, "calibration_grids": []},
            "ingress": {"actor_options": {"num_cpus": 0}},
        },
    }
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [app],
    }


def serve_run(tmp_path, name: str, checkpoint: str, hub: LoopbackHub, home):
    port = free_port()
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config(port, checkpoint)))
    env = {"HF_HOME": str(home), "HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    log = tmp_path / f"{name}.log"
    serve = str(Path(sys.executable).parent / "serve")
    process = launch([serve, "run", str(path)], log, env=env)
    return process, log, f"http://127.0.0.1:{port}"


def test_dp2_fetches_once_per_node_and_a_second_start_asks_nothing(hub, tmp_path):
    home = tmp_path / "hf-home"
    images = [image_bytes("RGB", (60 + 24 * i, 40 + 14 * i), 70 + i) for i in range(4)]
    local = VisionEncoder.from_pretrained(hub.root, device="cpu", dtype="float32", backend="cpu")
    want = local.encode([local.plan(x) for x in images])

    first = partial(serve_run, tmp_path, "first", f"hf://{REPO}@main", hub, home)
    process, log, url = launch_healthy(first, STARTUP_TIMEOUT_S)
    try:
        body = {"items": [{"type": "image", "image": b64(x)} for x in images]}
        answer = requests.post(f"{url}/v1/encode", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        items = answer.json()["items"]
        for item, w in zip(items, want, strict=True):
            np.testing.assert_allclose(decode_features(item), w.numpy(), rtol=0, atol=ATOL)
        info = requests.get(f"{url}/v1/info", timeout=30).json()
        assert info["model"] == REPO
        weights = [r["weights"] for r in info["ranks"]]  # both ranks loaded the fetched copy
    finally:
        interrupt(process)
    assert {w["commit"] for w in weights} == {hub.commit}
    assert sorted(w["cached"] for w in weights) == [False, True], weights  # one fetched
    fetched = next(w for w in weights if not w["cached"])
    assert fetched["source"] == f"hf://{REPO}"
    assert hub.body_bytes(".safetensors") == fetched["bytes_read"]  # counted once
    assert fetched["bytes_read"] <= hub.layout["vision_bytes"] + 2 * (1 << 20)
    assert "read 1.02 MB of 19 MB in 6 shards (2 with vision tensors)" in log.read_text()

    before = hub.requests()
    second = partial(serve_run, tmp_path, "second", f"hf://{REPO}@{hub.commit}", hub, home)
    process, log, url = launch_healthy(second, STARTUP_TIMEOUT_S)
    try:
        body = {"items": [{"type": "image", "image": b64(images[0])}]}
        answer = requests.post(f"{url}/v1/encode", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        got = decode_features(answer.json()["items"][0])
        np.testing.assert_allclose(got, want[0].numpy(), rtol=0, atol=ATOL)
        weights = [r["weights"] for r in requests.get(f"{url}/v1/info", timeout=30).json()["ranks"]]
    finally:
        interrupt(process)
    assert [w["cached"] for w in weights] == [True, True], weights
    assert hub.requests() == before, hub.log[before:]  # the ingress and both ranks: none
