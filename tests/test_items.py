"""Admission: resize math, grids from headers, modality gate, splitting, backends."""

import pytest
import torch
from images import image_bytes

from kimi_encoder.config import PreprocessConfig, get_preset
from kimi_encoder.items import (
    DeferredPreprocessing,
    EncoderInputError,
    EncoderItem,
    LimitExceededError,
    Modality,
    check_grid_rows,
    check_modality,
    navit_resize,
    plan_image,
    read_image_size,
    resolve_backend,
    split_item,
    split_pixel_values,
)

K3 = PreprocessConfig()
TINY = get_preset("tiny").preprocess


@pytest.mark.parametrize(
    "size, cfg, grid, tokens",
    [
        ((1920, 1080), K3, (1, 78, 138), 2691),
        ((1, 1), K3, (1, 2, 2), 1),  # a 1x1 image is mostly padding
        ((100, 37), TINY, (1, 4, 8), 8),
        ((900, 700), TINY, (1, 30, 38), 285),
        ((600, 500), TINY, (1, 30, 36), 270),
        ((7168, 10), K3, (1, 2, 512), 256),  # side limit
        ((20000, 20000), K3, (1, 258, 258), 16641),  # patch limit, then padding
        ((14, 5000), TINY, (1, 64, 2), 32),
    ],
    ids=["1080p", "1x1", "oracle0", "oracle1", "oracle2", "wide", "huge", "tall"],
)
def test_navit_resize(size, cfg, grid, tokens):
    rc = navit_resize(*size, cfg)
    assert rc.grid_thw(cfg.patch_size) == grid
    assert rc.num_tokens == tokens
    assert rc.new_width <= size[0] and rc.new_height <= size[1]  # only ever downscales
    assert (rc.new_width + rc.pad_width) % 28 == 0 and (rc.new_height + rc.pad_height) % 28 == 0


def test_padding_can_exceed_patch_limit():
    """The limit is checked before padding, so padding may go slightly over it."""
    rc = navit_resize(1000, 1000, TINY)
    t, h, w = rc.grid_thw(14)
    assert (rc.new_width // 14) * (rc.new_height // 14) <= TINY.in_patch_limit < h * w


def test_fixed_output_tokens_null_and_set():
    assert navit_resize(100, 100, PreprocessConfig(fixed_output_tokens=None)).num_tokens == 16
    assert navit_resize(100, 100, PreprocessConfig(fixed_output_tokens=7)).num_tokens == 7


def test_plan_reads_header_only():
    data = image_bytes("RGB", (300, 200))
    truncated = data[: len(data) // 2]  # header intact, pixels missing: admission still works
    item = plan_image(truncated, TINY, "cpu")
    assert item.original_size == (300, 200)
    assert item.grid_thws.tolist() == [[1, 16, 22]]
    assert item.deferred.backend == "cpu"


@pytest.mark.parametrize("modality", ["video", "audio", Modality.VIDEO, "text"])
def test_non_image_modality_rejected(modality):
    with pytest.raises(EncoderInputError, match="Kimi-K3 encoder mode supports image input only"):
        check_modality(modality, 3)


def test_image_modality_accepted():
    assert check_modality("image") is Modality.IMAGE


def test_split_aggregated_pixel_values():
    grids = torch.tensor([[1, 2, 4], [1, 4, 4], [1, 2, 2]])
    pixels = torch.randn(8 + 16 + 4, 3, 14, 14)
    items = split_pixel_values(pixels, grids)
    assert [it.grid_thws.tolist() for it in items] == [[[1, 2, 4]], [[1, 4, 4]], [[1, 2, 2]]]
    assert torch.equal(torch.cat([it.pixel_values for it in items]), pixels)
    assert all(it.grid_thws.shape == (1, 3) for it in items)


def test_split_row_count_mismatch():
    grids = torch.tensor([[1, 2, 4], [1, 2, 2]])
    with pytest.raises(EncoderInputError, match="Kimi-K3 deferred feature length does not match"):
        split_pixel_values(torch.randn(13, 3, 14, 14), grids, index=0)


def test_split_item_refuses_raw_item_with_many_grids():
    item = EncoderItem(torch.tensor([[1, 2, 2], [1, 2, 2]]), image=b"x")
    with pytest.raises(EncoderInputError, match="one vision grid per MultimodalDataItem"):
        split_item(item)


@pytest.mark.parametrize(
    "grids, match",
    [
        ([[2, 4, 4]], "t=2"),
        ([[1, 3, 4]], "multiples"),
        ([1, 2, 3], "rows"),
        ([[1.0, 2, 2]], "integers"),
    ],
    ids=["video-t", "odd-h", "flat", "float"],
)
def test_bad_grid_rows(grids, match):
    with pytest.raises(EncoderInputError, match=match):
        check_grid_rows(grids, 14, 2)


def test_backend_validated_at_config_and_dispatch():
    with pytest.raises(ValueError, match="Unsupported Kimi-K3 deferred preprocessing backend: tpu"):
        resolve_backend("tpu")
    with pytest.raises(
        ValueError, match="Unsupported Kimi-K3 deferred preprocessing backend: auto"
    ):
        DeferredPreprocessing("auto", (0.5,) * 3, (0.5,) * 3, None, navit_resize(28, 28, K3))
    assert resolve_backend("auto", "cpu") == "cpu"
    assert resolve_backend("auto", "cuda:0") == "gpu"
    assert resolve_backend("gpu") == "gpu"


@pytest.mark.parametrize(
    "data, error, match",
    [
        (b"", EncoderInputError, "empty"),
        (b"not an image at all", EncoderInputError, "cannot read the image header"),
    ],
    ids=["empty", "garbage"],
)
def test_bad_headers(data, error, match):
    with pytest.raises(error, match=match):
        read_image_size(data)


def test_pixel_limit_from_header():
    with pytest.raises(LimitExceededError, match="max_image_pixels=1000"):
        read_image_size(image_bytes("L", (50, 30)), max_pixels=1000)
