"""The shipped configs (the KubeRay example too): schema, builder args and deployment
options, without starting them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import ray
import yaml
from pydantic import BaseModel, ValidationError
from ray.serve._private.build_app import build_app as build_deployments  # names of a built app
from ray.serve.schema import ServeDeploySchema

from deployments.app import INGRESS_NAME, REGISTRY_NAME, SCALER_NAME, build_app, rank_name
from deployments.args import GLIBC_TUNABLES, MOVED, AppArgs

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
    """Every rank has ranks.actor_options and ranks.serve_options, the ingress its own,
    the hand-off registry is one replica without CPUs, and so is the scaler of elastic
    ranks (none with a fixed dp_size); the config lists no per-deployment entry (nothing
    to override)."""
    assert "deployments" not in app
    ranks = {rank_name(r) for r in range(args.dp_max)}
    scaler = {SCALER_NAME} if args.elastic else set()
    assert set(built) == {INGRESS_NAME, REGISTRY_NAME, *ranks, *scaler}
    registry = built.pop(REGISTRY_NAME)
    assert registry.num_replicas == 1
    assert registry.ray_actor_options["num_cpus"] == 0
    assert registry._deployment_config.max_ongoing_requests > args.handoff.max_pending
    if args.elastic:
        one = built.pop(SCALER_NAME)
        assert one.num_replicas == 1
        assert one.ray_actor_options["num_cpus"] == 0
        assert one._deployment_config.max_ongoing_requests >= 2 * args.ingress.replicas
    for name, deployment in built.items():
        is_rank = name != INGRESS_NAME
        config = deployment._deployment_config
        section = args.ranks if is_rank else args.ingress
        actor, options = section.actor_options, section.serve_options
        assert deployment.ray_actor_options == actor.model_dump() | args.replica_env(), name
        for field, value in options.model_dump().items():
            assert getattr(config, field) == value, (name, field)
    assert built[INGRESS_NAME].num_replicas == args.ingress.replicas
    for rank in range(args.dp_max):  # elastic ranks scale between 0 and 1 replicas
        autoscaling = built[rank_name(rank)]._deployment_config.autoscaling_config
        if rank < args.dp_min:
            assert autoscaling is None, rank
            assert built[rank_name(rank)].num_replicas == 1, rank
        else:
            assert (autoscaling.min_replicas, autoscaling.max_replicas) == (0, 1), rank
            assert autoscaling.initial_replicas == 0, rank
            assert autoscaling.downscale_to_zero_delay_s == args.scaling.park_after_s, rank


def test_k3_8gpu_config():
    app, args, built = load("k3-8gpu.yaml")
    assert (args.dp_size, args.model.device, args.model.dtype) == (8, "cuda", "bfloat16")
    assert args.model.execution == "auto"  # measured by each rank at start (docs/gpu.md)
    config = args.model.execution_config(args.ranks.batching.max_batch_patches)
    assert config.graph_buckets[-1] == args.ranks.batching.max_batch_patches
    assert args.model_as_run.preprocess_backend == "gpu"
    assert args.ranks.actor_options.num_gpus == 1
    assert not args.model.checkpoint.startswith(("tiny", "small"))
    assert "/" in args.model.checkpoint
    assert args.ingress.replicas >= 2
    assert_options_come_from_args(app, args, built)


def test_elastic_ranks_are_built_autoscaled_between_0_and_1():
    """dp_size {min: 1, max: 3}: rank 0 always runs, ranks 1 and 2 scale between 0 and 1
    replicas (starting at 0) and park after scaling.park_after_s; every other option as
    with fixed ranks."""
    args = AppArgs(dp_size={"min": 1, "max": 3}, scaling={"park_after_s": 42})
    built = {d.name: d for d in build_deployments(build_app(args), name="elastic").deployments}
    assert (args.dp_min, args.dp_max, args.elastic) == (1, 3, True)
    assert args.ranks_as_run.calibration_grids  # the queue is counted in fitted seconds
    assert_options_come_from_args({}, args, built)


def test_cpu_config_fits_two_cores():
    app, args, built = load("config.yaml")
    assert (args.model.checkpoint, args.dp_size, args.model_as_run.device) == ("tiny", 2, "cpu")
    assert args.ingress.replicas >= 2
    assert_options_come_from_args(app, args, built)
    assert all(d.ray_actor_options["num_cpus"] == 0 for d in built.values())


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (
            {"model": {"preprocess_backend": "tpu"}},
            "Unsupported Kimi-K3 deferred preprocessing backend: tpu",
        ),
        ({"dp_size": 0}, "dp_size"),
        (
            {"model": {"device": "cuda"}},
            r"model.device 'cuda' needs ranks.actor_options.num_gpus >= 1 \(got 0\); set "
            r"ranks: {actor_options: {num_gpus: 1}} or model: {device: cpu}",
        ),
        (
            {"model": {"dtype": "int8"}},
            r"model.dtype\n  Input should be 'auto', 'float32', 'bfloat16' or 'float16'",
        ),
        ({"num_ranks": 2}, "Extra inputs are not permitted"),
        ({"ranks": {"num_ranks": 2}}, r"ranks.num_ranks\n  Extra inputs are not permitted"),
        (
            {"ingress": {"actor_options": {"num_gpus": 1}}},
            r"ingress.actor_options.num_gpus must be 0 \(got 1.0\): the ingress never touches a "
            "GPU; give GPUs to ranks.actor_options",
        ),
        ({"handoff": {"ec_root": "ec"}}, "ec_root must be an absolute directory, got 'ec'"),
        (
            {"glibc_tunables": "hugetlb=1"},
            r"glibc_tunables must be ':'-separated glibc.<namespace>.<name>=<value> entries "
            r"\(GLIBC_TUNABLES syntax\), got 'hugetlb=1' \(bad: \['hugetlb=1'\]\)",
        ),
        ({"glibc_tunables": "glibc.malloc.hugetlb=1:"}, r"bad: \[''\]"),
        ({"handoff": {"image_urls": {"max_bytes": 0}}}, "handoff.image_urls.max_bytes"),
        (
            {"ranks": {"serve_options": {"max_ongoing_requests": 0}}},
            "ranks.serve_options.max_ongoing_requests",
        ),
        (
            {"ranks": {"serve_options": {"max_ongoing_requests": 1, "max_queued_requests": 0}}},
            "max_queued_requests must be -1 .* or at least 1, got 0",
        ),
        (
            {"ranks": {"cache_bytes": 0}, "ingress": {"cache_bytes": 1024}},
            r"ingress.cache_bytes=1024 keeps the features the ranks' caches hold, but "
            r"ranks.cache_bytes is 0 \(no rank cache\); set ranks.cache_bytes > 0",
        ),
        (
            {"ranks": {"cache_entries": 0}},
            r"ranks.cache_entries\n  Input should be greater than or equal to 1",
        ),
        (
            {"ingress": {"cache_entries": -1}},
            r"ingress.cache_entries\n  Input should be greater than or equal to 1",
        ),
        (
            {"ranks": {"calibration_grids": [8, 9]}},
            r"calibration_grids must be even sides >= 2 \(the 2x2 patch merge\), got \[9\]",
        ),
        (
            {"ranks": {"batching": {"max_batch_patches": 0}}},
            r"ranks.batching.max_batch_patches\n  Input should be greater than or equal to 1",
        ),
        (
            {"dp_size": {"min": 3, "max": 1}},
            r"dp_size {'min': 3, 'max': 1} is not a valid range \(max \(1\) must be at least "
            r"min \(3\), e.g. {min: 3, max: 6}\); write {min: M, max: N} with 1 <= M <= N",
        ),
        ({"dp_size": {"min": 0, "max": 2}}, r"min: Input should be greater than or equal to 1"),
        ({"dp_size": {"max": 2}}, r"dp_size {'max': 2} is not a valid range \(min: Field required"),
        (
            {"dp_size": 2.5},
            r"dp_size must be an int >= 1 \(ranks always running, one per GPU\) or {min: M, "
            r"max: N} \(elastic ranks\), got 2.5",
        ),
        ({"scaling": {"target_queue_s": 0}}, r"scaling.target_queue_s\n  Input should be greater"),
        (
            {"ranks": {"batching": {"decode": "forks"}}},
            r"ranks.batching.decode\n  Input should be 'threads' or 'processes' "
            r"\[type=literal_error, input_value='forks'",
        ),
        (
            {"model": {"execution": "fast"}},
            r"model.execution\n  Value error, Unknown execution 'fast'; allowed: eager, "
            r"compiled, graphs, auto",
        ),
        (
            {"model": {"execution": "graphs"}},
            r"model.execution 'graphs' captures CUDA graphs, but the ranks run on 'cpu'; set "
            r"model: {device: cuda} with ranks: {actor_options: {num_gpus: 1}}, or "
            r"model.execution 'compiled', 'eager' or 'auto'",
        ),
        (
            {"model": {"graph_buckets": [1024, 2]}},
            r"graph_buckets must be patch counts of at least 4 \(one 2x2 image\), got \[1024, 2\]",
        ),
        (
            {"model": {"graph_max_images": 0}},
            r"model.graph_max_images\n  Input should be greater than or equal to 1",
        ),
    ],
    ids=[
        "backend",
        "dp0",
        "cuda-no-gpu",
        "dtype",
        "extra",
        "extra-in-a-section",
        "ingress-gpu",
        "ec-root",
        "tunables",
        "tunables-empty-entry",
        "url-bytes",
        "ongoing",
        "queue",
        "ingress-cache-without-rank-cache",
        "rank-cache-entries",
        "ingress-cache-entries",
        "odd-grid",
        "batch-budget",
        "dp-range-reversed",
        "dp-range-min-0",
        "dp-range-no-min",
        "dp-float",
        "queue-target",
        "decode",
        "execution",
        "graphs-on-cpu",
        "graph-bucket",
        "graph-images",
    ],
)
def test_bad_args_fail_validation(args, fragment):
    with pytest.raises(ValidationError, match=fragment):
        AppArgs.model_validate(args)


@pytest.mark.parametrize(
    ("flat", "written"),
    [
        ({"max_batch_patches": 4096}, "ranks: {batching: {max_batch_patches: ...}}"),
        ({"checkpoint": "tiny"}, "model: {checkpoint: ...}"),
        ({"rank_options": {}}, "ranks: {serve_options: ...}"),
        ({"feature_cache_bytes": 0}, "ranks: {cache_bytes: ...}"),
        ({"ingress_replicas": 2}, "ingress: {replicas: ...}"),
        ({"max_request_bytes": 1}, "ingress: {limits: {max_request_bytes: ...}}"),
        ({"body_grace_s": 1}, "ingress: {body_pace: {grace_s: ...}}"),
        ({"rank_cooldown_s": 1}, "dispatch: {cooldown_s: ...}"),
        ({"handoff_wait_s": 1}, "handoff: {wait_s: ...}"),
    ],
    ids=lambda value: next(iter(value)) if isinstance(value, dict) else None,
)
def test_a_flat_key_of_earlier_releases_fails_naming_its_new_place(flat, written):
    (key,) = flat
    with pytest.raises(ValidationError, match=re.escape(f"`{key}` moved: write it as `{written}`")):
        AppArgs.model_validate({"dp_size": 2, **flat})


def test_every_flat_key_of_earlier_releases_has_a_place():
    """Each moved key names a field that exists, and the message names them all."""
    for key, path in MOVED.items():
        model: type[BaseModel] = AppArgs
        *sections, leaf = path.split(".")
        for section in sections:
            model = model.model_fields[section].annotation
        assert leaf in model.model_fields, (key, path)
    with pytest.raises(ValidationError) as refused:
        AppArgs.model_validate({"dtype": "float32", "api_key_file": "/k"})
    message = str(refused.value)
    assert "`dtype` moved: write it as `model: {dtype: ...}`." in message
    assert "`api_key_file` moved: write it as `ingress: {api_key_file: ...}`." in message
    assert "see docs/api.md, Configuration" in message


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


def sections(model: type[BaseModel]) -> list[type[BaseModel]]:
    """``model`` and every model nested in it, each once."""
    out = [model]
    for field in model.model_fields.values():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            out += [m for m in sections(field.annotation) if m not in out]
    return out


def test_every_arg_is_documented():
    models = sections(AppArgs)
    assert {"ModelArgs", "RankArgs", "BatchingArgs", "ServeOptions", "ActorOptions"} <= {
        m.__name__ for m in models
    }
    for model in models:
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def doc_args(doc: str) -> list[dict]:
    """The ``args:`` blocks of a doc's YAML examples."""
    text = (CONFIGS.parent / doc).read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    return [yaml.safe_load(block)["args"] for block in blocks if block.startswith("args:")]


@pytest.mark.parametrize("doc", ["README.md", "docs/api.md", "docs/epd.md"])
def test_the_args_the_docs_show_validate(doc):
    (args,) = doc_args(doc)
    AppArgs.model_validate(args)


def test_the_readme_shows_the_defaults():
    (args,) = doc_args("README.md")
    assert AppArgs.model_validate(args) == AppArgs()
    assert set(args) == set(AppArgs.model_fields)  # every section


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
    model = args.model_as_run
    assert (model.device, model.preprocess_backend, args.ranks.actor_options.num_gpus) == (
        "cuda",
        "gpu",
        1,
    )
    assert (
        args.ingress.request_timeout_s < serve_config["http_options"]["request_timeout_s"]
    )  # 504, not 408
    assert args.ingress.api_key_file is not None  # bound to 0.0.0.0: a key is required
    built = build_deployments(build_app(args), name=app["name"])
    assert_options_come_from_args(app, args, {d.name: d for d in built.deployments})
    assert args.ranks.serve_options.max_queued_requests > 0  # bounded queue per rank
    assert serve_config["proxy_location"] == "EveryNode"  # a proxy on every pod


def test_kuberay_cluster_holds_the_elastic_range_and_mounts_what_the_config_reads():
    service, serve_config = load_kuberay()
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__
    (app,) = serve_config["applications"]
    args = AppArgs.model_validate(app["args"])
    per_rank = args.ranks.actor_options.num_gpus
    (group,) = cluster["workerGroupSpecs"]
    pod_gpus = int(group["rayStartParams"]["num-gpus"])
    assert args.elastic
    assert cluster["enableInTreeAutoscaling"]
    assert group["minReplicas"] * pod_gpus == args.dp_min * per_rank  # the ranks always up
    assert group["maxReplicas"] * pod_gpus >= args.dp_max * per_rank  # room for every rank
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    for pod in pods:
        (container,) = pod["template"]["spec"]["containers"]
        mounted = [m["mountPath"] for m in container["volumeMounts"]]
        assert any(args.model.checkpoint.startswith(m + "/") for m in mounted), mounted
        assert any(args.ingress.api_key_file.startswith(m + "/") for m in mounted), mounted
    images = {pod["template"]["spec"]["containers"][0]["image"] for pod in pods}
    assert len(images) == 1  # head and workers run the same code
