"""vLLM 0.33.0's own encoder-cache connector loads what kimi_encoder writes (.venv-vllm).

A consumer's ``ECExampleConnector`` in both roles: the scheduler's finds each
image's entry by its identifier (the client's uuid) and plans the load, the
worker's loads it into the encoder cache, equal to the features we wrote: with
the library (``produce.py ec``), and through our running service (``/v1/encode``
with output kind ``vllm_ec``), compared with its ``/v1/encode`` features of the
same images (float32 bit for bit, bfloat16 equal to the float32 rounded).
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import requests
import torch
from images import image_bytes
from keyed import AUTH
from vllm.config import VllmConfig
from vllm.config.ec_transfer import ECTransferConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request


def _connectors(root) -> tuple[ECExampleConnector, ECExampleConnector]:
    config = VllmConfig(
        ec_transfer_config=ECTransferConfig(
            ec_connector="ECExampleConnector",
            ec_role="ec_consumer",
            ec_connector_extra_config={"shared_storage_path": str(root)},
        )
    )
    return (
        ECExampleConnector(config, ECConnectorRole.SCHEDULER),
        ECExampleConnector(config, ECConnectorRole.WORKER),
    )


def _request(uuids: list[str], tokens: list[int]) -> Request:
    """A request whose prompt holds each image's pad run, identified by its uuid."""
    features, offset = [], 1
    for uuid, count in zip(uuids, tokens, strict=True):
        features.append(
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=uuid,
                mm_position=PlaceholderRange(offset=offset, length=count),
            )
        )
        offset += count + 1
    return Request(
        request_id="interop",
        prompt_token_ids=[0] * offset,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        mm_features=features,
    )


def _load(root, uuids: list[str], tokens: list[int]) -> dict[str, torch.Tensor]:
    """What a consumer's scheduler plans and its worker loads for a request with these
    images: the encoder cache by identifier."""
    scheduler, worker = _connectors(root)
    assert scheduler.is_consumer
    assert not scheduler.is_producer
    assert all(scheduler.has_cache_item(u) for u in uuids)
    assert not scheduler.has_cache_item("never-written")
    request = _request(uuids, tokens)
    for index in range(len(uuids)):
        scheduler.update_state_after_alloc(request, index)
    metadata = scheduler.build_connector_meta(SchedulerOutput.make_empty())
    assert [(m.mm_hash, m.num_token) for m in metadata.mm_datas] == list(
        zip(uuids, tokens, strict=True)
    )
    encoder_cache: dict[str, torch.Tensor] = {}
    worker.bind_connector_metadata(metadata)
    worker.start_load_caches(encoder_cache)
    worker.clear_connector_metadata()
    return encoder_cache


@pytest.mark.parametrize(("app", "dtype"), [("f32", torch.float32), ("bf16", torch.bfloat16)])
def test_consumer_loads_what_our_service_wrote(service, app, dtype):
    url = service.urls[app]
    images = [
        image_bytes("RGB", (700, 520), 31),  # resized to the tiny preset's patch budget
        image_bytes("RGBA", (40, 40), 32),
        image_bytes("P", (100, 60), 33),
    ]
    items = [{"type": "image", "image": base64.b64encode(b).decode()} for b in images]
    uuids = [f"{app}-chat-7-image-{i}" for i in range(len(images))]
    body = {"items": items, "output": {"kind": "vllm_ec", "uuids": uuids}}
    written = requests.post(f"{url}/v1/encode", json=body, headers=AUTH, timeout=120)
    assert written.status_code == 200, written.text
    body = {"items": items, "feature_dtype": "float32"}
    reference = requests.post(f"{url}/v1/encode", json=body, headers=AUTH, timeout=120).json()[
        "items"
    ]
    tokens = [item["num_tokens"] for item in reference]
    assert [entry["num_tokens"] for entry in written.json()["items"]] == tokens

    cache = _load(service.ec_roots[app], uuids, tokens)
    for uuid, item in zip(uuids, reference, strict=True):
        want = np.frombuffer(base64.b64decode(item["data"]), "<f4").reshape(item["shape"])
        loaded = cache[uuid]
        assert loaded.dtype == dtype  # the model's dtype, kept as written
        assert torch.equal(loaded, torch.from_numpy(want.copy()).to(dtype))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_consumer_loads_our_entries(produce, tmp_path, dtype):
    root = tmp_path / "ec"
    root.mkdir()
    spec, features = produce("ec", str(root), "--dtype", dtype)
    uuids, tokens = spec["uuids"], spec["tokens"]
    encoder_cache = _load(root, uuids, tokens)
    offset = 0
    for uuid, count in zip(uuids, tokens, strict=True):
        loaded = encoder_cache[uuid]
        assert loaded.dtype == features.dtype
        assert loaded.shape == (count, features.shape[1])
        assert torch.equal(loaded, features[offset : offset + count])
        offset += count
