"""VisionEncoder: batching is invisible, dtypes, and the owner-side checks."""

import dataclasses

import pytest
import torch
from images import image_bytes
from safetensors.torch import load_file

from kimi_encoder.cli import main
from kimi_encoder.encoder import VisionEncoder, exact_float32, resolve_dtype
from kimi_encoder.items import EncoderItem

SIZES = [(100, 37), (900, 700), (1, 1), (28, 280), (333, 111), (64, 64)]
MODES = ["RGB", "RGBA", "L", "P", "CMYK", "LA"]


@pytest.fixture(scope="module")
def encoder(tiny_checkpoint):
    return VisionEncoder.from_pretrained(tiny_checkpoint, device="cpu", backend="cpu")


def _items(encoder):
    return [
        encoder.plan(image_bytes(mode, size, seed=i))
        for i, (mode, size) in enumerate(zip(MODES, SIZES, strict=True))
    ]


@pytest.mark.parametrize("mode", ["eager", "compiled", "padded"])  # conftest.encoder_in
def test_batching_is_invisible(encoder_in, tiny_checkpoint, mode):
    encoder = encoder_in(tiny_checkpoint, mode)
    items = _items(encoder)
    batched = encoder.encode(items)
    for item, features in zip(items, batched, strict=True):
        (single,) = encoder.encode([item])
        assert features.shape == single.shape == (encoder.vision.num_tokens(item.grid), 80)
        torch.testing.assert_close(features, single, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_close_to_float32(tiny_checkpoint, encoder, dtype):
    low = VisionEncoder.from_pretrained(tiny_checkpoint, device="cpu", dtype=dtype, backend="cpu")
    items = _items(encoder)[:3]
    for ref, got in zip(encoder.encode(items), low.encode(items), strict=True):
        assert got.dtype == getattr(torch, dtype)
        # RMSNorm eps follows the dtype; outputs are post-RMSNorm so O(1) in magnitude.
        assert (got.float() - ref).abs().max() < 0.15


def test_refuses_aggregated_item(encoder):
    item = EncoderItem(torch.tensor([[1, 2, 2], [1, 2, 2]]), pixel_values=torch.zeros(8, 3, 14, 14))
    with pytest.raises(ValueError, match="one vision grid per MultimodalDataItem; split"):
        encoder.encode([item])


@pytest.mark.parametrize(("backend", "word"), [("cpu", "CPU"), ("gpu", "GPU")])
def test_wrong_grids_detected(encoder, backend, word):
    item = encoder.plan(image_bytes("RGB", (100, 37)), backend=backend)
    bad = dataclasses.replace(item, grid_thws=torch.tensor([[1, 2, 16]]))
    with pytest.raises(
        ValueError, match=f"Kimi-K3 deferred {word} preprocessing produced wrong grids"
    ):
        encoder.encode([bad])


def test_pixel_rows_must_match_grid(encoder):
    item = EncoderItem(torch.tensor([[1, 2, 4]]), pixel_values=torch.zeros(7, 3, 14, 14))
    with pytest.raises(
        ValueError, match="Kimi-K3 deferred feature length does not match image grids"
    ):
        encoder.encode([item])


def test_unknown_backend_at_dispatch(encoder):
    item = encoder.plan(image_bytes("RGB", (30, 30)))
    object.__setattr__(item.deferred, "backend", "tpu")  # a record corrupted after admission
    with pytest.raises(ValueError, match="Unsupported Kimi-K3 deferred preprocessing backend: tpu"):
        encoder.encode([item])


def test_unknown_backend_at_load(tiny_checkpoint):
    with pytest.raises(ValueError, match="Unsupported Kimi-K3 deferred preprocessing backend: npu"):
        VisionEncoder.from_pretrained(tiny_checkpoint, device="cpu", backend="npu")


def test_preprocessed_item_equals_raw(encoder):
    raw = encoder.plan(image_bytes("RGBA", (200, 90)))
    pixels = encoder.materialize([raw])[0]
    pre = EncoderItem(raw.grid_thws.clone(), pixel_values=pixels)
    torch.testing.assert_close(encoder.encode([pre])[0], encoder.encode([raw])[0], atol=0, rtol=0)


def test_empty_call(encoder):
    assert encoder.encode([]) == []


def test_unknown_preset_names_valid_ones():
    with pytest.raises(ValueError, match="valid presets: tiny, small, k3, k25"):
        VisionEncoder.from_pretrained("huge", device="cpu")


def test_unknown_dtype():
    with pytest.raises(
        ValueError, match=r"Unsupported dtype 'float64'; allowed: float32, bfloat16, float16, auto"
    ):
        VisionEncoder.from_pretrained("tiny", device="cpu", dtype="float64")


@pytest.mark.parametrize(
    ("dtype", "device", "expected"),
    [
        ("auto", "cpu", torch.float32),
        ("auto", "cuda", torch.bfloat16),
        ("auto", None, torch.float32),
        ("float16", "cuda", torch.float16),
        ("float32", "cuda", torch.float32),
        (torch.bfloat16, "cpu", torch.bfloat16),
    ],
)
def test_resolve_dtype(dtype, device, expected):
    dev = None if device is None else torch.device(device)  # a device object, never allocated on
    assert resolve_dtype(dtype, dev) == expected


def test_auto_dtype_on_cpu_is_float32():
    enc = VisionEncoder.from_pretrained("tiny", device="cpu", dtype="auto")
    assert enc.dtype == torch.float32
    assert VisionEncoder.from_pretrained("tiny", device="cpu").dtype == torch.float32  # default


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_dtype_on_cuda_is_bfloat16():
    enc = VisionEncoder.from_pretrained("tiny", device="cuda", execution="eager")
    assert enc.dtype == torch.bfloat16
    assert enc.device.type == "cuda"
    (features,) = enc.encode([enc.plan(image_bytes("RGB", (100, 37)))])
    assert features.dtype == torch.bfloat16
    assert torch.isfinite(features.float()).all()


def test_patch_embedding_is_the_convolution(encoder):
    """The patch embedding runs as one matmul (no cuDNN, so no TF32 on CUDA); it computes
    the checkpoint's patch-sized, patch-strided convolution."""
    embed = encoder.model.vision_tower.patch_embed
    p = encoder.vision.patch_size
    pixels = torch.randn(37, 3, p, p, generator=torch.Generator().manual_seed(0))
    grids = [(1, 37, 1)]
    with torch.inference_mode():
        ours = embed(pixels, embed.pos_emb(grids))
        conv = torch.nn.functional.conv2d(pixels, embed.proj.weight, embed.proj.bias, stride=p)
        want = conv.flatten(1) + embed.pos_emb(grids)
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=0)


@pytest.fixture
def matmul_precision():
    """The process's float32 matmul setting, restored after the test (new API only:
    reading the legacy ``allow_tf32`` after a new-API write raises)."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    yield matmul
    matmul.fp32_precision = saved


@pytest.mark.parametrize(
    ("device", "dtype", "after"),
    [
        ("cuda", torch.float32, "ieee"),  # float32 on CUDA: float32, whatever was set
        ("cuda", torch.bfloat16, "tf32"),  # low precision keeps the process's fast paths
        ("cuda", torch.float16, "tf32"),
        ("cpu", torch.float32, "tf32"),  # no CUDA matmul: nothing to change
    ],
    ids=["cuda-fp32", "cuda-bf16", "cuda-fp16", "cpu-fp32"],
)
def test_float32_on_cuda_means_float32(matmul_precision, device, dtype, after):
    matmul_precision.fp32_precision = "tf32"  # as torch.set_float32_matmul_precision("high")
    exact_float32(torch.device(device), dtype)
    assert matmul_precision.fp32_precision == after


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("through", ["library", "cli"])
def test_cuda_float32_matches_cpu(oracle_dir, oracle_encoder, matmul_precision, tmp_path, through):
    """float32 on CUDA within 1e-4 of the CPU features, with the process asking for TF32
    matmuls (and cuDNN's TF32 default) beforehand: the encoder turns it back to float32."""
    matmul_precision.fp32_precision = "tf32"
    paths = sorted((oracle_dir / "images").iterdir())
    want = oracle_encoder.encode([oracle_encoder.plan(p.read_bytes()) for p in paths])
    if through == "library":
        cuda = VisionEncoder.from_pretrained(
            oracle_dir / "checkpoint",
            device="cuda",
            dtype="float32",
            backend="cpu",
            execution="eager",
        )
        got = cuda.encode([cuda.plan(p.read_bytes()) for p in paths])
    else:
        out = tmp_path / "cuda.safetensors"
        args = ["encode", "--checkpoint", str(oracle_dir / "checkpoint"), "--backend", "cpu"]
        args += ["--device", "cuda", "--dtype", "float32", "--out", str(out), *map(str, paths)]
        assert main(args) == 0
        saved = load_file(str(out))
        got = [saved[f"features.{i}"] for i in range(len(paths))]
    for ours, cpu in zip(got, want, strict=True):
        assert ours.dtype == torch.float32
        assert (ours.cpu() - cpu).abs().max().item() <= 1e-4
