"""Fuzzing admission: valid requests with one mutated field get the documented answer.

Hypothesis draws a valid JSON request (1 to 4 seeded images in PNG, JPEG or
WebP, as base64 or data URLs, optional response format and backend) and either
leaves it alone or applies one mutation from ``MUTATIONS``. The body goes
through the same path as a served request (``EncodeRequest.model_validate_json``,
then ``Admission.admit_json``) and whatever it raises is classified by the
server's error table (deployments/errors.py): the (status, error type) must be
the one the mutation documents, and an untouched request is admitted whole.
Bounded example counts keep this quick in CI.
"""

from __future__ import annotations

import base64
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from images import image_bytes
from serve_helpers import admission

from deployments.args import AppArgs
from deployments.errors import INTERNAL, classify
from deployments.schemas import EncodeRequest

MAX_IMAGES = 6
LIMITS = {"max_images_per_request": MAX_IMAGES, "max_image_pixels": 4_000_000}
ADMISSION = admission(AppArgs(ingress={"limits": LIMITS}))
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

FORMATS = ("PNG", "JPEG", "WEBP")
images = st.builds(
    lambda w, h, fmt, seed: image_bytes("RGB", (w, h), seed, fmt=fmt),
    st.integers(1, 90),
    st.integers(1, 90),
    st.sampled_from(FORMATS),
    st.integers(0, 3),
)


def as_field(data: bytes, data_url: bool) -> str:
    text = base64.b64encode(data).decode()
    return f"data:image/png;base64,{text}" if data_url else text


image_items = st.builds(
    lambda data, url: {"type": "image", "image": as_field(data, url)}, images, st.booleans()
)
requests_ = st.fixed_dictionaries(
    {"items": st.lists(image_items, min_size=1, max_size=4)},
    optional={
        "response_format": st.sampled_from(["json", "safetensors"]),
        "backend": st.sampled_from(["cpu", "gpu"]),
    },
)


def set_item(field, value):
    def mutate(body, data):
        index = data.draw(st.integers(0, len(body["items"]) - 1))
        body["items"][index][field] = value(data) if callable(value) else value

    return mutate


def set_top(field, value):
    def mutate(body, data):
        body[field] = value

    return mutate


def too_many(body, data):
    body["items"] = body["items"] * (MAX_IMAGES // len(body["items"]) + 1)


def ragged_grid(body, data):
    body["items"].append(
        {
            "type": "image",
            "pixel_values": {
                "data": base64.b64encode(bytes(4 * 588 * 4)).decode(),
                "shape": [4, 3, 14, 14],
            },
            "grid_thws": [[1, 2, 2], [1, 2]],
        }
    )


# No allowed format's signature starts with two zero bytes (ICO's does: refused as well).
RANDOM_BYTES = st.binary(min_size=16, max_size=64).map(lambda b: b"\0\0" + b)

# name -> (mutation, (HTTP status, error type)) as docs/api.md documents them.
MUTATIONS = {
    "video-item": (set_item("type", "video"), (400, "invalid_request")),
    "audio-item": (set_item("type", "audio"), (400, "invalid_request")),
    "bad-base64": (set_item("image", "%%% not base64"), (400, "invalid_request")),
    "empty-image": (set_item("image", ""), (400, "invalid_request")),
    "unknown-bytes": (
        set_item("image", lambda data: base64.b64encode(data.draw(RANDOM_BYTES)).decode()),
        (415, "unsupported_media_type"),
    ),
    "cut-header": (
        set_item(
            "image",
            lambda data: base64.b64encode(
                image_bytes("RGB", (20, 20))[: data.draw(st.integers(8, 20))]
            ).decode(),
        ),
        (400, "invalid_request"),
    ),
    "text-data-url": (
        set_item("image", "data:text/plain;base64,aGVsbG8="),
        (400, "invalid_request"),
    ),
    "image-not-a-string": (set_item("image", 7), (422, "validation_error")),
    "unknown-item-field": (set_item("detail", "high"), (422, "validation_error")),
    "unknown-top-field": (set_top("stream", True), (422, "validation_error")),
    "bad-format": (set_top("response_format", "npy"), (422, "validation_error")),
    "bad-backend": (set_top("backend", "tpu"), (400, "invalid_request")),
    "too-many-images": (too_many, (413, "limit_exceeded")),
    "ragged-grid": (ragged_grid, (400, "invalid_request")),
}


def outcome(body: dict) -> tuple[int, str]:
    """(status, error type) of admitting ``body`` as the server does; (200, "ok") if admitted."""
    try:
        request = EncodeRequest.model_validate_json(json.dumps(body))
        admitted = ADMISSION.admit_json(request)
    except Exception as exc:
        # Whatever admission raises goes through the server's error table, as a served
        # request's would; one without a row (a 500) is a bug, raised with its traceback.
        if classify(exc) == INTERNAL:
            raise
        return classify(exc)
    assert len(admitted.items) == len(body["items"]), "one item per image"
    for item in admitted.items:
        t, h, w = item.grid
        assert item.grid_thws.shape == (1, 3)
        assert t == 1
        assert h % 2 == 0
        assert w % 2 == 0
    return 200, "ok"


@SETTINGS
@given(requests_)
def test_valid_requests_are_admitted(body):
    assert outcome(body) == (200, "ok")


@SETTINGS
@given(requests_, st.sampled_from(sorted(MUTATIONS)), st.data())
def test_one_mutation_gets_its_documented_answer(body, name, data):
    mutate, expected = MUTATIONS[name]
    mutate(body, data)
    assert outcome(body) == expected, name
