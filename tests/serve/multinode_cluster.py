"""A simulated multi-node Ray cluster serving the app; one worker node is removed.

``test_multinode.py`` runs this as a subprocess: ``ray.cluster_utils.Cluster``
starts its own head and raylets, and one process can join only one cluster
(the test session's shared one stays untouched). Usage:
``python multinode_cluster.py HTTP_PORT [fixed|elastic]``. Prints one JSON line of
findings.

Layout: a head node with the proxy, the Serve controller and the ingress
(custom resource ``head``), two worker nodes with one ``encoder_slot`` each,
and ranks asking for one ``encoder_slot`` (``ranks.actor_options.resources``),
so each node holds one rank. After a first request, the node holding rank 1 is
removed while a request's share waits there (its forward held by the test's
switchboard, ``controlled.py``); rank 1 has
no slot to come back to, and that request and later ones must be answered by
rank 0 alone.

``hub``: the checkpoint is ``hf://moonshotai/Kimi-K3`` on a hub on loopback (HF_ENDPOINT),
two worker nodes with an HF_HOME each (empty caches: fresh nodes) and ``dp_size: {min: 1,
max: 2}``. Rank 0 fetches on its node at start; the load starts rank 1 on the other node,
which fetches again (its node has no copy) and serves the checkpoint's features.

``elastic``: three worker nodes with one ``encoder_slot`` each and ``dp_size: {min: 1,
max: 2}``. Closed-loop clients start rank 1 (a small queue target); then the node
holding it is removed under that load. Its requests are re-dispatched, none is lost,
and Serve starts rank 1 again on the spare node: the set refills on what capacity
remains.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import sys
import tempfile
import threading
import time
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
from controlled import Switchboard, controlled_factory
from images import image_bytes
from serve_helpers import app_args, b64, decode_features

from benchmarks.loopback_hub import LoopbackHub, write_k3_layout
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
    port, mode = int(sys.argv[1]), (sys.argv[2:] or ["fixed"])[0]
    torch.set_num_threads(1)
    hub = None
    if mode == "hub":
        hub, checkpoint = loopback_hub()
        reference = VisionEncoder.from_pretrained(
            checkpoint, device="cpu", dtype="float32", backend="cpu"
        )
    else:
        reference = VisionEncoder.from_pretrained(
            "tiny", device="cpu", dtype="float32", backend="cpu"
        )
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"head": 1}, "include_dashboard": False},
    )
    workers = [
        cluster.add_node(
            num_cpus=1,
            resources={"encoder_slot": 1, f"worker_{k}": 1},
            # A node's own disk: the hub cache starts empty on each, as on a new machine.
            env_vars={"HF_HOME": tempfile.mkdtemp(prefix=f"node{k}-hf-")},
        )
        for k in range(3 if mode == "elastic" else 2)
    ]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    out: dict = {"head": cluster.head_node.node_id, "workers": [w.node_id for w in workers]}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        url = f"http://127.0.0.1:{port}/{APP}"
        if mode == "elastic":
            elastic(cluster, workers, url, reference, out)
        elif mode == "hub":
            from_the_hub(url, reference, hub, out)
        else:
            fixed(cluster, workers, url, reference, out)
    finally:
        print(json.dumps(out), flush=True)
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        if hub is not None:
            hub.__exit__()


def fixed(cluster: Cluster, workers: list, url: str, reference: VisionEncoder, out: dict) -> None:
    """dp 2, one rank per worker node; rank 1's node goes while a request waits on it."""
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
        batch = [image_bytes("RGB", (70 + 6 * i, 50 + 4 * i), 9100 + 10 * k + i) for i in range(3)]
        after.append(check(post(url, batch), batch, reference))
    out["after"] = after
    out["after_s"] = round(time.monotonic() - removed_at, 2)
    out["failover"] = requests.get(f"{url}/v1/info", timeout=30).json()["failover"]


def info(url: str) -> dict:
    return requests.get(f"{url}/v1/info", timeout=30).json()


def until(condition, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


class Clients:
    """Closed-loop clients of two of ``data``'s images each, every answer checked."""

    def __init__(self, url: str, data: list[bytes], reference: VisionEncoder, count: int):
        self.url, self.data = url, data
        self.want = [w.numpy() for w in reference.encode([reference.plan(b) for b in data])]
        self.stop = threading.Event()
        self.answers: list[dict] = []
        self.threads = [threading.Thread(target=self.client, args=(k,)) for k in range(count)]

    def __enter__(self) -> Clients:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(90)

    def client(self, k: int) -> None:
        while not self.stop.is_set():
            picked = [(k + j) % len(self.data) for j in range(2)]
            try:
                response = post(self.url, [self.data[i] for i in picked])
            except requests.RequestException as exc:
                self.answers.append({"status": None, "error": repr(exc)})
                continue
            answer = {"status": response.status_code}
            if response.status_code == 200:
                items = response.json()["items"]
                answer["owners"] = [i["owner_rank"] for i in items]
                answer["max_error"] = max(
                    float(np.abs(decode_features(item) - self.want[i]).max())
                    for item, i in zip(items, picked, strict=True)
                )
            self.answers.append(answer)

    def findings(self) -> dict:
        return {
            "answers": len(self.answers),
            "statuses": sorted({a["status"] for a in self.answers}, key=str),
            "max_error": max((a.get("max_error", 0.0) for a in self.answers), default=0.0),
            "owners": sorted({o for a in self.answers for o in a.get("owners", [])}),
        }


def elastic(cluster: Cluster, workers: list, url: str, reference: VisionEncoder, out: dict) -> None:
    """dp {1, 2} over three single-slot worker nodes: rank 1's node goes under load."""
    args = app_args(
        dp_size={"min": 1, "max": 2},
        ranks={
            "actor_options": {"num_cpus": 0, "resources": {"encoder_slot": 1}},
            "cache_bytes": 0,  # these nodes' object stores are small
        },
        ingress={"actor_options": {"resources": {"head": 0.01}}},
        dispatch={"cooldown_s": 1.0},
        scaling={"target_queue_s": 1e-4, "upscale_after_s": 0.5, "downscale_after_s": 3600},
    )
    serve.run(bind_app(args), name=APP, route_prefix=f"/{APP}")
    data = [image_bytes("RGB", (90 + 10 * i, 60 + 8 * i), 9000 + i) for i in range(4)]
    with Clients(url, data, reference, 4) as clients:
        out["grew"] = until(lambda: info(url)["ranks_live"] == [0, 1], 120)
        out["rank_nodes"] = [r["node_id"] for r in info(url)["ranks"]]
        victim = workers[out["workers"].index(out["rank_nodes"][1])]
        time.sleep(2)  # rank 1 under load
        removed_at = time.monotonic()
        cluster.remove_node(victim)

        def refilled() -> bool:
            now = info(url)
            return now["ranks_live"] == [0, 1] and now["ranks"][1]["node_id"] != victim.node_id

        out["refilled"] = until(refilled, 180)
        out["refilled_s"] = round(time.monotonic() - removed_at, 2)
        out["rank_nodes_after"] = [r.get("node_id") for r in info(url)["ranks"]]
        time.sleep(2)  # the new rank 1 under load
    out.update(clients.findings())
    out["failover"] = info(url)["failover"]


REPO = "moonshotai/Kimi-K3"


def loopback_hub() -> tuple[LoopbackHub, Path]:
    """A hub on loopback serving a K3-layout checkpoint; HF_ENDPOINT points at it for every
    node this process starts."""
    root = Path(tempfile.mkdtemp(prefix="k3-layout-"))
    write_k3_layout(root, "tiny", seed=11, shards=6, language_ratio=20)
    hub = LoopbackHub().__enter__()
    hub.add(REPO, root)
    os.environ["HF_ENDPOINT"] = hub.endpoint
    os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="head-hf-")  # the head's (ingress's)
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    return hub, root


def from_the_hub(url: str, reference: VisionEncoder, hub: LoopbackHub, out: dict) -> None:
    """dp {1, 2} of a hub checkpoint over two fresh worker nodes: the load adds rank 1 on
    the node that has no copy; it fetches and serves."""
    args = app_args(
        model={"checkpoint": f"hf://{REPO}"},
        dp_size={"min": 1, "max": 2},
        ranks={
            "actor_options": {"num_cpus": 0, "resources": {"encoder_slot": 1}},
            "cache_bytes": 0,
        },
        ingress={"actor_options": {"resources": {"head": 0.01}}},
        dispatch={"cooldown_s": 1.0},
        scaling={"target_queue_s": 1e-4, "upscale_after_s": 0.5, "downscale_after_s": 3600},
    )
    serve.run(bind_app(args), name=APP, route_prefix=f"/{APP}")
    out["first_weights"] = [r.get("weights") for r in info(url)["ranks"]]
    out["served_before"] = hub.body_bytes(".safetensors")
    data = [image_bytes("RGB", (90 + 10 * i, 60 + 8 * i), 9000 + i) for i in range(4)]
    with Clients(url, data, reference, 4) as clients:
        out["grew"] = until(lambda: info(url)["ranks_live"] == [0, 1], 120)
        time.sleep(1)  # rank 1 under load
    ranks = info(url)["ranks"]
    out["rank_nodes"] = [r.get("node_id") for r in ranks]
    out["weights"] = [r.get("weights") for r in ranks]
    out["served_after"] = hub.body_bytes(".safetensors")
    out.update(clients.findings())


if __name__ == "__main__":
    main()
