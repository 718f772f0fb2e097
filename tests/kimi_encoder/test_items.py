"""Admission: resize math, grids from headers, modality gate, splitting, backends."""

import dataclasses
import hashlib
import io
import pickle
import struct
import zlib

import numpy as np
import pytest
import torch
from images import image_bytes, make_image, png_claiming
from PIL import Image

from kimi_encoder.config import PreprocessConfig, get_preset
from kimi_encoder.items import (
    DeferredPreprocessing,
    EncoderInputError,
    LimitExceededError,
    Modality,
    UnsupportedFormatError,
    check_grid_rows,
    check_modality,
    navit_resize,
    plan_image,
    read_image_size,
    resolve_backend,
    split_pixel_values,
)

K3 = PreprocessConfig()
TINY = get_preset("tiny").preprocess


@pytest.mark.parametrize(
    ("size", "cfg", "grid", "tokens"),
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
    assert rc.new_width <= size[0]
    assert rc.new_height <= size[1]
    assert (rc.new_width + rc.pad_width) % 28 == 0
    assert (rc.new_height + rc.pad_height) % 28 == 0


def test_padding_can_exceed_patch_limit():
    """The limit is checked before padding, so padding may go slightly over it."""
    rc = navit_resize(1000, 1000, TINY)
    _t, h, w = rc.grid_thw(14)
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


def test_item_pickles_its_grid_as_ints_and_keeps_everything():
    data = image_bytes("RGB", (300, 200))
    item = plan_image(data, TINY, "cpu")
    item.image_digest()
    blob = pickle.dumps(item)
    assert b"torch" not in blob  # nothing goes through torch's serializer
    back = pickle.loads(blob)
    assert back.grid_thws.dtype == torch.int64
    assert back.grid_thws.tolist() == item.grid_thws.tolist() == [[1, 16, 22]]
    assert (back.image, back.deferred, back.original_size) == (data, item.deferred, (300, 200))
    assert back.image_sha256 == hashlib.sha256(data).digest()  # the digest travels along
    pixels = split_pixel_values(torch.randn(12, 3, 14, 14), torch.tensor([[1, 2, 2], [1, 2, 4]]))
    for one in pixels:
        again = pickle.loads(pickle.dumps(one))
        assert torch.equal(again.grid_thws, one.grid_thws)
        assert torch.equal(again.pixel_values, one.pixel_values)
    odd = dataclasses.replace(item, grid_thws=torch.tensor([[1, 16, 22]], dtype=torch.int32))
    assert pickle.loads(pickle.dumps(odd)).grid_thws.dtype == torch.int32  # kept as it is
    empty = dataclasses.replace(item, grid_thws=torch.zeros((0, 3), dtype=torch.int64))
    assert pickle.loads(pickle.dumps(empty)).grid_thws.shape == (0, 3)


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


@pytest.mark.parametrize(
    ("grids", "match"),
    [
        ([[2, 4, 4]], r"row 0 is \[2, 4, 4\] with t=2; images have t=1"),
        ([[1, 2, 2], [1, 3, 4]], r"row 1 is \[1, 3, 4\]; h and w must be positive multiples"),
        ([1, 2, 3], r"must be a non-empty list of \[t, h, w\] rows, got \[1, 2, 3\]"),
        ([], r"must be a non-empty list of \[t, h, w\] rows, got \[\]"),
        ("[[1, 2, 2]]", "must be a non-empty list of .* rows, got '"),
        ([[1, 2, 2], [1, 2]], r"row 1 is \[1, 2\] with 2 values; every row is \[t, h, w\]"),
        ([[1, 2, 2, 2]], r"row 0 is \[1, 2, 2, 2\] with 4 values"),
        ([[1.0, 2, 2]], r"row 0 is \[1.0, 2, 2\]; grid_thws must hold integers"),
        ([[True, 2, 2]], r"row 0 is \[True, 2, 2\]; grid_thws must hold integers \(no booleans"),
        ([[1, "2", 2]], r"row 0 is \[1, '2', 2\]; grid_thws must hold integers"),
        (torch.ones(1, 3, dtype=torch.bool), r"row 0 is \[True, True, True\]; grid_thws must"),
        (torch.full((1, 3), 2.0), r"row 0 is \[2.0, 2.0, 2.0\]; grid_thws must hold"),
        ([[1, 2, 2**64]], r"row 0 is \[1, 2, 18446744073709551616\]: the rows need .* past int64"),
        ([[2**64 + 1, 2, 2]], r"row 0 is \[18446744073709551617, 2, 2\] with t=1844"),
        ([[1, 2, 2], [1, 2**62 + 2, 4]], r"row 1 is \[1, 4611686018427387906, 4\]: .* past int64"),
        ([[1, 2**31, 2**31]] * 3, r"row 1 .* the rows need 9223372036854775808 patches"),
    ],
    ids=[
        "video-t", "odd-h", "flat", "empty", "string", "ragged", "four", "float", "bool", "str",
        "bool-tensor", "float-tensor", "above-int64", "huge-t", "wraps-int64", "sum-wraps",
    ],
)  # fmt: skip
def test_bad_grid_rows(grids, match):
    with pytest.raises(EncoderInputError, match="item 4: grid_thws " + match):
        check_grid_rows(grids, (2, 2), index=4)  # every message names the item and the row


@pytest.mark.parametrize(
    "grids",
    [[[1, 2, 4], [1, 6, 2]], ((1, 2, 4), (1, 6, 2)), np.array([[1, 2, 4], [1, 6, 2]])],
    ids=["list", "tuple", "numpy"],
)
def test_good_grid_rows_become_int64(grids):
    checked = check_grid_rows(grids, (2, 2))
    assert checked.dtype == torch.int64
    assert checked.tolist() == [[1, 2, 4], [1, 6, 2]]


def test_split_counts_rows_without_wrapping():
    """t*h*w = 2**64 + 8 wraps to 8 in int64: the row count must not match 4 + 8 rows."""
    grids = torch.tensor([[1, 2, 2], [1, 2**62 + 2, 4]])
    assert int(grids.prod(dim=1).sum()) == 12  # what int64 arithmetic would have accepted
    with pytest.raises(EncoderInputError, match=r"has 12 rows but the grids .* need 18446744"):
        split_pixel_values(torch.zeros(12, 3, 14, 14), grids, index=0)


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


def _saved(fmt: str, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    make_image(mode, (32, 32)).save(buf, format=fmt)
    return buf.getvalue()


def _png_ihdr(width: int, height: int, first: bytes = b"IHDR") -> bytes:
    body = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", 13) + first + body + struct.pack(">I", zlib.crc32(first + body))
    return b"\x89PNG\r\n\x1a\n" + chunk


ALLOWED = r"the server reads PNG, JPEG, WebP, GIF, BMP or TIFF files, recognised by their signature"


@pytest.mark.parametrize(
    ("data", "error", "match"),
    [
        (b"", EncoderInputError, r"image data is empty \(0 bytes\)"),
        (
            b"not an image at all",
            UnsupportedFormatError,
            r"cannot read the image header: 19 bytes in an unknown format \(first bytes "
            r"6e 6f 74 20 61 6e 20 69\); " + ALLOWED,
        ),
        (_saved("ICO"), UnsupportedFormatError, r"image format ICO is not accepted \(\d+ bytes"),
        (_saved("EPS"), UnsupportedFormatError, "image format PostScript/EPS is not accepted"),
        (_saved("PDF"), UnsupportedFormatError, "image format PDF is not accepted"),
        (_saved("JPEG2000"), UnsupportedFormatError, "image format JPEG 2000 is not accepted"),
        (b"8BPS\x00\x01" + bytes(20), UnsupportedFormatError, "image format PSD is not accepted"),
        (b"<svg xmlns='http://www.w3.org/2000/svg'/>", UnsupportedFormatError, "SVG/XML"),
        (
            _png_ihdr(5, 5, b"tEXt"),
            EncoderInputError,
            r"cannot read the image header \(PNG's first chunk is b'tEXt'; .*\); send a valid "
            "PNG, JPEG, WebP, GIF, BMP or TIFF file",
        ),
        (_png_ihdr(0, 5), EncoderInputError, r"empty size 0x5 \(PNG header\); send an image of"),
    ],
    ids=["empty", "garbage", "ico", "eps", "pdf", "jpeg2000", "psd", "svg", "png-order", "0x5"],
)
def test_bad_headers(data, error, match):
    with pytest.raises(error, match=match) as info:
        read_image_size(data, index=2)
    assert type(info.value) is error
    assert str(info.value).startswith("item 2: ")
    if error is UnsupportedFormatError:
        assert ALLOWED.split(",")[0] in str(info.value)


def test_pillow_would_open_the_refused_formats():
    """The allow-list is what refuses them: Pillow itself reads these files."""
    for fmt in ("ICO", "EPS", "JPEG2000"):
        with Image.open(io.BytesIO(_saved(fmt))) as img:
            assert img.format == fmt
            assert img.size == (32, 32)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"])
def test_each_allowed_format_is_read_and_limited(fmt):
    assert read_image_size(_saved(fmt), max_pixels=1024) == (32, 32, fmt)
    with pytest.raises(LimitExceededError, match="item 1: image is 32x32 = 1024 pixels, over"):
        read_image_size(_saved(fmt), max_pixels=1023, index=1)


def test_pil_bomb_band():
    """Above MAX_IMAGE_PIXELS: refused without a limit, ours to decide with one; 2x: refused."""
    band = png_claiming(10_000, 10_000)  # 1e8 pixels, between PIL's limit and twice it
    assert Image.MAX_IMAGE_PIXELS < 10_000 * 10_000 <= 2 * Image.MAX_IMAGE_PIXELS
    with pytest.raises(LimitExceededError, match=r"decompression bomb: 10000x10000 = 100000000"):
        read_image_size(band)
    assert read_image_size(band, max_pixels=10**8) == (10_000, 10_000, "PNG")
    with pytest.raises(LimitExceededError, match=r"over PIL's limit of \d+; max_image_pixels=10"):
        read_image_size(png_claiming(20_000, 20_000), max_pixels=10**9)


def test_pixel_limit_from_header():
    with pytest.raises(LimitExceededError, match="max_image_pixels=1000"):
        read_image_size(image_bytes("L", (50, 30)), max_pixels=1000)
