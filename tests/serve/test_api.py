"""The HTTP API on a shared 2-rank app: formats, splitting, multipart, errors, info, docs."""

from __future__ import annotations

import base64
import io
import json
import subprocess

import numpy as np
import pytest
import requests
import torch
from PIL import Image
from safetensors.numpy import load as load_safetensors
from serve_helpers import b64, decode_features, encode, one_thread, rank_calls

from kimi_encoder.items import MSG_IMAGE_ONLY, MSG_LENGTH

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def url(deploy) -> str:
    return deploy(2)


def image_items(images: list[bytes]) -> list[dict]:
    return [{"type": "image", "image": b64(b)} for b in images]


def aggregated_item(reference, images: list[bytes]) -> dict:
    """One item holding the library-materialized pixels of several images, rows concatenated."""
    planned = [reference.plan(b) for b in images]
    with one_thread():
        pixels = torch.cat(reference.materialize(planned)).numpy().astype("<f4")
    return {
        "type": "image",
        "pixel_values": {
            "data": b64(pixels.tobytes()),
            "shape": list(pixels.shape),
            "dtype": "float32",
        },
        "grid_thws": [list(item.grid) for item in planned],
    }


def test_json_and_safetensors_decode_to_the_same_tensors(url, images):
    items = image_items(images[:5])
    as_json = encode(url, items).json()
    response = encode(url, items, response_format="safetensors")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/octet-stream"
    tensors = load_safetensors(response.content)
    for item in as_json["items"]:
        i = item["index"]
        np.testing.assert_array_equal(tensors[f"features.{i}"], decode_features(item))
        assert tensors[f"features.{i}"].dtype == np.float32
        assert tensors[f"grid_thw.{i}"].dtype == np.int64
        assert tensors[f"grid_thw.{i}"].tolist() == [item["grid_thw"]]
    meta = safetensors_metadata(response.content)
    assert json.loads(meta["owner_ranks"]) == [i["owner_rank"] for i in as_json["items"]]
    assert meta["model"] == as_json["model"] == "preset:tiny"


def safetensors_metadata(blob: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file: 8-byte header size, then JSON."""
    size = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + size])["__metadata__"]


def test_data_url_equals_plain_base64(url, images):
    plain = encode(url, image_items(images[2:3])).json()
    data_url = encode(url, [{"type": "image", "image": "data:image/png;base64," + b64(images[2])}])
    assert data_url.status_code == 200
    assert data_url.json()["items"][0]["data"] == plain["items"][0]["data"]


def test_aggregated_item_is_split_and_matches_raw_images(url, images, reference):
    raw = encode(url, image_items(images[:3])).json()
    response = encode(url, [aggregated_item(reference, images[:3])])
    assert response.status_code == 200, response.text
    split = response.json()
    assert len(split["items"]) == 3
    for got, want in zip(split["items"], raw["items"], strict=True):
        assert got["grid_thw"] == want["grid_thw"] and got["owner_rank"] == want["owner_rank"]
        np.testing.assert_allclose(decode_features(got), decode_features(want), rtol=0, atol=1e-5)


def test_multipart_with_curl(url, images, tmp_path):
    png, jpeg = tmp_path / "a.png", tmp_path / "b.jpg"
    png.write_bytes(images[0])
    jpeg.write_bytes(images[4])
    out = subprocess.run(
        ["curl", "-sS", "-F", f"image=@{png}", "-F", f"image=@{jpeg}", f"{url}/v1/encode"],
        capture_output=True,
        check=True,
        timeout=120,
    )
    body = json.loads(out.stdout)
    want = encode(url, image_items([images[0], images[4]])).json()
    assert [i["data"] for i in body["items"]] == [i["data"] for i in want["items"]]

    out = subprocess.run(
        [
            "curl",
            "-sS",
            "-F",
            f"image=@{png}",
            "-F",
            "response_format=safetensors",
            "-F",
            "backend=gpu",
            f"{url}/v1/encode",
        ],
        capture_output=True,
        check=True,
        timeout=120,
    )
    tensors = load_safetensors(out.stdout)
    np.testing.assert_allclose(
        tensors["features.0"], decode_features(want["items"][0]), rtol=0, atol=1e-5
    )


def flat_png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (120, 30, 200)).save(out, "PNG")
    return out.getvalue()


def bad_pixels(reference, images) -> dict:
    item = aggregated_item(reference, images[:2])
    item["grid_thws"][1][1] += 2  # the grids now need more rows than were sent
    return item


# (id, body builder, status, fragment of the message)
ERRORS = [
    (
        "video",
        lambda imgs, ref: {"items": image_items(imgs[:1]) + [{"type": "video", "video": "x"}]},
        400,
        f"item 1: {MSG_IMAGE_ONLY}",
    ),
    ("audio", lambda imgs, ref: {"items": [{"type": "audio"}]}, 400, MSG_IMAGE_ONLY),
    (
        "backend",
        lambda imgs, ref: {"items": image_items(imgs[:1]), "backend": "tpu"},
        400,
        "Unsupported Kimi-K3 deferred preprocessing backend: tpu",
    ),
    ("length", lambda imgs, ref: {"items": [bad_pixels(ref, imgs)]}, 400, f"item 0: {MSG_LENGTH}"),
    (
        "base64",
        lambda imgs, ref: {"items": [{"type": "image", "image": "%%%"}]},
        400,
        "item 0: 'image' is not valid base64",
    ),
    (
        "not-an-image",
        lambda imgs, ref: {"items": image_items([imgs[0], b"GIF89 nope"])},
        400,
        "item 1: cannot read the image header",
    ),
    (
        "pixel-bytes",
        lambda imgs, ref: {
            "items": [
                {
                    "type": "image",
                    "grid_thws": [[1, 2, 2]],
                    "pixel_values": {"data": b64(b"\0" * 8), "shape": [4, 3, 14, 14]},
                }
            ]
        },
        400,
        "pixel_values.data has 8 bytes",
    ),
    (
        "too-many",
        lambda imgs, ref: {"items": image_items([imgs[2]] * 11)},
        413,
        "max_images_per_request=10",
    ),
    (
        "too-many-pixels",
        lambda imgs, ref: {"items": image_items([flat_png(1200, 1000)])},
        413,
        "item 0: image is 1200x1000",
    ),
    (
        "too-many-patches",
        lambda imgs, ref: {"items": image_items([flat_png(700, 520)] * 4)},
        413,
        "max_patches_per_request=4096",
    ),
    (
        "too-many-bytes",
        lambda imgs, ref: {"items": [{"type": "image", "image": "A" * (5 << 20)}]},
        413,
        "max_request_bytes=4194304",
    ),
    ("no-items", lambda imgs, ref: {"items": []}, 422, "items"),
    (
        "extra-field",
        lambda imgs, ref: {"items": image_items(imgs[:1]), "stream": True},
        422,
        "stream: Extra inputs are not permitted",
    ),
    (
        "two-sources",
        lambda imgs, ref: {
            "items": [
                {
                    "type": "image",
                    "image": b64(imgs[0]),
                    "pixel_values": {"data": "", "shape": [1, 3, 14, 14]},
                }
            ]
        },
        422,
        "exactly one of 'image'",
    ),
    (
        "format",
        lambda imgs, ref: {"items": image_items(imgs[:1]), "response_format": "npy"},
        422,
        "response_format",
    ),
]


@pytest.mark.parametrize(
    ("body", "status", "fragment"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS]
)
def test_errors_never_reach_a_rank(url, images, reference, body, status, fragment):
    before = rank_calls(url)
    response = requests.post(f"{url}/v1/encode", json=body(images, reference), timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert fragment in error["message"], error
    assert error["type"] in ("invalid_request", "limit_exceeded", "validation_error")
    assert rank_calls(url) == before


@pytest.mark.parametrize(
    ("data", "content_type", "status"),
    [
        (b"{", "application/json", 422),
        (b"[1, 2]", "application/json", 422),
        (b"hello", "text/plain", 415),
    ],
    ids=["truncated-json", "json-array", "text"],
)
def test_malformed_bodies(url, data, content_type, status):
    response = requests.post(
        f"{url}/v1/encode", data=data, headers={"content-type": content_type}, timeout=60
    )
    assert response.status_code == status, response.text
    assert set(response.json()["error"]) == {"type", "message"}


def test_multipart_errors(url, images):
    response = requests.post(f"{url}/v1/encode", files={"picture": ("a.png", images[0])})
    assert response.status_code == 422 and "unknown form fields ['picture']" in response.text
    response = requests.post(
        f"{url}/v1/encode", files={"image": ("a.png", images[0])}, data={"backend": "npu"}
    )
    assert response.status_code == 400
    assert "Unsupported Kimi-K3 deferred preprocessing backend: npu" in response.text


def test_truncated_image_is_named_by_the_owner_rank(url, images):
    """A valid header over a cut body passes admission; the owner's decode names the item."""
    truncated = images[5][: len(images[5]) // 2]
    response = encode(url, image_items([images[0], truncated]))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"].startswith("item 1: ")


def test_info_health_and_docs(url):
    info = requests.get(f"{url}/v1/info", timeout=30).json()
    assert info["model"] == "preset:tiny" and info["variant"] == "k3"
    assert info["dp_size"] == 2 and info["text_hidden_size"] == 80
    assert [r["rank"] for r in info["ranks"]] == [0, 1]
    assert all(r["state"] == "ready" and r["device"] == "cpu" for r in info["ranks"])
    assert requests.get(f"{url}/healthz", timeout=30).json() == {"status": "ok"}
    assert requests.get(f"{url}/docs", timeout=30).status_code == 200
    spec = requests.get(f"{url}/openapi.json", timeout=30).json()
    assert {"/v1/encode", "/v1/info", "/healthz"} <= set(spec["paths"])
    body = spec["paths"]["/v1/encode"]["post"]["requestBody"]["content"]
    assert {"application/json", "multipart/form-data"} <= set(body)
    assert {"EncodeRequest", "EncodeResponse", "ErrorResponse", "ImageItem"} <= set(
        spec["components"]["schemas"]
    )


def test_pixel_values_features_are_float32(url, images, reference):
    body = encode(url, [aggregated_item(reference, images[:1])]).json()
    item = body["items"][0]
    assert item["dtype"] == "float32"
    assert len(base64.b64decode(item["data"])) == 4 * np.prod(item["shape"])
