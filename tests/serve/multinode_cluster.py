"""A simulated two-worker-node Ray cluster serving a dp-2 app; one worker node is removed.

``test_multinode.py`` runs this as a subprocess: ``ray.cluster_utils.Cluster``
starts its own head and raylets, and one process can join only one cluster
(the test session's shared one stays untouched). Usage:
``python multinode_cluster.py HTTP_PORT``. Prints one JSON line of findings.

Layout: a head node with the proxy, the Serve controller and the ingress
(custom resource ``head``), two worker nodes with one ``encoder_slot`` each,
and ranks asking for one ``encoder_slot`` (``ranks.actor_options.resources``),
so each node holds one rank. After a first request, the node holding rank 1 is
removed while a request's share waits there (its forward held by the test's
switchboard, ``controlled.py``); rank 1 has
no slot to come back to, and that request and later ones must be answered by
rank 0 alone.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import sys
import time
from pathlib import Path

import numpy as np
import ray
import requests
import torch
from ray import serve
from ray.cluster_utils import Cluster

sys.path.insert(0, str(Path(__file__).parents[1]))
from controlled import Switchboard, controlled_factory
from images import image_bytes
from serve_helpers import app_args, b64, decode_features

from deployments.app import bind_app
from kimi_encoder.encoder import VisionEncoder

APP = "multinode"


def post(url: str, data: list[bytes]) -> requests.Response:
    items = [{"type": "image", "image": b64(b)} for b in data]
    return requests.post(f"{url}/v1/encode", json={"items": items}, timeout=60)


def check(response: requests.Response, data: list[bytes], reference: VisionEncoder) -> dict:
    if response.status_code != 200:
        return {"status": response.status_code, "body": response.text[:300]}
    items = response.json()["items"]
    want = reference.encode([reference.plan(b) for b in data])
    error = max(
        float(np.abs(decode_features(item) - w.numpy()).max())
        for item, w in zip(items, want, strict=True)
    )
    return {"status": 200, "max_error": error, "owners": [i["owner_rank"] for i in items]}


def main() -> None:
    port = int(sys.argv[1])
    torch.set_num_threads(1)
    reference = VisionEncoder.from_pretrained("tiny", device="cpu", dtype="float32", backend="cpu")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"head": 1}, "include_dashboard": False},
    )
    workers = [
        cluster.add_node(num_cpus=1, resources={"encoder_slot": 1, f"worker_{k}": 1})
        for k in range(2)
    ]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    out: dict = {"head": cluster.head_node.node_id, "workers": [w.node_id for w in workers]}
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
            dispatch={"cooldown_s": 1.0, "cost_model": "patches"},
        )
        board = Switchboard.options(resources={"head": 0.01}).remote()
        serve.run(bind_app(args, controlled_factory(board)), name=APP, route_prefix=f"/{APP}")
        url = f"http://127.0.0.1:{port}/{APP}"
        ranks = requests.get(f"{url}/v1/info", timeout=30).json()["ranks"]
        out["rank_nodes"] = [r["node_id"] for r in ranks]
        data = [image_bytes("RGB", (90 + 10 * i, 60 + 8 * i), 9000 + i) for i in range(4)]
        out["before"] = check(post(url, data), data, reference)

        victim = workers[out["workers"].index(out["rank_nodes"][1])]
        ray.get(board.set.remote(1, "hold"))
        with cf.ThreadPoolExecutor(1) as pool:  # a request in flight while the node goes
            during = pool.submit(post, url, data)
            ray.get(board.wait_held.remote(1), timeout=30)  # its share is held on rank 1
            removed_at = time.monotonic()
            cluster.remove_node(victim)
            out["during"] = check(during.result(timeout=90), data, reference)
        out["during_s"] = round(time.monotonic() - removed_at, 2)
        after = []
        for k in range(3):
            batch = [
                image_bytes("RGB", (70 + 6 * i, 50 + 4 * i), 9100 + 10 * k + i) for i in range(3)
            ]
            after.append(check(post(url, batch), batch, reference))
        out["after"] = after
        out["after_s"] = round(time.monotonic() - removed_at, 2)
        out["failover"] = requests.get(f"{url}/v1/info", timeout=30).json()["failover"]
    finally:
        print(json.dumps(out), flush=True)
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
