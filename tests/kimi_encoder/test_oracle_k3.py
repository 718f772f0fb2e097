"""K3 parity with sglang's Kimi-K3 code on the oracle data (tests/data/oracle-k3)."""

import pytest
import torch
from safetensors.torch import load_file

from kimi_encoder.encoder import VisionEncoder

IMAGES = ["0_odd_100x37.png", "1_large_900x700.jpg", "2_rgba_alpha_600x500.png"]


@pytest.fixture(scope="module")
def expected(oracle_dir):
    return load_file(str(oracle_dir / "expected.safetensors"))


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
@pytest.mark.parametrize("index", range(len(IMAGES)), ids=IMAGES)
def test_matches_sglang(oracle_dir, expected, index, backend):
    encoder = VisionEncoder.from_pretrained(
        oracle_dir / "checkpoint", device="cpu", dtype="float32", backend=backend
    )
    item = encoder.plan((oracle_dir / "images" / IMAGES[index]).read_bytes())
    assert item.grid_thws.tolist() == expected[f"grid_thw.{index}"].tolist()
    pixels = encoder.materialize([item])[0]
    ref_pixels = expected[f"pixel_values.{index}"]
    assert pixels.shape == ref_pixels.shape
    torch.testing.assert_close(pixels, ref_pixels, atol=1e-6, rtol=0)
    features = encoder.encode([item])[0]
    torch.testing.assert_close(features, expected[f"features.{index}"], atol=1e-4, rtol=0)


def test_batched_matches_sglang(oracle_encoder, oracle_dir, expected):
    """All three images in one varlen batch still match the per-image references."""
    items = [oracle_encoder.plan((oracle_dir / "images" / n).read_bytes()) for n in IMAGES]
    for i, features in enumerate(oracle_encoder.encode(items)):
        torch.testing.assert_close(features, expected[f"features.{i}"], atol=1e-4, rtol=0)
