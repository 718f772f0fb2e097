"""Fuzzing the request parser and admission: bad input only ever raises our own errors.

Any JSON-like body either fails pydantic validation (HTTP 422) or admission
with ``EncoderInputError``/``LimitExceededError`` (400/413), or is admitted
with one grid per item and consistent patch counts. Nothing else escapes.
Bounded example counts keep this quick in CI.
"""

import base64

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from images import image_bytes
from pydantic import ValidationError

from deployments.admission import Admission
from deployments.args import AppArgs
from deployments.schemas import EncodeRequest
from kimi_encoder.config import get_preset
from kimi_encoder.items import EncoderInputError, plan_image, read_image_size

PRESET = get_preset("tiny")
ADMISSION = Admission(
    PRESET.vision,
    PRESET.preprocess,
    AppArgs(max_images_per_request=8, max_image_pixels=4_000_000, max_patches_per_request=50_000),
)
PNG = image_bytes("RGB", (60, 40))
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(
    max_size=20
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
item_like = st.fixed_dictionaries(
    {"type": st.sampled_from(["image", "video", "audio", "", "IMAGE"])},
    optional={
        "image": st.sampled_from([base64.b64encode(PNG).decode(), "data:image/png;base64,"])
        | st.text(max_size=30),
        "pixel_values": st.fixed_dictionaries(
            {
                "data": st.binary(max_size=64).map(lambda b: base64.b64encode(b).decode()),
                "shape": st.lists(st.integers(-2, 20), min_size=0, max_size=5),
            },
            optional={"dtype": st.sampled_from(["float32", "float16", "int8"])},
        ),
        "grid_thws": st.lists(st.lists(st.integers(-3, 9), max_size=4), max_size=3),
        "extra": json_values,
    },
)
bodies = st.fixed_dictionaries(
    {"items": st.lists(item_like, max_size=4) | json_values},
    optional={
        "response_format": st.sampled_from(["json", "safetensors", "xml"]),
        "backend": st.sampled_from(["cpu", "gpu", "auto", "tpu", None]),
    },
)


def _admit(body):
    try:
        request = EncodeRequest.model_validate(body)
    except ValidationError:
        return None
    try:
        admitted = ADMISSION.admit_json(request)
    except EncoderInputError:  # includes LimitExceededError
        return None
    return admitted


@SETTINGS
@given(bodies)
def test_structured_bodies(body):
    admitted = _admit(body)
    if admitted is not None:
        assert len(admitted.items) == len(admitted.sources) <= 8
        for item in admitted.items:
            assert item.grid_thws.shape == (1, 3)
            t, h, w = item.grid
            assert t == 1 and h % 2 == 0 and w % 2 == 0
            if item.pixel_values is not None:
                assert item.pixel_values.shape[0] == t * h * w


@SETTINGS
@given(json_values)
def test_arbitrary_json(body):
    _admit(body)


@SETTINGS
@given(st.binary(max_size=256))
def test_random_bytes_as_image(data):
    try:
        width, height, _ = read_image_size(data)
    except EncoderInputError:
        return
    assert width >= 1 and height >= 1


@SETTINGS
@given(st.integers(0, len(PNG)), st.binary(max_size=16))
def test_damaged_png_headers(cut, junk):
    data = PNG[:cut] + junk
    try:
        item = plan_image(data, PRESET.preprocess, "cpu", max_pixels=4_000_000)
    except EncoderInputError:
        return
    assert item.grid_thws.shape == (1, 3)
