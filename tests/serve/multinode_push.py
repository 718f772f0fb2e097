"""Output kind ``vllm_push`` on a simulated multi-node Ray cluster, no directory shared.

``test_vllm_push.py`` runs this as a subprocess (one process joins one Ray cluster):
``python multinode_push.py HTTP_PORT``. A head node holds the proxy and the ingress
(custom resource ``head``), two worker nodes one rank each (``encoder_slot``); no
``handoff.ec_root`` is configured. A consumer worker's receiver listens in this process;
the ranks push to it from their nodes. Prints one JSON line of findings: the answer's
status and owners, the nodes of the ingress and of the ranks, and the largest difference
between what was staged and the in-process encoder's features.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import numpy as np
import ray
import requests
import torch
from ray import serve
from ray.cluster_utils import Cluster

# tests/ for its helpers, and the checkout itself: tests/kimi_encoder (no __init__.py)
# would otherwise shadow the editable install as a namespace package.
sys.path.insert(0, str(Path(__file__).parents[2]))
sys.path.insert(0, str(Path(__file__).parents[1]))
from images import image_bytes
from serve_helpers import app_args, b64

from deployments.app import bind_app
from kimi_encoder.encoder import VisionEncoder
from kimi_encoder.engines.ecreceive import Receiver, Staging

APP = "multinode_push"


def main() -> None:
    port = int(sys.argv[1])
    torch.set_num_threads(1)
    reference = VisionEncoder.from_pretrained("tiny", device="cpu", dtype="float32", backend="cpu")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"head": 1}, "include_dashboard": False},
    )
    for k in range(2):
        cluster.add_node(num_cpus=1, resources={"encoder_slot": 1, f"worker_{k}": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        rx_port = sock.getsockname()[1]
    receiver = Receiver("127.0.0.1", rx_port, Staging(1 << 26, 300))
    out: dict = {"head": cluster.head_node.node_id}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        args = app_args(
            dp_size=2,
            ranks={
                "actor_options": {"num_cpus": 0, "resources": {"encoder_slot": 1}},
                "cache_bytes": 0,
                "calibration_grids": [],
            },
            ingress={"actor_options": {"resources": {"head": 0.01}}},
            dispatch={"cost_model": "patches"},
        )
        serve.run(bind_app(args), name=APP, route_prefix=f"/{APP}")
        url = f"http://127.0.0.1:{port}/{APP}"
        ranks = requests.get(f"{url}/v1/info", timeout=30).json()["ranks"]
        out["rank_nodes"] = [r["node_id"] for r in ranks]
        out["ingress_node"] = out["head"]
        data = [image_bytes("RGB", (90 + 10 * i, 60 + 8 * i), 9300 + i) for i in range(4)]
        uuids = [f"node-push-{i}" for i in range(len(data))]
        items = [{"type": "image", "image": b64(b)} for b in data]
        output = {"kind": "vllm_push", "uuids": uuids, "to": [f"127.0.0.1:{rx_port}"]}
        answer = requests.post(
            f"{url}/v1/encode", json={"items": items, "output": output}, timeout=120
        )
        out["status"] = answer.status_code
        if answer.status_code != 200:
            out["body"] = answer.text[:500]
            return
        out["owners"] = [e["owner_rank"] for e in answer.json()["items"]]
        want = reference.encode([reference.plan(b) for b in data])
        errors = []
        for uuid, features in zip(uuids, want, strict=True):
            staged = receiver.staging.get(uuid)
            errors.append(np.inf if staged is None else float((staged - features).abs().max()))
        out["max_error"] = max(errors)
    finally:
        print(json.dumps(out), flush=True)
        receiver.close()
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
