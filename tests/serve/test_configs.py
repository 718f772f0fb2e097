"""The shipped configs: schema, builder args and deployment names, without starting them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve._private.build_app import build_app as build_deployments  # names of a built app
from ray.serve.schema import ServeDeploySchema

from deployments.app import INGRESS_NAME, build_app, rank_name
from deployments.args import AppArgs

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def load(name: str) -> tuple[dict, AppArgs, list[str]]:
    """(application entry, validated args, deployment names of the built app)."""
    config = yaml.safe_load((CONFIGS / name).read_text())
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    assert app["import_path"] == "deployments.app:build_app"
    args = AppArgs.model_validate(app["args"])
    built = build_deployments(build_app(args), name=app["name"])
    return app, args, [d.name for d in built.deployments]


def test_k3_8gpu_config():
    app, args, names = load("k3-8gpu.yaml")
    assert (args.dp_size, args.device, args.dtype) == (8, "cuda", "bfloat16")
    assert args.default_backend == "gpu" and args.rank_actor_options.num_gpus == 1
    assert not args.checkpoint.startswith(("tiny", "small")) and "/" in args.checkpoint
    assert sorted(names) == sorted([INGRESS_NAME] + [rank_name(r) for r in range(8)])
    entries = {d["name"]: d for d in app["deployments"]}
    assert set(entries) == set(names)  # every override names a real deployment, and all have one
    for r in range(8):
        assert entries[rank_name(r)]["ray_actor_options"]["num_gpus"] == 1


def test_cpu_config_fits_two_cores():
    app, args, names = load("config.yaml")
    assert (args.checkpoint, args.dp_size, args.rank_device) == ("tiny", 2, "cpu")
    assert set(d["name"] for d in app["deployments"]) <= set(names)
    assert all(d["ray_actor_options"]["num_cpus"] <= 0.5 for d in app["deployments"])


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ({"preprocess_backend": "tpu"}, "Unsupported Kimi-K3 deferred preprocessing backend: tpu"),
        ({"dp_size": 0}, "dp_size"),
        ({"device": "cuda"}, "needs rank_actor_options.num_gpus >= 1"),
        ({"dtype": "int8"}, "dtype"),
        ({"num_ranks": 2}, "Extra inputs are not permitted"),
    ],
    ids=["backend", "dp0", "cuda-no-gpu", "dtype", "extra"],
)
def test_bad_args_fail_validation(args, fragment):
    with pytest.raises(ValidationError, match=fragment):
        AppArgs.model_validate(args)


def test_every_arg_is_documented():
    for model in (AppArgs, AppArgs.model_fields["rank_actor_options"].annotation):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
