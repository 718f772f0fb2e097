"""The tower's numerical promises at Kimi-K3's full size on CUDA, each with a CPU twin on the
tiny preset where one means something: bfloat16 stays near float32, an image's features do
not depend on the batch it is in, one varlen attention call per layer equals per-image SDPA
through the whole tower (CUDA only: varlen needs a GPU), and the gpu preprocessing backend
equals the cpu one under K3's limits in every image mode. benchmarks/gpu_check.py runs the
CUDA ones (``pytest -m cuda``) on the GPU machine; float32 CUDA against CPU is
tests/kimi_encoder/test_encoder.py's ``test_cuda_float32_matches_cpu``.

The weights are seeded random ones drawn on the device itself (seconds for the full tower
on a GPU): what is checked is the arithmetic, not a checkpoint.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from images import MEMORY_MODES, MODES, RARE_FILE_MODES, image_bytes, make_image

from benchmarks.device import device_random_model, seeded_pixels
from kimi_encoder import model as model_lib
from kimi_encoder.config import PreprocessConfig, get_preset
from kimi_encoder.items import plan_image
from kimi_encoder.preprocess import preprocess

CUDA = torch.cuda.is_available()
on_cuda = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", marks=on_cuda, id="cuda")]
# (preset, image grids) per device: K3 at full size on a GPU, the tiny tower on CPU.
CASES = {
    "cpu": ("tiny", [(1, 2, 2), (1, 4, 6), (1, 8, 8)]),
    "cuda": ("k3", [(1, 8, 8), (1, 16, 24), (1, 32, 32)]),
}


@functools.cache
def float32_tower(device: str):
    """(float32 model, pixels, grids) of ``device``'s case, built once per session."""
    preset, grids = CASES[device]
    cfg = get_preset(preset).vision
    net = device_random_model(cfg, seed=0, device=device, dtype=torch.float32)
    return net, seeded_pixels(grids, cfg.patch_size, device), grids


@functools.cache
def bfloat16_tower(device: str):
    net, pixels, grids = float32_tower(device)
    return copy.deepcopy(net).to(torch.bfloat16), pixels.bfloat16(), grids


def per_image(net, pixels, grids) -> list[torch.Tensor]:
    """Each image's features (float64 on the host) from one forward over the batch."""
    with torch.inference_mode():
        features = net(pixels, grids)
    kh, kw = net.cfg.merge_kernel_size
    counts = [(h // kh) * (w // kw) for _, h, w in grids]
    return [f.double().cpu() for f in features.split(counts)]


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_stays_near_float32(device):
    """Each image's bfloat16 features point where its float32 ones do (cosine >= 0.99)."""
    net, pixels, grids = float32_tower(device)
    low, low_pixels, _ = bfloat16_tower(device)
    want = per_image(net, pixels, grids)
    got = per_image(low, low_pixels, grids)
    cosines = [cosine(g, w) for g, w in zip(got, want, strict=True)]
    assert min(cosines) >= 0.99, cosines


@pytest.mark.parametrize("device", DEVICES)
def test_an_image_is_encoded_alike_alone_and_in_a_batch(device):
    """The middle image alone and inside the batch, bfloat16: within 1e-2 relative L2 (the
    matmuls may pick other kernels for another row count; attention never mixes images)."""
    low, pixels, grids = bfloat16_tower(device)
    index = len(grids) // 2
    rows = [t * h * w for t, h, w in grids]
    start = sum(rows[:index])
    (alone,) = per_image(low, pixels[start : start + rows[index]], [grids[index]])
    batched = per_image(low, pixels, grids)[index]
    assert rel_l2(batched, alone) <= 1e-2


def varlen_runs_here() -> bool:
    if not CUDA:
        return False
    kernel = model_lib.Segments.of([(1, 2, 2)], torch.device("cuda"), torch.bfloat16, "auto")
    return kernel.kernel == "varlen"


@pytest.mark.cuda
@pytest.mark.skipif(not varlen_runs_here(), reason="needs varlen_attn on a GPU that runs it")
def test_cuda_varlen_matches_per_image_sdpa_through_the_tower():
    """One varlen call per layer against one SDPA call per image, K3's full tower in
    bfloat16: the kernels' roundings compound over 27 layers (relative L2 <= 2e-2,
    cosine >= 0.999)."""
    low, pixels, grids = bfloat16_tower("cuda")
    tower = low.vision_tower
    try:
        tower.attention_kernel = "varlen"
        varlen = torch.cat(per_image(low, pixels, grids))
        tower.attention_kernel = "sdpa"
        sdpa = torch.cat(per_image(low, pixels, grids))
    finally:
        tower.attention_kernel = "auto"
    assert rel_l2(varlen, sdpa) <= 2e-2
    assert cosine(varlen, sdpa) >= 0.999


# The sizes of the backend comparison: as-is, odd, 1x1; on a GPU also two large ones.
BACKEND_SIZES = {
    "cpu": [(90, 50), (333, 47), (1, 1)],
    "cuda": [(90, 50), (900, 700), (333, 47), (1, 1), (1203, 901)],
}


def backend_pixels(data: bytes, device: str, image=None) -> dict[str, torch.Tensor]:
    """Pixels of each backend under K3's limits (``image``: decoded in memory instead)."""
    out = {}
    for backend in ("cpu", "gpu"):
        item = plan_image(data, PreprocessConfig(), backend)
        source = item.image if image is None else image
        pixels, grid = preprocess(source, item.deferred, 14, torch.device(device))
        assert grid == item.grid
        out[backend] = pixels.cpu()
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES + RARE_FILE_MODES)
def test_backends_agree_under_k3_limits(device, mode):
    for size in BACKEND_SIZES[device]:
        pixels = backend_pixels(image_bytes(mode, size, seed=5), device)
        diff = (pixels["cpu"] - pixels["gpu"]).abs().max().item()
        assert torch.equal(pixels["cpu"], pixels["gpu"]), f"{size}: max diff {diff}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", [m for m in MEMORY_MODES if m != "La"])  # La: PIL cannot
def test_backends_agree_under_k3_limits_on_images_in_memory(device, mode):
    for size in BACKEND_SIZES[device]:
        rgb = image_bytes("RGB", size)
        pixels = backend_pixels(rgb, device, image=make_image(mode, size, seed=5))
        assert torch.equal(pixels["cpu"], pixels["gpu"]), size
