"""Output kind ``vllm_push`` without Ray (deployments/vllm_push.py): admission of the
request, the destinations' check, and the rank's pushes into a receiver over loopback."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from serve_helpers import admission, app_args

from deployments.schemas import EncodeRequest
from deployments.vllm_push import (
    EcPushDestination,
    PushLimits,
    check_push_output,
    destination,
    push_images,
)
from kimi_encoder.engines.ecpush import EcPushError
from kimi_encoder.engines.ecreceive import Receiver, Staging
from kimi_encoder.engines.transport import ReceiveAddressRefused, ReceivePolicy
from kimi_encoder.items import EncoderInputError

LIMITS = PushLimits(timeout_s=5, max_in_flight=8, max_per_destination=4)
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"


def request(uuids, to, **extra) -> EncodeRequest:
    items = [{"type": "image", "image": PNG}] * len(uuids)
    output = {"kind": "vllm_push", "uuids": uuids, "to": to}
    return EncodeRequest.model_validate({"items": items, "output": output, **extra})


def test_a_push_request_needs_no_ec_root():
    admitted = admission(app_args()).admit_json(request(["a", "b"], ["127.0.0.1:5000"]))
    assert admitted.output.kind == "vllm_push"
    assert admitted.feature_dtype == "float32"  # the model's dtype


@pytest.mark.parametrize(
    ("uuids", "to", "extra", "match"),
    [
        (["a"], ["10.0.0.1:1", "10.0.0.1:1"], {}, r"output\.to\[1\] '10\.0\.0\.1:1' repeats"),
        (["a", "a"], ["10.0.0.1:1"], {}, r"output\.uuids\[1\] 'a' repeats output\.uuids\[0\]"),
        (["a"], ["10.0.0.1:1"], {"feature_dtype": "float16"}, "stores the model's dtype"),
        (["a"], ["10.0.0.1:1"], {"response_format": "safetensors"}, "answers JSON metadata"),
    ],
    ids=["repeated-to", "repeated-uuid", "dtype", "format"],
)
def test_bad_push_requests_are_named(uuids, to, extra, match):
    with pytest.raises(EncoderInputError, match=match):
        admission(app_args()).admit_json(request(uuids, to, **extra))


def test_a_push_request_without_workers_is_refused():
    with pytest.raises(ValidationError, match=r"output\.vllm_push\.to"):
        request(["a"], [])
    check_push_output(request(["a"], ["h:1"]).output)  # one worker is enough


def test_destinations_outside_the_networks_are_refused_before_anything():
    policy = ReceivePolicy.from_cidrs(["10.0.0.0/8"], setting="handoff.receive_networks")
    output = request(["a"], ["10.1.1.1:14579", "127.0.0.1:14579"]).output
    with pytest.raises(ReceiveAddressRefused, match=r"'127\.0\.0\.1:14579'.*handoff\.receive_"):
        asyncio.run(destination(output, policy, LIMITS))
    output = request(["a"], ["[::ffff:10.1.1.1]:14579"]).output
    checked = asyncio.run(destination(output, policy, LIMITS))
    assert checked.endpoints == ("tcp://10.1.1.1:14579",)


@pytest.fixture
def rx():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    receiver = Receiver("127.0.0.1", port, Staging(1 << 22, 60))
    yield receiver
    receiver.close()


def test_each_image_goes_under_each_of_its_uuids_to_every_worker(rx):
    # Two images in one call; the first stands for request items 0 and 2 (a duplicate).
    to = EcPushDestination(["u0", "u1", "u2"], (rx.address,), LIMITS)
    sink = to.for_call([[0, 2], [1]])
    arrays = [np.arange(12, dtype=np.float32).reshape(3, 4), np.ones((2, 4), np.uint16)]

    async def run():
        pusher = LIMITS.pusher()
        try:
            return await push_images(pusher, sink, arrays, ["float32", "bfloat16"]), pusher
        finally:
            pusher.close()

    pushed, pusher = asyncio.run(run())
    assert [p.shape for p in pushed] == [(3, 4), (2, 4)]
    assert pusher.info()[rx.address]["acks"] == 3  # u0, u2 (one image, twice), u1
    assert torch.equal(rx.staging.get("u0"), rx.staging.get("u2"))
    assert rx.staging.get("u1").dtype == torch.bfloat16
    assert sink.only([1]).items == (((1, "u1"),),)


def test_a_failed_push_names_the_item():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there
    limits = PushLimits(timeout_s=0.3, max_in_flight=8, max_per_destination=4)
    sink = EcPushDestination(["chat-1"], (f"tcp://127.0.0.1:{port}",), limits).for_call([[0]])

    async def run():
        pusher = limits.pusher()
        try:
            await push_images(pusher, sink, [np.ones((1, 4), np.float32)], ["float32"])
        finally:
            pusher.close()

    with pytest.raises(EcPushError, match=r"item 0 \(uuid 'chat-1'\): nothing accepted the push"):
        asyncio.run(run())
