"""Checkpoint loading (vision weights only) and seeded random checkpoints.

Loading is a pure function: checkpoint tensors in, model state dict out.
Our module names equal the original checkpoint's key names, so the key map
is the identity on the ``vision_tower.`` and ``mm_projector.`` prefixes.
Only the shards holding those tensors are opened; the language model is
never read.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import PREPROCESSOR_FILE, PRESETS, PreprocessConfig, VisionConfig
from .features import dtype_name
from .model import KimiVisionModel

VISION_PREFIXES = ("vision_tower.", "mm_projector.")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# What a rank's start takes besides its execution's build and its checkpoint's read: its
# process and imports, the CUDA context, calibration, the health probe, a preset's random
# weights. Each takes seconds; this leaves room.
START_FLOOR_S = 60.0
# A conservative read of a checkpoint's vision weights: network storage or a cold page
# cache, not a local NVMe drive.
READ_BYTES_PER_S = 100e6
# A conservative fetch of a hub checkpoint's vision ranges: one stream per range from the
# hub's storage, not a saturated link.
HUB_BYTES_PER_S = 50e6


class CheckpointError(ValueError):
    pass


def vision_shards(root: Path) -> dict[str, list[str]]:
    """{shard file: [vision keys in it]} from the index, or the single file's keys."""
    index = root / INDEX_FILE
    if index.is_file():
        return index_vision_shards(json.loads(index.read_text()), str(index))
    single = root / SINGLE_FILE
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            names = f.keys()  # a list: the file handle itself cannot be iterated
        return {SINGLE_FILE: [k for k in names if k.startswith(VISION_PREFIXES)]}
    raise CheckpointError(
        f"No {INDEX_FILE} or {SINGLE_FILE} in {str(root)!r}; expected an original-format "
        "Kimi checkpoint (safetensors)."
    )


def index_vision_shards(index: dict, where: str) -> dict[str, list[str]]:
    """{shard file: [vision keys in it]} of a parsed ``model.safetensors.index.json``."""
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{where} has no 'weight_map' object.")
    shards: dict[str, list[str]] = {}
    for key, shard in weight_map.items():
        if key.startswith(VISION_PREFIXES):
            shards.setdefault(shard, []).append(key)
    return shards


def vision_weight_bytes(root: str | Path) -> int:
    """Bytes of the vision tensors a rank reads from the checkpoint at ``root``, from its
    safetensors headers alone."""
    root, total = Path(root), 0
    for shard, keys in vision_shards(root).items():
        with (root / shard).open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for key in keys:
            start, end = header[key]["data_offsets"]
            total += end - start
    return total


def start_allowance_s(checkpoint: str) -> tuple[float, str]:
    """Seconds a rank may take to start and load ``checkpoint``, its execution's build
    aside, and how they were priced: ``START_FLOOR_S``, plus its vision weights read at
    ``READ_BYTES_PER_S``, plus for a hub checkpoint not fetched on this machine their fetch
    at ``HUB_BYTES_PER_S``. Weights whose size cannot be read here (a directory not mounted
    on the node that checks the config, a hub checkpoint not fetched yet) are priced as the
    largest preset's vision weights in float32."""
    if checkpoint in PRESETS:
        return START_FLOOR_S, f"a preset: {START_FLOOR_S:g} s"
    root: str | Path | None = checkpoint
    if checkpoint.startswith("hf://"):
        from .hub import cached_path  # the hub client only where one is named

        root = cached_path(checkpoint)
    size, what = None, "its vision weights"
    if root is not None:
        try:
            size = vision_weight_bytes(root)
        except (OSError, ValueError, KeyError):
            size = None
    if size is None:
        size = max(_float32_bytes(preset.vision) for preset in PRESETS.values())
        what = "not readable here, priced as the largest preset's vision weights in float32"
    seconds = START_FLOOR_S + size / READ_BYTES_PER_S
    rate = f"{READ_BYTES_PER_S / 1e6:g} MB/s"
    priced = f"{START_FLOOR_S:g} s + {size / 1e6:.0f} MB ({what}) at {rate}"
    if root is None:  # a hub checkpoint this machine has not fetched: a new node's start
        seconds += size / HUB_BYTES_PER_S
        priced += f" + their fetch from the hub at {HUB_BYTES_PER_S / 1e6:g} MB/s"
    return seconds, priced


def _float32_bytes(cfg: VisionConfig) -> int:
    with torch.device("meta"):
        return 4 * sum(p.numel() for p in KimiVisionModel(cfg).parameters())


def read_vision_tensors(root: str | Path) -> dict[str, torch.Tensor]:
    """Every ``vision_tower.*`` / ``mm_projector.*`` tensor, reading only their shards."""
    root = Path(root)
    tensors: dict[str, torch.Tensor] = {}
    for shard, keys in sorted(vision_shards(root).items()):
        path = root / shard
        if not path.is_file():
            raise CheckpointError(
                f"Shard {shard!r} listed for vision weights is missing in {root}."
            )
        with safe_open(path, framework="pt") as f:
            for key in keys:
                tensors[key] = f.get_tensor(key)
    if not tensors:
        raise CheckpointError(
            f"No vision_tower.* or mm_projector.* tensors in {str(root)!r}; is this a Kimi "
            "vision-language checkpoint?"
        )
    return tensors


def convert_state_dict(
    checkpoint: dict[str, torch.Tensor], expected: dict[str, torch.Size]
) -> dict[str, torch.Tensor]:
    """Check key sets and shapes and return the model state dict.

    Every missing, unexpected or mis-shaped key is named in the error.
    """
    missing = sorted(set(expected) - set(checkpoint))
    unexpected = sorted(set(checkpoint) - set(expected))
    misshaped = sorted(
        f"{k}: checkpoint {tuple(checkpoint[k].shape)} vs model {tuple(expected[k])}"
        for k in set(expected) & set(checkpoint)
        if tuple(checkpoint[k].shape) != tuple(expected[k])
    )
    problems = []
    if missing:
        problems.append("missing keys: " + ", ".join(missing))
    if unexpected:
        problems.append("unexpected keys: " + ", ".join(unexpected))
    if misshaped:
        problems.append("mis-shaped keys: " + "; ".join(misshaped))
    if problems:
        raise CheckpointError(
            "Checkpoint does not match the vision config in config.json ("
            + " | ".join(problems)
            + "). Check that config.json belongs to these weights."
        )
    return {k: checkpoint[k] for k in expected}


def load_model(
    root: str | Path, cfg: VisionConfig, device: torch.device, dtype: torch.dtype
) -> KimiVisionModel:
    model = _empty_model(cfg, device, dtype)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    state = convert_state_dict(read_vision_tensors(root), expected)
    return _fill(model, state.items())


def random_model(cfg: VisionConfig, seed: int, device, dtype: torch.dtype) -> KimiVisionModel:
    """A model with seeded random weights (deterministic on any machine: drawn on CPU).

    Tensors are drawn one at a time and copied into a model allocated in
    ``dtype``, so peak memory stays near the model's own size.
    """
    return _fill(_empty_model(cfg, device, dtype), _random_tensors(cfg, seed))


def random_state_dict(cfg: VisionConfig, seed: int) -> dict[str, torch.Tensor]:
    return dict(_random_tensors(cfg, seed))


def _random_tensors(cfg: VisionConfig, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in KimiVisionModel(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    for key, shape in shapes.items():
        if "norm" in key and key.endswith(".weight"):
            yield key, 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif key.endswith(".bias"):
            yield key, 0.02 * torch.randn(shape, generator=gen)
        elif key.endswith("pos_emb.weight"):
            yield key, 0.1 * torch.randn(shape, generator=gen)
        else:
            fan_in = max(1, int(torch.tensor(shape[1:]).prod()) if len(shape) > 1 else 1)
            yield key, torch.randn(shape, generator=gen) / fan_in**0.5


def _empty_model(cfg: VisionConfig, device, dtype: torch.dtype) -> KimiVisionModel:
    with torch.device("meta"):
        model = KimiVisionModel(cfg).to(dtype)
    return model.to_empty(device=device)


@torch.no_grad()
def _fill(model: KimiVisionModel, tensors) -> KimiVisionModel:
    """Copy (key, tensor) pairs into the allocated model (casting), then rebuild buffers."""
    params = model.state_dict()
    seen = set()
    for key, tensor in tensors:
        params[key].copy_(tensor)
        seen.add(key)
    assert seen == set(params), sorted(set(params) ^ seen)
    model.vision_tower.patch_embed.pos_emb.reset_buffers()  # not in the checkpoint
    return model.eval()


def write_checkpoint(
    out_dir: str | Path, vision: VisionConfig, preprocess: PreprocessConfig, seed: int = 0
) -> Path:
    """Write a seeded random original-format checkpoint: config.json,
    preprocessor_config.json and model.safetensors (float32, checkpoint key names)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in random_state_dict(vision, seed).items()}
    model_type = "kimi_k3" if vision.variant == "k3" else "kimi_k25"
    config = {
        "architectures": [
            "KimiK3ForConditionalGeneration"
            if vision.variant == "k3"
            else "KimiK25ForConditionalGeneration"
        ],
        "model_type": model_type,
        "dtype": dtype_name(next(iter(tensors.values())).dtype),
        "text_config": {"hidden_size": vision.text_hidden_size},
        "vision_config": vision.to_checkpoint_config(),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    media = preprocess.to_media_proc_cfg()
    (out / PREPROCESSOR_FILE).write_text(json.dumps({"media_proc_cfg": media}, indent=2) + "\n")
    save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt", "seed": str(seed)})
    return out
