"""A 2-rank app in a Ray cluster of its own, with a fixed metrics port and JSON logs.

``test_observability.py`` runs this as a subprocess: the test session's shared
cluster has no fixed metrics export port, and one process can join only one
cluster. Usage: ``python observability_server.py METRICS_PORT HTTP_PORT``. Prints
one JSON line (url, metrics_url, session_dir) when the app is ready, then serves
until its stdin closes, and shuts down.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ray
from ray import serve

# tests/ for its helpers, and the checkout itself: tests/kimi_encoder (no __init__.py)
# would otherwise shadow the editable install as a namespace package.
sys.path.insert(0, str(Path(__file__).parents[2]))
sys.path.insert(0, str(Path(__file__).parents[1]))
from serve_helpers import app_args

from deployments.app import bind_app


def main() -> None:
    metrics_port, http_port = int(sys.argv[1]), int(sys.argv[2])
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=metrics_port,
    )
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    args = app_args(dp_size=2)
    serve.run(
        bind_app(args),
        name="obs",
        route_prefix="/obs",
        logging_config={"encoding": "JSON", "log_level": "INFO"},
    )
    session_dir = ray._private.worker._global_node.get_session_dir_path()
    ready = {
        "url": f"http://127.0.0.1:{http_port}/obs",
        "metrics_url": f"http://127.0.0.1:{metrics_port}/metrics",
        "session_dir": session_dir,
    }
    print(json.dumps(ready), flush=True)
    sys.stdin.read()  # until the test closes our stdin
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
