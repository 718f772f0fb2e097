"""Checkpoint loading: vision shards only, strict key and shape checks."""

import json
import shutil

import pytest
import torch
from images import image_bytes
from safetensors.torch import load_file, save_file

from kimi_encoder.cli import main as cli_main
from kimi_encoder.config import get_preset, read_checkpoint_configs
from kimi_encoder.encoder import VisionEncoder
from kimi_encoder.weights import CheckpointError, read_vision_tensors


def _shard(src, dst):
    """Rewrite a single-file checkpoint as 3 shards plus a corrupt language-model shard."""
    shutil.copy(src / "config.json", dst / "config.json")
    shutil.copy(src / "preprocessor_config.json", dst / "preprocessor_config.json")
    tensors = load_file(str(src / "model.safetensors"))
    tower = {k: v for k, v in tensors.items() if k.startswith("vision_tower.encoder")}
    rest = {k: v for k, v in tensors.items() if k not in tower}
    save_file(tower, str(dst / "model-00001-of-00003.safetensors"))
    save_file(rest, str(dst / "model-00002-of-00003.safetensors"))
    (dst / "model-00003-of-00003.safetensors").write_bytes(b"\x00garbage, not safetensors")
    weight_map = {k: "model-00001-of-00003.safetensors" for k in tower}
    weight_map |= {k: "model-00002-of-00003.safetensors" for k in rest}
    weight_map |= {
        "language_model.model.embed_tokens.weight": "model-00003-of-00003.safetensors",
        "language_model.lm_head.weight": "model-00003-of-00003.safetensors",
    }
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return dst


def test_sharded_with_corrupt_language_shard(oracle_dir, oracle_encoder, tmp_path):
    root = _shard(oracle_dir / "checkpoint", tmp_path)
    encoder = VisionEncoder.from_pretrained(root, device="cpu", backend="cpu")
    item = encoder.plan(image_bytes("RGB", (120, 80)))
    torch.testing.assert_close(
        encoder.encode([item])[0], oracle_encoder.encode([item])[0], atol=0, rtol=0
    )


def test_vision_keys_only(oracle_dir):
    keys = read_vision_tensors(oracle_dir / "checkpoint").keys()
    assert all(k.startswith(("vision_tower.", "mm_projector.")) for k in keys)
    assert len(keys) == 18  # 2 blocks x 6 + final norm + patch embed 2 + projector 3


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda t: t.pop("mm_projector.post_norm.weight"), "missing keys: mm_projector.post_norm"),
        (
            lambda t: t.update({"vision_tower.extra.weight": torch.zeros(1)}),
            "unexpected keys: vision_tower.extra.weight",
        ),
        (
            lambda t: t.update({"vision_tower.encoder.blocks.0.wo.weight": torch.zeros(64, 64)}),
            r"mis-shaped keys: vision_tower.encoder.blocks.0.wo.weight: checkpoint \(64, 64\) "
            r"vs model \(64, 96\)",
        ),
    ],
    ids=["missing", "unexpected", "misshaped"],
)
def test_key_errors_name_the_keys(oracle_dir, tmp_path, edit, match):
    src = oracle_dir / "checkpoint"
    for name in ("config.json", "preprocessor_config.json"):
        shutil.copy(src / name, tmp_path / name)
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=match):
        VisionEncoder.from_pretrained(tmp_path, device="cpu")


def test_missing_weights_file(oracle_dir, tmp_path):
    shutil.copy(oracle_dir / "checkpoint" / "config.json", tmp_path / "config.json")
    shutil.copy(oracle_dir / "checkpoint" / "preprocessor_config.json", tmp_path)
    with pytest.raises(
        CheckpointError, match=r"No model\.safetensors\.index\.json or model\.safetensors"
    ):
        VisionEncoder.from_pretrained(tmp_path, device="cpu")


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"No config\.json in checkpoint directory"):
        VisionEncoder.from_pretrained(tmp_path, device="cpu")


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_make_checkpoint_roundtrip(tmp_path, preset):
    assert cli_main(["make-checkpoint", "--preset", preset, "--seed", "3", str(tmp_path)]) == 0
    vision, preprocess = read_checkpoint_configs(tmp_path)
    assert vision == get_preset(preset).vision
    assert preprocess == get_preset(preset).preprocess
    loaded = VisionEncoder.from_pretrained(tmp_path, device="cpu")
    built = VisionEncoder.from_pretrained(preset, device="cpu", seed=3)
    for (k, a), (_, b) in zip(
        loaded.model.state_dict().items(), built.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), k


def test_oracle_config_is_read_exactly(oracle_dir):
    vision, preprocess = read_checkpoint_configs(oracle_dir / "checkpoint")
    assert (vision.hidden_size, vision.qkv_hidden_size, vision.num_heads, vision.num_layers) == (
        64,
        96,
        4,
        2,
    )
    assert vision.text_hidden_size == 80
    assert vision.variant == "k3"
    assert preprocess.in_patch_limit == 1024
    assert preprocess.patch_limit_on_one_side == 64
    assert preprocess.transparent_bg_config["chessboard_gray_value"] == 180
