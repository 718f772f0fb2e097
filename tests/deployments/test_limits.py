"""Limits and security without Ray: bomb headers, body cap, data URLs, NaN, API key."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from images import chunk, deflated_zeros, ico_bomb, image_bytes, make_image, png_claiming
from PIL import Image
from pydantic import ValidationError
from serve_helpers import admission
from starlette.requests import Request

from deployments.admission import (
    BodyLostError,
    BodyTimeoutError,
    FormError,
    read_body,
    replay,
)
from deployments.args import AppArgs, BodyPace
from deployments.schemas import EncodeRequest
from deployments.security import ENV_VAR, ApiKey
from kimi_encoder import preprocess
from kimi_encoder.config import get_preset
from kimi_encoder.headers import MAX_STRUCTURES, header_size
from kimi_encoder.items import (
    EncoderInputError,
    LimitExceededError,
    UnsupportedFormatError,
    plan_image,
)

PRESET = get_preset("tiny")
ADMISSION = admission(AppArgs(ingress={"limits": {"max_image_pixels": 1_000_000}}))


def test_pil_bomb_protection_is_on():
    assert Image.MAX_IMAGE_PIXELS is not None
    assert Image.MAX_IMAGE_PIXELS <= 100_000_000


@pytest.mark.parametrize("max_pixels", [None, 1_000_000], ids=["pil-limit", "our-limit"])
def test_bomb_header_is_refused_at_admission(max_pixels):
    with pytest.raises(LimitExceededError, match=r"item 3: .*decompression bomb") as info:
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


def jpeg(size=(64, 48)) -> bytes:
    buf = io.BytesIO()
    make_image("RGB", size).save(buf, format="JPEG")
    return buf.getvalue()


def gif_with_comment(blocks: int) -> bytes:
    """A 5x5 GIF whose first frame follows a comment of ``blocks`` 255-byte sub-blocks."""
    buf = io.BytesIO()
    make_image("P", (5, 5)).save(buf, format="GIF")
    data = buf.getvalue()
    at = data.index(b",\x00\x00\x00\x00")
    return data[:at] + b"!\xfe" + (b"\xff" + bytes(255)) * blocks + b"\x00" + data[at:]


PNG_HEAD = image_bytes("RGB", (60, 40))
ZTXT = chunk(b"zTXt", b"comment\0\0" + deflated_zeros(64 << 20))  # inflates to 64 MB
BOUNDED = [
    ("ico-bomb", ico_bomb, UnsupportedFormatError, "image format ICO is not accepted"),
    ("png-claims-1e10", lambda: png_claiming(100_000, 100_000), LimitExceededError, "bomb"),
    ("ztxt-before-ihdr", lambda: PNG_HEAD[:8] + ZTXT + PNG_HEAD[8:], EncoderInputError, "zTXt"),
    ("ztxt-after-ihdr", lambda: PNG_HEAD[:33] + ZTXT + PNG_HEAD[33:], None, (60, 40)),
    (
        "jpeg-16000-markers",
        lambda: jpeg()[:2] + b"\xff\xfe\x00\x02" * 16_000 + jpeg()[2:],
        None,
        (64, 48),
    ),
    (
        "jpeg-too-many-markers",
        lambda: jpeg()[:2] + b"\xff\xfe\x00\x02" * MAX_STRUCTURES + jpeg()[2:],
        EncoderInputError,
        "more than 16384 markers",
    ),
    (
        "jpeg-8mb-of-app-segments",
        lambda: jpeg()[:2] + (b"\xff\xe9\xff\xff" + bytes(65533)) * 128 + jpeg()[2:],
        None,
        (64, 48),
    ),
    ("gif-4mb-comment", lambda: gif_with_comment(16_000), None, (5, 5)),
    ("gif-too-many-blocks", lambda: gif_with_comment(MAX_STRUCTURES), EncoderInputError, "16384"),
]


# Run in a process of its own by ``bounded_peaks``: tracemalloc counts every thread's
# allocations, and a pytest process that has run the Serve tests has Ray's threads.
_PEAKS_CHILD = """
import json, tracemalloc
import test_limits as t
out = {}
for name, build, _, _ in t.BOUNDED:
    data = build()
    tracemalloc.start()
    try:
        try:
            item = t.plan_image(data, t.PRESET.preprocess, "cpu", max_pixels=1_000_000)
            result = {"size": list(item.original_size)}
        except Exception as exc:
            result = {"errors": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}
        result["peak"] = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    result["input"] = len(data)
    out[name] = result
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def bounded_peaks() -> dict:
    """Each BOUNDED input admitted in one fresh process with only its main thread: the
    outcome and the peak bytes tracemalloc traced, by name."""
    here = Path(__file__).resolve()  # this module, the tests' helpers, the repository root
    folders = [here.parent, here.parents[1], here.parents[2]]
    path = [*map(str, folders), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    done = subprocess.run(
        [sys.executable, "-c", _PEAKS_CHILD],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("name", "error", "expected"), [(b[0], *b[2:]) for b in BOUNDED], ids=[b[0] for b in BOUNDED]
)
def test_admission_memory_is_bounded(bounded_peaks, name, error, expected):
    """Admission allocates under 1 MB beyond the input, whatever the input claims or holds."""
    result = bounded_peaks[name]
    if error is None:
        assert tuple(result.get("size", ())) == expected, result
    else:
        assert error.__name__ in result.get("errors", []), result
        assert re.search(expected, result["message"]), result
    assert result["peak"] < 1 << 20, (
        f"{result['peak']} bytes traced for a {result['input']}-byte input"
    )


def test_the_ico_bomb_is_one():
    """Its payload really is a 13000x13000 PNG (169 MB of pixels) in 0.2 MB."""
    data = ico_bomb()
    assert len(data) < 300_000
    assert header_size(data[22:], "PNG") == (13_000, 13_000)


def test_rank_decode_refuses_what_admission_refuses():
    for data, match in [
        (ico_bomb(64), "image format ICO"),
        (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", "image format PostScript/EPS"),
    ]:
        with pytest.raises(UnsupportedFormatError, match=match):
            preprocess.decode(data)


def test_rank_decode_needs_the_header_size():
    """Two IHDR chunks: admission reads the first (8x8), Pillow the last (4000x4000)."""
    second = chunk(b"IHDR", struct.pack(">IIBBBBB", 4000, 4000, 8, 2, 0, 0, 0))
    data = png_claiming(8, 8)[:33] + second + png_claiming(8, 8)[33:]
    assert plan_image(data, PRESET.preprocess, "cpu").original_size == (8, 8)
    with pytest.raises(EncoderInputError, match="PNG header reads 8x8 but the decoder finds 4000x"):
        preprocess.decode(data, max_pixels=1_000_000)


def _pixel_item(grid_thws, rows: int = 4, shape_rows: int | None = None) -> dict:
    data = base64.b64encode(bytes(rows * 3 * 14 * 14 * 4)).decode()
    shape = [rows if shape_rows is None else shape_rows, 3, 14, 14]
    return {"type": "image", "pixel_values": {"data": data, "shape": shape}, "grid_thws": grid_thws}


@pytest.mark.parametrize(
    ("item", "match"),
    [
        (_pixel_item([[1, 2, 2], [1, 2]]), r"item 0: grid_thws row 1 is \[1, 2\] with 2 values"),
        (_pixel_item([[1, 2, 2**64]]), r"item 0: grid_thws row 0 .* past int64"),
        (_pixel_item([[1, 2, 2], [1, 2**62 + 2, 4]], rows=12), r"row 1 .* past int64"),
    ],
    ids=["ragged", "above-int64", "wraps-int64"],
)
def test_client_grids_are_refused_with_400(item, match):
    with pytest.raises(EncoderInputError, match=match):
        ADMISSION.admit_json(EncodeRequest.model_validate({"items": [item]}))


@pytest.mark.parametrize(
    ("item", "match"),
    [
        (_pixel_item([[True, 2, 2]]), r"grid_thws\.0\.0\n  Input should be a valid integer"),
        (_pixel_item([[1.0, 2, 2]]), r"grid_thws\.0\.0\n  Input should be a valid integer"),
        (_pixel_item([[1, 2, 2]], 0, shape_rows=2**62), "less than or equal to 2147483647"),
    ],
    ids=["bool", "float", "rows-wrap"],
)
def test_schema_refuses_non_integers_and_huge_shapes(item, match):
    """422: a bool or float is no grid value; 2**62 rows would wrap the byte count."""
    with pytest.raises(ValidationError, match=match):
        EncodeRequest.model_validate({"items": [item]})


def _form_request(fields: dict[str, bytes]) -> Request:
    """A multipart ``POST /v1/encode`` request of ``fields`` (``image`` sent as a file)."""
    boundary = "b0undary"
    parts = []
    for name, value in fields.items():
        filename = '; filename="a.png"' if name == "image" else ""
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"{filename}\r\n\r\n'
        parts.append(head.encode() + value + b"\r\n")
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    headers = [(b"content-type", f"multipart/form-data; boundary={boundary}".encode())]
    scope = {"type": "http", "method": "POST", "path": "/v1/encode", "headers": headers}
    return Request(scope, replay(body))


@pytest.mark.parametrize("dtype", ["int8", "float64", "FLOAT32"])
def test_a_feature_dtype_is_checked_at_admission(dtype):
    """Admission is where a feature dtype is refused (JSON 422, multipart 422), naming the
    allowed ones; past it the rank and its batcher take it as given."""
    with pytest.raises(
        ValidationError, match=r"feature_dtype\n  Input should be 'float32', 'bfloat16' or"
    ):
        EncodeRequest.model_validate(
            {"items": [{"type": "image", "image": "x"}], "feature_dtype": dtype}
        )
    form = {"image": image_bytes("RGB", (8, 8)), "feature_dtype": dtype.encode()}
    with pytest.raises(
        FormError, match=f"feature_dtype '{dtype}' is not one of 'float32', 'bfloat16', 'float16'"
    ):
        asyncio.run(ADMISSION.admit(_form_request(form)))
    admitted = asyncio.run(ADMISSION.admit(_form_request({**form, "feature_dtype": b"float16"})))
    assert admitted.feature_dtype == "float16"


def test_renamed_file_is_judged_by_its_bytes():
    eps = base64.b64encode(b"%!PS-Adobe-3.0 EPSF-3.0\n").decode()
    with pytest.raises(UnsupportedFormatError, match="item 0: image format PostScript/EPS"):
        _admit(f"data:image/png;base64,{eps}")


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
    with pytest.raises(LimitExceededError, match=r"max_request_bytes=7 .*8 bytes received"):
        asyncio.run(read_body(_chunks([3, 5, 10**6]), 7))


async def _then_nothing(sizes):
    """``sizes`` chunks, then a stream that never sends again (nor ends)."""
    async for part in _chunks(sizes):
        yield part
    await asyncio.Event().wait()


# A body refused 50 ms after it began (grace_s), at any pace after that.
SHORT_PACE = BodyPace(grace_s=0.05, timeout_s=0.05)


def test_a_declared_body_of_which_nothing_came_was_lost_not_slow():
    """Not one byte of a body with a Content-Length by the deadline: held up or lost
    between the client and the replica (Serve's proxy gives a body to one replica only),
    503 to send again; a body that stalled after its first bytes is the client's (408),
    and so is one without a Content-Length."""
    with pytest.raises(BodyLostError, match=r"not one byte of the request's 1000-byte body"):
        asyncio.run(read_body(_then_nothing([]), 10**6, SHORT_PACE, declared=1000))
    with pytest.raises(BodyTimeoutError, match=r"request body too slow: 3 bytes in"):
        asyncio.run(read_body(_then_nothing([3]), 10**6, SHORT_PACE, declared=1000))
    with pytest.raises(BodyTimeoutError, match=r"request body too slow: 0 bytes in"):
        asyncio.run(read_body(_then_nothing([]), 10**6, SHORT_PACE))


def test_a_body_that_ends_short_of_its_content_length_was_lost():
    with pytest.raises(BodyLostError, match=r"ended after 7 of its 12 bytes \(Content-Length\)"):
        asyncio.run(read_body(_chunks([3, 4]), 100, declared=12))
    assert asyncio.run(read_body(_chunks([3, 4]), 100, declared=7)) == b"x" * 7
    assert asyncio.run(read_body(_chunks([]), 100, declared=0)) == b""


def test_api_key_from_env_or_file(tmp_path):
    assert not ApiKey.load(None, {}).required
    key = ApiKey.load(None, {ENV_VAR: " s3cret\n"})
    assert key.allows("Bearer s3cret")
    assert key.allows("bearer s3cret")
    for header in (None, "", "Bearer", "Bearer s3cre", "Bearer s3cret2", "Basic s3cret", "s3cret"):
        assert not key.allows(header), header
    assert "s3cret" not in repr(key)
    assert "s3cret" not in str(vars(key))
    path = tmp_path / "key"
    path.write_text("from-file\n")
    assert ApiKey.load(str(path), {}).allows("Bearer from-file")
    with pytest.raises(ValueError, match="configure the API key in one place only"):
        ApiKey.load(str(path), {ENV_VAR: "x"})
    with pytest.raises(ValueError, match="is empty"):
        ApiKey.load(None, {ENV_VAR: " "})
    with pytest.raises(ValueError, match="cannot read api_key_file"):
        ApiKey.load(str(tmp_path / "missing"), {})
