"""Settings checked across sections of ``AppArgs`` (deployments/args/), without Ray: an
elastic GPU rank's start timeout against what its start needs."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from pydantic import ValidationError

from deployments.args import AppArgs
from kimi_encoder.config import get_preset
from kimi_encoder.weights import (
    READ_BYTES_PER_S,
    START_FLOOR_S,
    start_allowance_s,
    vision_weight_bytes,
    write_checkpoint,
)

ELASTIC_GPU = {"dp_size": {"min": 1, "max": 2}, "ranks": {"actor_options": {"num_gpus": 1}}}


def fake_checkpoint(root, vision_bytes: int):
    """A checkpoint directory whose one safetensors header lists ``vision_bytes`` of vision
    weights (and a language-model tensor); only headers are read, so no data is written."""
    root.mkdir()
    header = {
        "vision_tower.patch_embed.proj.weight": {
            "dtype": "BF16",
            "shape": [vision_bytes // 2],
            "data_offsets": [0, vision_bytes],
        },
        "language_model.embed.weight": {
            "dtype": "BF16",
            "shape": [8],
            "data_offsets": [vision_bytes, vision_bytes + 16],
        },
    }
    data = json.dumps(header).encode()
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": dict.fromkeys(header, "shard-1.safetensors")})
    )
    (root / "shard-1.safetensors").write_bytes(struct.pack("<Q", len(data)) + data)
    return root


def test_vision_weight_bytes_reads_the_headers(tmp_path):
    tiny = write_checkpoint(
        tmp_path / "tiny", get_preset("tiny").vision, get_preset("tiny").preprocess
    )
    with torch.device("meta"):
        from kimi_encoder.model import KimiVisionModel

        params = sum(p.numel() for p in KimiVisionModel(get_preset("tiny").vision).parameters())
    assert vision_weight_bytes(tiny) == 4 * params  # float32
    assert vision_weight_bytes(fake_checkpoint(tmp_path / "big", 3 * 10**9)) == 3 * 10**9


@pytest.mark.parametrize(
    ("update", "match"),
    [
        (  # the defaults: auto's 120 s and a preset's start do not fit 120 s
            {},
            r"scaling\.start_timeout_s=120 is shorter than an elastic GPU rank's start: "
            r"model\.auto_budget_s=120 s \(model\.execution 'auto' builds at start\) \+ 60 s "
            r"to start and load model\.checkpoint 'tiny' \(a preset: 60 s\) = 180 s\. Set "
            r"scaling: \{start_timeout_s: 180\} or more, or a smaller model\.auto_budget_s\.",
        ),
        (
            {
                "model": {"execution": "compiled", "auto_budget_s": 300},
                "scaling": {"start_timeout_s": 300},
            },
            r"start_timeout_s=300 .* model\.auto_budget_s=300 s \(model\.execution 'compiled' "
            r"builds at start\) .* = 360 s",
        ),
        (
            {"model": {"execution": "eager"}, "scaling": {"start_timeout_s": 30}},
            r"start_timeout_s=30 .*: model\.execution 'eager' \(nothing built at start\) \+ 60 s"
            r" .* = 60 s\. Set scaling: \{start_timeout_s: 60\} or more\. ",
        ),
        (  # a directory not readable here: the largest preset's weights in float32
            {"model": {"checkpoint": "/nonexistent/Kimi-K3"}, "scaling": {"start_timeout_s": 180}},
            r"\+ 79 s to start and load model\.checkpoint '/nonexistent/Kimi-K3' \(60 s \+ 1885 "
            r"MB \(not readable here, priced as the largest preset's vision weights in float32\)"
            r" at 100 MB/s\) = 199 s",
        ),
        (  # a hub checkpoint not fetched here: the read and the fetch at 50 MB/s
            {
                "model": {
                    "checkpoint": "hf://moonshotai/Kimi-K3@0123456789abcdef0123456789abcdef01234567"
                },
                "scaling": {"start_timeout_s": 180},
            },
            r"\+ 117 s to start and load model\.checkpoint 'hf://moonshotai/Kimi-K3@0123.*' "
            r"\(60 s \+ 1885 MB \(not readable here, .*\) at 100 MB/s \+ their fetch from the "
            r"hub at 50 MB/s\) = 237 s",
        ),
    ],
    ids=["defaults", "compiled", "eager", "unreadable-directory", "hub-not-fetched"],
)
def test_a_start_timeout_shorter_than_the_start_is_refused(update, match):
    with pytest.raises(ValueError, match=match):
        AppArgs(**{**ELASTIC_GPU, **update})


@pytest.mark.parametrize(
    ("name", "match"),
    [
        (
            "hf://just-a-name",
            r"Hub checkpoint 'hf://just-a-name' is malformed; write hf://OWNER/NAME",
        ),
        ("hf://moonshotai/Kimi-K3@", r"is malformed; .*\(a branch, tag or 40-character commit\)"),
    ],
    ids=["no-owner", "empty-revision"],
)
def test_a_malformed_hub_checkpoint_is_refused(name, match):
    with pytest.raises(ValidationError, match=match):
        AppArgs(model={"checkpoint": name})


def test_a_checkpoint_directory_is_priced_by_its_vision_bytes(tmp_path):
    root = fake_checkpoint(tmp_path / "k3", 2 * 10**9)  # 20 s at 100 MB/s
    seconds, priced = start_allowance_s(str(root))
    assert seconds == START_FLOOR_S + 2e9 / READ_BYTES_PER_S == 80.0
    assert priced == "60 s + 2000 MB (its vision weights) at 100 MB/s"
    model = {"checkpoint": str(root)}
    with pytest.raises(ValueError, match=r"\+ 80 s to start and load .* = 200 s\. Set"):
        AppArgs(**ELASTIC_GPU, model=model, scaling={"start_timeout_s": 199})
    AppArgs(**ELASTIC_GPU, model=model, scaling={"start_timeout_s": 200})


@pytest.mark.parametrize(
    "args",
    [
        {},  # the default config: fixed, CPU
        {"dp_size": {"min": 1, "max": 3}},  # elastic on CPU: nothing compiles
        {"dp_size": 8, "ranks": {"actor_options": {"num_gpus": 1}}},  # fixed ranks never wake
        {**ELASTIC_GPU, "scaling": {"start_timeout_s": 180}},
        {**ELASTIC_GPU, "model": {"auto_budget_s": 60}},  # 60 + 60 fits 120
        {**ELASTIC_GPU, "model": {"device": "cpu"}},  # GPUs, but the ranks run on CPU
    ],
    ids=["default", "elastic-cpu", "fixed-gpu", "enough", "smaller-budget", "cpu-device"],
)
def test_a_start_timeout_that_covers_the_start_passes(args):
    AppArgs(**args)


def test_report_ages_must_be_ordered():
    with pytest.raises(ValidationError, match=r"scaling.report_stale_s \(2\) must be more than "):
        AppArgs.model_validate({"scaling": {"report_fresh_s": 2, "report_stale_s": 2}})
