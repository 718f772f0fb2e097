"""The shipped configs (the KubeRay example too): schema, builder args and deployment
options, without starting them."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import yaml
from pydantic import ValidationError
from ray.serve._private.build_app import build_app as build_deployments  # names of a built app
from ray.serve.schema import ServeDeploySchema

from deployments.app import INGRESS_NAME, REGISTRY_NAME, build_app, rank_name
from deployments.args import GLIBC_TUNABLES, AppArgs

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def load(name: str) -> tuple[dict, AppArgs, dict]:
    """(application entry, validated args, {deployment name: its built deployment})."""
    config = yaml.safe_load((CONFIGS / name).read_text())
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "deployments.app:build_app"
    args = AppArgs.model_validate(app["args"])
    built = build_deployments(build_app(args), name=app["name"])
    return app, args, {d.name: d for d in built.deployments}


def assert_options_come_from_args(app: dict, args: AppArgs, built: dict) -> None:
    """Every rank has rank_actor_options and rank_options, the ingress its own, the
    hand-off registry is one replica without CPUs; the config lists no per-deployment
    entry (nothing to override)."""
    assert "deployments" not in app
    ranks = {rank_name(r) for r in range(args.dp_size)}
    assert set(built) == {INGRESS_NAME, REGISTRY_NAME, *ranks}
    registry = built.pop(REGISTRY_NAME)
    assert registry.num_replicas == 1
    assert registry.ray_actor_options["num_cpus"] == 0
    assert registry._deployment_config.max_ongoing_requests > args.handoff_max_pending
    for name, deployment in built.items():
        is_rank = name != INGRESS_NAME
        config = deployment._deployment_config
        actor = args.rank_actor_options if is_rank else args.ingress_actor_options
        options = args.rank_options if is_rank else args.ingress_options
        assert deployment.ray_actor_options == actor.model_dump() | args.replica_env(), name
        for field, value in options.model_dump().items():
            assert getattr(config, field) == value, (name, field)
    assert built[INGRESS_NAME].num_replicas == args.ingress_replicas


def test_k3_8gpu_config():
    app, args, built = load("k3-8gpu.yaml")
    assert (args.dp_size, args.device, args.dtype) == (8, "cuda", "bfloat16")
    assert args.default_backend == "gpu"
    assert args.rank_actor_options.num_gpus == 1
    assert not args.checkpoint.startswith(("tiny", "small"))
    assert "/" in args.checkpoint
    assert args.ingress_replicas >= 2
    assert_options_come_from_args(app, args, built)


def test_cpu_config_fits_two_cores():
    app, args, built = load("config.yaml")
    assert (args.checkpoint, args.dp_size, args.rank_device) == ("tiny", 2, "cpu")
    assert args.ingress_replicas >= 2
    assert_options_come_from_args(app, args, built)
    assert all(d.ray_actor_options["num_cpus"] == 0 for d in built.values())


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ({"preprocess_backend": "tpu"}, "Unsupported Kimi-K3 deferred preprocessing backend: tpu"),
        ({"dp_size": 0}, "dp_size"),
        ({"device": "cuda"}, "needs rank_actor_options.num_gpus >= 1"),
        ({"dtype": "int8"}, "dtype"),
        ({"num_ranks": 2}, "Extra inputs are not permitted"),
        ({"ingress_actor_options": {"num_gpus": 1}}, "ingress_actor_options.num_gpus must be 0"),
        ({"ec_root": "ec"}, "ec_root must be an absolute directory, got 'ec'"),
        (
            {"glibc_tunables": "hugetlb=1"},
            r"glibc_tunables must be ':'-separated glibc.<namespace>.<name>=<value> entries "
            r"\(GLIBC_TUNABLES syntax\), got 'hugetlb=1' \(bad: \['hugetlb=1'\]\)",
        ),
        ({"glibc_tunables": "glibc.malloc.hugetlb=1:"}, r"bad: \[''\]"),
        ({"image_urls": {"max_bytes": 0}}, "image_urls.max_bytes"),
        ({"rank_options": {"max_ongoing_requests": 0}}, "max_ongoing_requests"),
        (
            {"rank_options": {"max_ongoing_requests": 1, "max_queued_requests": 0}},
            "max_queued_requests must be -1 .* or at least 1, got 0",
        ),
        (
            {"feature_cache_bytes": 0, "ingress_cache_bytes": 1024},
            r"ingress_cache_bytes=1024 keeps references to the features the ranks' caches "
            r"hold, but feature_cache_bytes is 0 \(no rank cache\); set feature_cache_bytes > 0",
        ),
    ],
    ids=[
        "backend",
        "dp0",
        "cuda-no-gpu",
        "dtype",
        "extra",
        "ingress-gpu",
        "ec-root",
        "tunables",
        "tunables-empty-entry",
        "url-bytes",
        "ongoing",
        "queue",
        "ingress-cache-without-rank-cache",
    ],
)
def test_bad_args_fail_validation(args, fragment):
    with pytest.raises(ValidationError, match=fragment):
        AppArgs.model_validate(args)


@pytest.mark.parametrize("tunables", [None, "glibc.malloc.hugetlb=0:glibc.malloc.arena_max=2", ""])
def test_every_replica_gets_the_glibc_tunables_of_the_args(tunables):
    """The ingress, the hand-off registry and every rank run with ``glibc_tunables`` as
    their GLIBC_TUNABLES (large malloc blocks kept in the heaps by default); '' leaves
    their environment to the cluster's."""
    args = AppArgs(dp_size=2) if tunables is None else AppArgs(dp_size=2, glibc_tunables=tunables)
    built = build_deployments(build_app(args), name="app").deployments
    assert {d.name for d in built} == {INGRESS_NAME, REGISTRY_NAME, rank_name(0), rank_name(1)}
    for deployment in built:
        env = deployment.ray_actor_options.get("runtime_env", {}).get("env_vars", {})
        if tunables == "":
            assert "GLIBC_TUNABLES" not in env, deployment.name
        else:
            assert env["GLIBC_TUNABLES"] == (tunables or GLIBC_TUNABLES), deployment.name


def test_every_arg_is_documented():
    fields = AppArgs.model_fields
    for model in (
        AppArgs,
        fields["rank_actor_options"].annotation,
        fields["rank_options"].annotation,
        fields["image_urls"].annotation,
    ):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


# configs/kuberay-rayservice.yaml: the RayService's embedded Serve config is a valid deploy
# config whose args validate as AppArgs, and its cluster can hold what it asks for.
KUBERAY = CONFIGS / "kuberay-rayservice.yaml"


def load_kuberay() -> tuple[dict, dict]:
    service = yaml.safe_load(KUBERAY.read_text())
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])  # a string in KubeRay
    return service, serve_config


def test_kuberay_embedded_serve_config_builds_with_app_args():
    _, serve_config = load_kuberay()
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
    assert_options_come_from_args(app, args, {d.name: d for d in built.deployments})
    assert args.rank_options.max_queued_requests > 0  # bounded queue per rank
    assert serve_config["proxy_location"] == "EveryNode"  # a proxy on every pod


def test_kuberay_cluster_holds_every_rank_and_mounts_what_the_config_reads():
    service, serve_config = load_kuberay()
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
