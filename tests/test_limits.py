"""Limits and security without Ray: bomb headers, body cap, data URLs, NaN, API key."""

from __future__ import annotations

import asyncio
import base64
import dataclasses

import numpy as np
import pytest
from images import image_bytes, png_claiming
from PIL import Image

from deployments.admission import Admission, read_body
from deployments.args import AppArgs
from deployments.schemas import EncodeRequest
from deployments.security import ENV_VAR, ApiKey
from kimi_encoder import preprocess
from kimi_encoder.config import get_preset
from kimi_encoder.items import EncoderInputError, LimitExceededError, plan_image

PRESET = get_preset("tiny")
ADMISSION = Admission(PRESET.vision, PRESET.preprocess, AppArgs(max_image_pixels=1_000_000))


def test_pil_bomb_protection_is_on():
    assert Image.MAX_IMAGE_PIXELS is not None and Image.MAX_IMAGE_PIXELS <= 100_000_000


@pytest.mark.parametrize("max_pixels", [None, 1_000_000], ids=["pil-limit", "our-limit"])
def test_bomb_header_is_refused_at_admission(max_pixels):
    with pytest.raises(LimitExceededError, match="item 3: .*decompression bomb") as info:
        plan_image(
            png_claiming(100_000, 100_000), PRESET.preprocess, "cpu", max_pixels=max_pixels, index=3
        )
    if max_pixels is not None:
        assert "max_image_pixels=1000000" in str(info.value)


def test_over_limit_header_names_the_limit():
    with pytest.raises(
        LimitExceededError,
        match=r"item 0: image is 2000x1000 = 2000000 pixels, .*max_image_pixels=1000000",
    ):
        plan_image(
            png_claiming(2000, 1000), PRESET.preprocess, "cpu", max_pixels=1_000_000, index=0
        )


def test_rank_decode_refuses_over_limit_before_decoding():
    """The rank checks the header again: a 10000x10000 claim (300 MB of RGB) never decodes."""
    data = png_claiming(10_000, 10_000)
    with pytest.raises(LimitExceededError, match="max_image_pixels=50000000"):
        preprocess.decode(data, max_pixels=50_000_000)
    with pytest.raises(LimitExceededError, match="decompression bomb"):  # PIL's own limit
        preprocess.decode(png_claiming(100_000, 100_000))


def test_planned_item_carries_its_limit_to_the_rank():
    item = plan_image(image_bytes("RGB", (60, 40)), PRESET.preprocess, "cpu", max_pixels=10_000)
    assert item.deferred.max_pixels == 10_000
    tighter = dataclasses.replace(item.deferred, max_pixels=100)
    with pytest.raises(LimitExceededError, match="60x40 = 2400 pixels"):
        preprocess.preprocess(item.image, tighter, PRESET.vision.patch_size, "cpu")


def _admit(image: str):
    return ADMISSION.admit_json(
        EncodeRequest.model_validate({"items": [{"type": "image", "image": image}]})
    )


def test_data_url_media_type_must_be_an_image():
    png = base64.b64encode(image_bytes("RGB", (8, 8))).decode()
    assert len(_admit(f"data:image/png;base64,{png}").items) == 1
    for media in ("text/plain", "application/octet-stream", ""):
        with pytest.raises(EncoderInputError, match=r"item 0: .*allowed media types are image/\*"):
            _admit(f"data:{media};base64,{png}")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_pixel_values_are_refused(bad):
    pixels = np.zeros((4, 3, 14, 14), "<f4")
    pixels[2, 1, 3, 4] = bad
    item = {
        "type": "image",
        "pixel_values": {
            "data": base64.b64encode(pixels.tobytes()).decode(),
            "shape": [4, 3, 14, 14],
        },
        "grid_thws": [[1, 2, 2]],
    }
    good = {
        **item,
        "pixel_values": {
            **item["pixel_values"],
            "data": base64.b64encode(np.zeros_like(pixels).tobytes()).decode(),
        },
    }
    request = EncodeRequest.model_validate({"items": [good, item]})
    with pytest.raises(EncoderInputError, match="item 1: pixel_values has 1 non-finite"):
        ADMISSION.admit_json(request)


async def _chunks(sizes):
    for size in sizes:
        yield b"x" * size


def test_read_body_stops_at_the_limit():
    assert asyncio.run(read_body(_chunks([3, 4]), 7)) == b"x" * 7
    with pytest.raises(LimitExceededError, match="max_request_bytes=7 .*8 bytes received"):
        asyncio.run(read_body(_chunks([3, 5, 10**6]), 7))


def test_api_key_from_env_or_file(tmp_path):
    assert not ApiKey.load(None, {}).required
    key = ApiKey.load(None, {ENV_VAR: " s3cret\n"})
    assert key.allows("Bearer s3cret") and key.allows("bearer s3cret")
    for header in (None, "", "Bearer", "Bearer s3cre", "Bearer s3cret2", "Basic s3cret", "s3cret"):
        assert not key.allows(header), header
    assert "s3cret" not in repr(key) and "s3cret" not in str(vars(key))
    path = tmp_path / "key"
    path.write_text("from-file\n")
    assert ApiKey.load(str(path), {}).allows("Bearer from-file")
    with pytest.raises(ValueError, match="configure the API key in one place only"):
        ApiKey.load(str(path), {ENV_VAR: "x"})
    with pytest.raises(ValueError, match="is empty"):
        ApiKey.load(None, {ENV_VAR: " "})
    with pytest.raises(ValueError, match="cannot read api_key_file"):
        ApiKey.load(str(tmp_path / "missing"), {})
