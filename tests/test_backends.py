"""The gpu backend (torch ops, here on CPU tensors) against the cpu backend (PIL).

Both must give identical grids and identical pixel values, in every PIL mode,
resized or not, under every background pattern and both fill stages.
"""

import dataclasses

import pytest
import torch
from images import MODES, image_bytes

from kimi_encoder.config import PreprocessConfig, get_preset
from kimi_encoder.items import plan_image
from kimi_encoder.preprocess import preprocess

TINY = get_preset("tiny").preprocess
SIZES = {"as-is": (90, 50), "downscaled": (900, 700), "odd": (333, 47), "1x1": (1, 1)}
BACKGROUNDS = {
    "chessboard": TINY.transparent_bg_config,
    "white": {"pattern": "white"},
    "gray": {"pattern": "gray"},
    "black": {"pattern": "black"},
    "none": None,
}


def _both(data: bytes, cfg: PreprocessConfig):
    out = {}
    for backend in ("cpu", "gpu"):
        item = plan_image(data, cfg, backend)
        pixels, grid = preprocess(item.image, item.deferred, 14, torch.device("cpu"))
        assert grid == item.grid
        out[backend] = pixels
    return out["cpu"], out["gpu"]


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("mode", MODES)
def test_gpu_equals_cpu_every_mode(mode, size):
    cpu, gpu = _both(image_bytes(mode, size, seed=5), TINY)
    assert cpu.shape == gpu.shape
    assert torch.equal(cpu, gpu), f"max diff {(cpu - gpu).abs().max().item()}"


@pytest.mark.parametrize("stage", ["after_resize", "before_resize"])
@pytest.mark.parametrize("bg", BACKGROUNDS.values(), ids=BACKGROUNDS.keys())
@pytest.mark.parametrize("mode", ["RGBA", "LA", "P+trns", "PA-palette", "L"])
def test_gpu_equals_cpu_backgrounds(mode, bg, stage):
    cfg = dataclasses.replace(TINY, transparent_bg_config=bg, transparent_bg_fill_stage=stage)
    cpu, gpu = _both(image_bytes(mode, (500, 300), seed=9), cfg)
    assert torch.equal(cpu, gpu), f"max diff {(cpu - gpu).abs().max().item()}"


def test_jpeg_and_webp_files():
    for fmt in ("JPEG", "WEBP"):
        cpu, gpu = _both(image_bytes("RGB", (640, 480), seed=2, fmt=fmt), TINY)
        assert torch.equal(cpu, gpu)


def test_padding_is_minus_one():
    cpu, _ = _both(image_bytes("RGB", (14, 14)), TINY)  # 14x14 pads to 28x28
    assert cpu.shape == (4, 3, 14, 14)
    assert torch.all(cpu[1:] == -1.0)  # all but the top-left patch are padding
    assert not torch.all(cpu[0] == -1.0)
