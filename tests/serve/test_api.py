"""The HTTP API on a shared 2-rank app: formats, splitting, multipart, info, docs.

Bad inputs are in test_bad_inputs.py."""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import psutil
import pytest
import requests
import torch
from safetensors.numpy import load as load_safetensors
from safetensors.torch import load as load_torch
from serve_helpers import b64, decode_features, encode, one_thread

from deployments.ranks.calls import EncodeCall


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


def test_the_port_is_served_by_the_ingress_the_environment_asks_for(url):
    """`make test` runs this suite twice: behind Serve's Python proxy, and behind HAProxy
    with RAY_SERVE_ENABLE_HA_PROXY=1 (read when Serve starts). The process listening on
    the port says which one answered."""
    port = urlsplit(url).port
    listening = {
        conn.pid
        for conn in psutil.net_connections("tcp")
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid
    }
    commands = {" ".join(psutil.Process(pid).cmdline()) for pid in listening}
    assert len(commands) == 1, commands
    (command,) = commands
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        assert "haproxy" in command.split()[0], command
    else:
        assert command.startswith("ray::ProxyActor"), command


def test_every_replica_process_runs_with_the_args_glibc_tunables(url):
    """The app's replica processes (ingress, hand-off registry, both ranks) were started
    with ``glibc_tunables`` (default: malloc keeps large blocks in its heaps) in their
    environment, which glibc reads when a process starts.

    Read from the process's initial environment block (``/proc/PID/environ``), where
    glibc up to 2.37 splits the variable in place while parsing it (each ':' becomes a
    NUL), so every tunable is still there, one per NUL-separated piece."""
    from deployments.args import AppArgs

    want = AppArgs().glibc_tunables
    assert ":" in want  # the default has several tunables: the split form is exercised
    forms = [f"GLIBC_TUNABLES={v}".encode() for v in (want, want.replace(":", "\0"))]
    app = url.rsplit("/", 1)[1]
    found = {}
    for proc in psutil.process_iter(["cmdline"]):
        command = " ".join(proc.info["cmdline"] or [])
        prefix = f"ray::ServeReplica:{app}:"
        if command.startswith(prefix):
            name = command.removeprefix(prefix).split()[0].split(".")[0]
            block = b"\0" + Path(f"/proc/{proc.pid}/environ").read_bytes()
            found[name] = any(b"\0" + form + b"\0" in block + b"\0" for form in forms)
    assert found == dict.fromkeys(
        ["EncodeServer", "HandoffRegistry", "EncoderRank_0", "EncoderRank_1"], True
    )


def test_a_rank_answers_each_image_as_an_array_read_in_place(url, images, reference):
    """A rank call carries each image's features as the array it left the device in; the
    caller reads every one in place from the object store, none copied on arrival."""
    from ray import serve

    app = url.rsplit("/", 1)[1]
    rank = serve.get_deployment_handle("EncoderRank_0", app_name=app)
    planned = [reference.plan(b) for b in images[:3]]
    call = EncodeCall(indices=[0, 1, 2], items=planned, feature_dtype="float32")
    answer = rank.encode.remote(call).result(timeout_s=120)
    features = answer.features
    assert isinstance(features, list)
    assert len(features) == 3
    with one_thread():
        want = reference.encode(planned)
    for array, ref in zip(features, want, strict=True):
        assert not array.flags.writeable, "a copy made on arrival would be writable"
        assert not array.flags.owndata
        np.testing.assert_allclose(array, ref.numpy(), rtol=0, atol=1e-5)  # as test_parity


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_feature_dtype_and_format_is_the_float32_features_rounded(
    deploy, images, reference, dtype
):
    """JSON, safetensors and multipart answers in each wire dtype equal the float32
    features of the in-process encoder rounded to it, read with numpy (bfloat16 words
    widened) and with the safetensors library's torch reader.

    One rank, so it encodes the three images in one batch in their order, as the
    reference does: bit for bit on any CPU. (With two ranks each encodes its share; on
    CPUs whose matrix kernels depend on a batch's row count, AVX-512 MKL among them, the
    features then differ from the reference's in the last bits, test_parity.py.)"""
    url = deploy(1)
    data = images[:3]
    with one_thread():
        want = [
            f.to(getattr(torch, dtype)) for f in reference.encode([reference.plan(b) for b in data])
        ]
    as_json = encode(url, image_items(data), feature_dtype=dtype).json()
    body = encode(url, image_items(data), feature_dtype=dtype, response_format="safetensors")
    files = [("image", (f"{i}.png", b)) for i, b in enumerate(data)]
    form = {"feature_dtype": dtype, "response_format": "safetensors"}
    multipart = requests.post(f"{url}/v1/encode", files=files, data=form, timeout=60)
    assert body.status_code == multipart.status_code == 200, multipart.text
    for i, expected in enumerate(want):
        item = as_json["items"][i]
        assert item["dtype"] == dtype
        assert np.array_equal(decode_features(item), expected.float().numpy())
        for blob in (body.content, multipart.content):
            assert torch.equal(load_torch(blob)[f"features.{i}"], expected)


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
        assert got["grid_thw"] == want["grid_thw"]
        assert got["owner_rank"] == want["owner_rank"]
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


def test_info_health_and_docs(url):
    info = requests.get(f"{url}/v1/info", timeout=30).json()
    assert info["model"] == "preset:tiny"
    assert info["variant"] == "k3"
    assert info["dp_size"] == 2
    assert info["text_hidden_size"] == 80
    assert [r["rank"] for r in info["ranks"]] == [0, 1]
    assert all(r["state"] == "live" and r["device"] == "cpu" for r in info["ranks"])
    # model.execution 'auto' on CPU: eager (kimi_encoder.execution.CPU_RULE)
    assert all(r["execution"]["mode"] == "eager" for r in info["ranks"])
    assert all(r["execution"]["requested"] == "auto" for r in info["ranks"])
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
