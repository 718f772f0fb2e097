"""configs/kuberay-rayservice.yaml: the RayService's embedded Serve config is a valid
deploy config whose args validate as AppArgs, and its cluster can hold what it asks for."""

from __future__ import annotations

from pathlib import Path

import ray
import yaml
from ray.serve._private.build_app import build_app as build_deployments
from ray.serve.schema import ServeDeploySchema

from deployments.app import INGRESS_NAME, build_app, rank_name
from deployments.args import AppArgs

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "kuberay-rayservice.yaml"


def load() -> tuple[dict, dict]:
    service = yaml.safe_load(CONFIG.read_text())
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])  # a string in KubeRay
    return service, serve_config


def test_embedded_serve_config_builds_with_app_args():
    _, serve_config = load()
    ServeDeploySchema.model_validate(serve_config)
    (app,) = serve_config["applications"]
    assert app["import_path"] == "deployments.app:build_app"
    args = AppArgs.model_validate(app["args"])
    assert (args.device, args.default_backend, args.rank_actor_options.num_gpus) == (
        "cuda",
        "gpu",
        1,
    )
    assert (
        args.request_timeout_s < serve_config["http_options"]["request_timeout_s"]
    )  # 504, not 408
    assert args.api_key_file is not None  # bound to 0.0.0.0: a key is required
    built = build_deployments(build_app(args), name=app["name"])
    names = {d.name for d in built.deployments}
    assert names == {INGRESS_NAME, *(rank_name(r) for r in range(args.dp_size))}
    entries = {d["name"]: d for d in app["deployments"]}
    assert set(entries) == names  # every override names a real deployment, and all have one
    for r in range(args.dp_size):
        entry = entries[rank_name(r)]
        assert entry["ray_actor_options"]["num_gpus"] == args.rank_actor_options.num_gpus
        assert entry["max_queued_requests"] > 0  # bounded queue per rank
    assert entries[INGRESS_NAME]["backpressure_config"]["retry_after_s"] > 0


def test_cluster_holds_every_rank_and_mounts_what_the_config_reads():
    service, serve_config = load()
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__
    (app,) = serve_config["applications"]
    args = AppArgs.model_validate(app["args"])
    gpus = sum(
        group["replicas"] * int(group["rayStartParams"]["num-gpus"])
        for group in cluster["workerGroupSpecs"]
    )
    assert gpus >= args.dp_size * args.rank_actor_options.num_gpus
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    for pod in pods:
        (container,) = pod["template"]["spec"]["containers"]
        mounted = [m["mountPath"] for m in container["volumeMounts"]]
        assert any(args.checkpoint.startswith(m + "/") for m in mounted), mounted
        assert any(args.api_key_file.startswith(m + "/") for m in mounted), mounted
    images = {pod["template"]["spec"]["containers"][0]["image"] for pod in pods}
    assert len(images) == 1  # head and workers run the same code
