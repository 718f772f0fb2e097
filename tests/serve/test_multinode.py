"""Beyond one machine: a simulated two-node Ray cluster (``ray.cluster_utils.Cluster``).

Runs ``multinode_cluster.py`` in a subprocess with its own Ray cluster (the session's
shared cluster is not touched): ranks are placed one per worker node through a
custom resource, serve the in-process encoder's features, and the app keeps serving
on the surviving rank after the other worker node is removed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from serve_helpers import free_port

SCRIPT = Path(__file__).with_name("multinode_cluster.py")
ROOT = Path(__file__).resolve().parents[2]
SURVIVE_BOUND_S = 30  # node removed -> the request in flight and three more answered 200


def findings(mode: str) -> dict:
    """``multinode_cluster.py``'s findings in ``mode``, run in a subprocess."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(free_port()), mode],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result (rc {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    out = json.loads(lines[-1])
    print(f"\n{out}")
    return out


def test_two_node_cluster_places_ranks_on_both_and_survives_a_node_loss():
    out = findings("fixed")
    assert sorted(out["rank_nodes"]) == sorted(out["workers"]), out  # one rank per worker node
    assert out["before"]["status"] == 200, out
    assert out["before"]["max_error"] <= 1e-5, out
    assert set(out["before"]["owners"]) == {0, 1}, out
    for answer in [out["during"], *out["after"]]:
        assert answer["status"] == 200, out
        assert answer["max_error"] <= 1e-5, out
        assert set(answer["owners"]) == {0}, out  # only the surviving rank
    assert out["after_s"] < SURVIVE_BOUND_S, out


def test_elastic_ranks_lose_no_request_to_a_node_loss_and_refill_on_a_spare_node():
    """dp {min: 1, max: 2} on three single-slot worker nodes: the load starts rank 1, its
    node is removed under that load, Serve starts rank 1 again on the spare node. Every
    request is answered 200 with the reference's features (re-dispatched, none lost)."""
    out = findings("elastic")
    assert out["grew"], out
    assert out["rank_nodes"][0] != out["rank_nodes"][1], out  # one rank per node
    assert out["refilled"], out
    assert out["rank_nodes_after"][1] not in (out["rank_nodes"][1], out["rank_nodes"][0]), out
    assert out["statuses"] == [200], out
    assert out["max_error"] <= 1e-5, out
    assert out["owners"] == [0, 1], out


def test_a_rank_added_on_a_fresh_node_fetches_the_hub_checkpoint_and_serves():
    """dp {min: 1, max: 2} of ``hf://moonshotai/Kimi-K3`` on a hub on loopback, two worker
    nodes with empty caches: rank 0 fetches on its node; the load starts rank 1 on the
    other, which fetches its own copy and serves the checkpoint's features."""
    out = findings("hub")
    first = out["first_weights"][0]
    assert first["cached"] is False, out  # rank 0 fetched on its fresh node
    assert out["served_before"] == first["bytes_read"], out
    assert out["grew"], out
    assert out["rank_nodes"][0] != out["rank_nodes"][1], out
    added = out["weights"][1]
    assert added["cached"] is False, out  # its node had no copy: it read the hub
    assert added["commit"] == first["commit"], out
    assert out["served_after"] == first["bytes_read"] + added["bytes_read"], out
    assert out["statuses"] == [200], out
    assert out["max_error"] <= 1e-5, out
    assert out["owners"] == [0, 1], out
