"""The gpu backend (torch ops, here on CPU tensors) against the cpu backend (PIL).

Both must give identical grids and identical pixel values, in every PIL mode,
resized or not, under every background pattern and both fill stages. Modes the
torch port does not cover (YCbCr, LAB, I;16B, ...) must still agree: the gpu
backend hands them to PIL. The CUDA tests repeat the comparison on a GPU.
"""

import dataclasses

import numpy as np
import pytest
import torch
from images import MEMORY_MODES, MODES, RARE_FILE_MODES, image_bytes, make_image

from kimi_encoder import pil_ops
from kimi_encoder.config import PreprocessConfig, get_preset
from kimi_encoder.items import plan_image
from kimi_encoder.preprocess import portable, preprocess

TINY = get_preset("tiny").preprocess
SIZES = {"as-is": (90, 50), "downscaled": (900, 700), "odd": (333, 47), "1x1": (1, 1)}
BACKGROUNDS = {
    "chessboard": TINY.transparent_bg_config,
    "white": {"pattern": "white"},
    "gray": {"pattern": "gray"},
    "black": {"pattern": "black"},
    "none": None,
}


def _both(data: bytes, cfg: PreprocessConfig, device: str = "cpu", image=None):
    """Pixels of the cpu and gpu backends; ``image`` (a PIL image of the same size as
    ``data``) replaces the decoded file, for modes no file format stores."""
    out = {}
    for backend in ("cpu", "gpu"):
        item = plan_image(data, cfg, backend)
        source = item.image if image is None else image
        pixels, grid = preprocess(source, item.deferred, 14, torch.device(device))
        assert grid == item.grid
        assert pixels.device.type == device
        out[backend] = pixels.cpu()
    return out["cpu"], out["gpu"]


@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("mode", MODES + RARE_FILE_MODES)
def test_gpu_equals_cpu_every_mode(mode, size):
    cpu, gpu = _both(image_bytes(mode, size, seed=5), TINY)
    assert cpu.shape == gpu.shape
    assert torch.equal(cpu, gpu), f"max diff {(cpu - gpu).abs().max().item()}"


@pytest.mark.parametrize("stage", ["after_resize", "before_resize"])
@pytest.mark.parametrize("size", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("mode", [m for m in MEMORY_MODES if m != "La"])
def test_gpu_equals_cpu_in_memory_modes(mode, size, stage):
    cfg = dataclasses.replace(TINY, transparent_bg_fill_stage=stage)
    image = make_image(mode, size, seed=5)
    cpu, gpu = _both(image_bytes("RGB", size), cfg, image=image)
    assert torch.equal(cpu, gpu), f"max diff {(cpu - gpu).abs().max().item()}"


def test_la_fails_alike_in_both_backends():
    """Pillow has no La -> RGB conversion; the gpu backend reports PIL's error too."""
    image = make_image("La", (90, 50))
    for backend in ("cpu", "gpu"):
        item = plan_image(image_bytes("RGB", (90, 50)), TINY, backend)
        with pytest.raises(ValueError, match="conversion from La to L not supported"):
            preprocess(image, item.deferred, 14, torch.device("cpu"))


@pytest.mark.parametrize(("mode", "ported"), [("I;16L", "I;16"), ("RGBX", "RGB")])
def test_portable_relabels_exact_modes(mode, ported):
    image = make_image(mode, (30, 20), seed=3)
    out = portable(image)
    assert out.mode == ported
    assert np.array_equal(np.asarray(out), np.asarray(image)[..., :3] if mode == "RGBX" else image)


@pytest.mark.parametrize("mode", ["I;16B", "I;16N", "YCbCr", "LAB", "HSV", "RGBa"])
def test_portable_leaves_other_modes_to_pil(mode):
    image = make_image(mode, (30, 20), seed=3)
    assert portable(image) is image
    with pytest.raises(ValueError, match=f"Unsupported image mode: {mode}; the torch port"):
        pil_ops.raw_from_pil(image)


@pytest.mark.parametrize("stage", ["after_resize", "before_resize"])
@pytest.mark.parametrize("bg", BACKGROUNDS.values(), ids=BACKGROUNDS.keys())
@pytest.mark.parametrize("mode", ["RGBA", "LA", "P-trns-index", "P-trns-bytes", "L"])
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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", MODES + RARE_FILE_MODES)
def test_cuda_gpu_backend_equals_cpu_backend(mode):
    for size in SIZES.values():
        cpu, gpu = _both(image_bytes(mode, size, seed=5), TINY, device="cuda")
        assert torch.equal(cpu, gpu), f"{size}: max diff {(cpu - gpu).abs().max().item()}"


def test_normalization_table_is_built_once_per_key():
    from kimi_encoder.preprocess import _device_table, normalization_table

    _device_table.cache_clear()
    for _ in range(3):
        _both(image_bytes("RGB", (90, 50)), TINY)
    info = _device_table.cache_info()
    assert info.misses == 1
    assert info.hits == 5
    table = _device_table(TINY.image_mean, TINY.image_std, torch.device("cpu"))
    assert torch.equal(
        table, torch.from_numpy(normalization_table(TINY.image_mean, TINY.image_std))
    )
