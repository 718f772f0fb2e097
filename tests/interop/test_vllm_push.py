"""Output kind ``vllm_push`` into vLLM 0.33.0's consumer, as vLLM builds it (.venv-vllm).

The connector is ours (``kimi_encoder.engines.vllm_connector``, importable in vLLM's
environment), but both of its sides are made by vLLM's ``ECConnectorFactory`` from a
``VllmConfig`` whose ``ec_transfer_config`` names it by ``ec_connector_module_path``, as
``vllm serve --ec-transfer-config`` does; then driven by the calls vLLM's scheduler and
model runner make: ``ensure_cache_available`` before scheduling, ``update_state_after_alloc``
and ``build_connector_meta``, the worker's ``start_worker_services`` and
``start_load_caches``.

Our running service pushes every image of ``tests/data`` (and a few seeded ones) from its
ranks straight to the worker's socket; its answer comes once the worker acknowledged
each, and the scheduler then reports them present before the request is scheduled. The
loaded features equal the service's ``/v1/encode`` features bit for bit (float32; bfloat16
equal to them rounded). Faults: a consumer that is down (503 within the ack timeout), a
destination outside ``handoff.receive_networks`` (400, nothing encoded), a request whose
images never come (vLLM's scheduler fails it after ``wait_timeout_s``, never encodes).
"""

from __future__ import annotations

import base64
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import torch
from images import image_bytes
from keyed import AUTH
from vllm.config import VllmConfig
from vllm.config.ec_transfer import ECTransferConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # kimi-encoder installed in vLLM's environment
DATA = ROOT / "tests" / "data" / "oracle-k3" / "images"
MODULE = "kimi_encoder.engines.vllm_connector"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Consumer:
    """A vLLM consumer engine's two connector sides, built by vLLM's factory."""

    def __init__(self, port: int, ec_buffer_size: int = 1 << 30, **extra):
        self.port = port
        self.config = VllmConfig(
            ec_transfer_config=ECTransferConfig(
                ec_connector="KimiEncoderConnector",
                ec_connector_module_path=MODULE,
                ec_role="ec_consumer",
                ec_ip="127.0.0.1",
                ec_port=port,
                ec_buffer_size=ec_buffer_size,
                ec_connector_extra_config=extra,
            )
        )
        self.worker = self._start_worker()
        self.scheduler = ECConnectorFactory.create_connector(self.config, ECConnectorRole.SCHEDULER)
        self.encoder_cache: dict[str, torch.Tensor] = {}  # the worker's

    def _start_worker(self):
        worker = ECConnectorFactory.create_connector(self.config, ECConnectorRole.WORKER)
        worker.start_worker_services()  # what vLLM's worker does once the model is loaded
        return worker

    def restart_worker(self) -> None:
        """The worker process dies and a new one takes its port (nothing staged)."""
        self.worker.shutdown()
        self.encoder_cache = {}
        self.worker = self._start_worker()

    @property
    def staging(self):
        return self.worker._receiver.staging

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()

    def ready(self, request: Request, within_s: float = 5.0) -> bool:
        """Poll ``ensure_cache_available`` as vLLM's scheduler loop does."""
        deadline = time.monotonic() + within_s
        while not self.scheduler.ensure_cache_available(request, 0):
            assert not self.scheduler.take_unavailable_requests(), "request failed"
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def load(self, request: Request) -> dict[str, torch.Tensor]:
        """Schedule the request's images and run the worker's load, as a step does."""
        for index, feature in enumerate(request.mm_features):
            assert self.scheduler.has_cache_item(feature.identifier)
            self.scheduler.update_state_after_alloc(request, index)
        self.step(SchedulerOutput.make_empty())
        return {f.identifier: self.encoder_cache[f.identifier] for f in request.mm_features}

    def step(self, output: SchedulerOutput) -> None:
        """A step: the scheduler's metadata, the worker's encoder cache freed of what
        the scheduler evicted (as the model runner does), then the worker's load."""
        metadata = self.scheduler.build_connector_meta(output)
        for mm_hash in output.free_encoder_mm_hashes:
            self.encoder_cache.pop(mm_hash, None)
        self.worker.bind_connector_metadata(metadata)
        self.worker.start_load_caches(self.encoder_cache)
        self.worker.clear_connector_metadata()

    def evict(self, request: Request) -> None:
        """vLLM's encoder cache drops the request's items (a preemption, an eviction)."""
        output = SchedulerOutput.make_empty()
        output.free_encoder_mm_hashes = [f.identifier for f in request.mm_features]
        self.step(output)


@pytest.fixture
def consumer():
    made = []

    def make(**extra) -> Consumer:
        made.append(Consumer(_free_port(), **extra))
        return made[-1]

    yield make
    for c in made:
        c.close()


def _request(request_id: str, uuids: list[str], tokens: list[int]) -> Request:
    features, offset = [], 1
    for uuid, count in zip(uuids, tokens, strict=True):
        position = PlaceholderRange(offset=offset, length=count)
        features.append(
            MultiModalFeatureSpec(
                data=None, modality="image", identifier=uuid, mm_position=position
            )
        )
        offset += count + 1
    return Request(
        request_id=request_id,
        prompt_token_ids=[0] * offset,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        mm_features=features,
    )


def _images() -> list[bytes]:
    files = [path.read_bytes() for path in sorted(DATA.iterdir())]
    return [*files, image_bytes("RGBA", (40, 40), 32), image_bytes("P", (100, 60), 33)]


def _reference(url: str, items: list[dict]) -> list[dict]:
    body = {"items": items, "feature_dtype": "float32"}
    answer = requests.post(f"{url}/v1/encode", json=body, headers=AUTH, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["items"]


@pytest.mark.parametrize(("app", "dtype"), [("f32", torch.float32), ("bf16", torch.bfloat16)])
def test_consumer_receives_what_our_ranks_pushed(service, consumer, app, dtype):
    vllm = consumer()
    url = service.urls[app]
    items = [{"type": "image", "image": base64.b64encode(b).decode()} for b in _images()]
    uuids = [f"{app}-push-chat-1-image-{i}" for i in range(len(items))]
    reference = _reference(url, items)
    tokens = [item["num_tokens"] for item in reference]
    request = _request(f"{app}-chat-1", uuids, tokens)
    assert not vllm.scheduler.ensure_cache_available(request, 0)  # nothing pushed yet

    output = {"kind": "vllm_push", "uuids": uuids, "to": [vllm.address]}
    pushed = requests.post(
        f"{url}/v1/encode", json={"items": items, "output": output}, headers=AUTH, timeout=60
    )
    assert pushed.status_code == 200, pushed.text
    entries = pushed.json()["items"]
    assert [e["num_tokens"] for e in entries] == tokens
    assert all(e["acked_by"] == [vllm.address] for e in entries)

    # Acknowledged means staged: the scheduler sees every image before it schedules.
    assert vllm.ready(request, within_s=1.0)
    cache = vllm.load(request)
    for uuid, item in zip(uuids, reference, strict=True):
        want = np.frombuffer(base64.b64decode(item["data"]), "<f4").reshape(item["shape"])
        assert cache[uuid].dtype == dtype
        assert torch.equal(cache[uuid], torch.from_numpy(want.copy()).to(dtype))


def test_one_image_under_two_uuids_is_encoded_once_pushed_twice(service, consumer):
    vllm = consumer()
    url = service.urls["f32"]
    image = base64.b64encode(image_bytes("RGB", (96, 64), 41)).decode()
    items = [{"type": "image", "image": image}] * 2
    uuids = ["twice-a", "twice-b"]
    output = {"kind": "vllm_push", "uuids": uuids, "to": [vllm.address]}
    pushed = requests.post(
        f"{url}/v1/encode", json={"items": items, "output": output}, headers=AUTH, timeout=60
    )
    assert pushed.status_code == 200, pushed.text
    assert pushed.json()["usage"]["images"] == 2
    tokens = [e["num_tokens"] for e in pushed.json()["items"]]
    request = _request("twice", uuids, tokens)
    assert vllm.ready(request)
    cache = vllm.load(request)
    assert torch.equal(cache["twice-a"], cache["twice-b"])


def test_a_consumer_that_is_down_is_a_503_within_the_ack_timeout(service):
    url = service.urls["bf16"]
    image = base64.b64encode(image_bytes("RGB", (64, 48), 42)).decode()
    output = {"kind": "vllm_push", "uuids": ["down-0"], "to": [f"127.0.0.1:{_free_port()}"]}
    started = time.monotonic()
    answer = requests.post(
        f"{url}/v1/encode",
        json={"items": [{"type": "image", "image": image}], "output": output},
        headers=AUTH,
        timeout=60,
    )
    took = time.monotonic() - started
    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"] == "1"
    message = answer.json()["error"]["message"]
    assert "item 0 (uuid 'down-0')" in message
    assert "nothing accepted the push" in message
    assert took < service.push_ack_timeout_s + 5


def test_a_destination_outside_the_networks_is_refused_before_encoding(service):
    url = service.urls["f32"]
    before = requests.get(f"{url}/v1/info", headers=AUTH, timeout=30).json()["ranks"]
    image = base64.b64encode(image_bytes("RGB", (64, 48), 43)).decode()
    output = {"kind": "vllm_push", "uuids": ["far-0"], "to": ["203.0.113.9:14579"]}
    answer = requests.post(
        f"{url}/v1/encode",
        json={"items": [{"type": "image", "image": image}], "output": output},
        headers=AUTH,
        timeout=60,
    )
    assert answer.status_code == 400, answer.text
    assert "handoff.receive_networks" in answer.json()["error"]["message"]
    after = requests.get(f"{url}/v1/info", headers=AUTH, timeout=30).json()["ranks"]
    assert [r["items"] for r in after] == [r["items"] for r in before]


def test_images_that_never_come_fail_the_request_never_encode(consumer):
    vllm = consumer(wait_timeout_s=0.3)
    request = _request("never", ["never-pushed"], [8])
    assert not vllm.scheduler.ensure_cache_available(request, 0)
    assert not vllm.scheduler.has_cache_item("never-pushed")  # vLLM would not encode it either
    time.sleep(0.4)
    assert not vllm.scheduler.ensure_cache_available(request, 0)
    assert vllm.scheduler.take_unavailable_requests() == {"never"}


def test_producer_roles_are_refused():
    config = VllmConfig(
        ec_transfer_config=ECTransferConfig(
            ec_connector="KimiEncoderConnector",
            ec_connector_module_path=MODULE,
            ec_role="ec_both",
            ec_port=_free_port(),
        )
    )
    with pytest.raises(ValueError, match="ec_role must be 'ec_consumer', got 'ec_both'"):
        ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)


def test_an_item_with_other_rows_than_the_prompt_fails_the_request(consumer):
    """A uuid reused for other content: the scheduler refuses it, nothing is loaded."""
    import asyncio

    from kimi_encoder.engines.ecpush import EcPusher

    vllm = consumer()

    async def push():
        pusher = EcPusher(timeout_s=5)
        try:
            features = np.ones((8, 16), np.float32)
            await pusher.push(f"tcp://{vllm.address}", "reused", features, "float32", "item 0")
        finally:
            pusher.close()

    asyncio.run(push())
    request = _request("reused-chat", ["reused"], [5])
    deadline = time.monotonic() + 5
    while vllm.scheduler.take_unavailable_requests() != {"reused-chat"}:
        assert not vllm.scheduler.ensure_cache_available(request, 0)
        assert time.monotonic() < deadline, "the request was not failed"
        time.sleep(0.01)


@pytest.mark.parametrize("key", ["wait_timeout_s", "staged_ttl_s"])
def test_a_bad_extra_config_is_named(key):
    config = VllmConfig(
        ec_transfer_config=ECTransferConfig(
            ec_connector="KimiEncoderConnector",
            ec_connector_module_path=MODULE,
            ec_role="ec_consumer",
            ec_port=_free_port(),
            ec_connector_extra_config={key: -1},
        )
    )
    with pytest.raises(ValueError, match=rf"ec_connector_extra_config\.{key} must be a positive"):
        ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)


def _push(address: str, names: list[str], rows: int = 2, hidden: int = 8) -> list:
    """Push each name (features: its index) with the ranks' producer (``EcPusher``); the
    answers, exceptions included."""
    import asyncio

    from kimi_encoder.engines.ecpush import EcPusher

    async def go():
        pusher = EcPusher(timeout_s=30)
        try:
            pushes = [
                pusher.push(
                    f"tcp://{address}",
                    name,
                    np.full((rows, hidden), i, np.float32),
                    "float32",
                    f"item {i} (uuid {name!r})",
                )
                for i, name in enumerate(names)
            ]
            return await asyncio.gather(*pushes, return_exceptions=True)
        finally:
            pusher.close()

    return asyncio.run(go())


def _wait(predicate, within_s: float = 10.0) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < within_s, "condition not met in time"
        time.sleep(0.005)
    return time.monotonic() - started


def test_a_backlog_beyond_the_event_memory_is_all_reported_and_loads(consumer):
    """1.5x MAX_EVENTS pushes while the scheduler side reads nothing (vLLM idle): every
    acknowledged item is reported available and loads."""
    from kimi_encoder.engines.ecreceive import MAX_EVENTS

    vllm = consumer()
    names = [f"backlog-{i}" for i in range(MAX_EVENTS * 3 // 2)]
    assert _push(vllm.address, names) == [2 * 8 * 4] * len(names)  # all acknowledged
    batch = 96
    for start in range(0, len(names), batch):
        uuids = names[start : start + batch]
        request = _request(f"backlog-chat-{start}", uuids, [2] * len(uuids))
        assert vllm.ready(request), f"items {start}.. not reported"
        cache = vllm.load(request)
        for i, uuid in enumerate(uuids, start):
            assert torch.equal(cache[uuid], torch.full((2, 8), float(i)))
        vllm.scheduler.request_finished(request)
    stats = vllm.scheduler.get_ec_connector_stats().data
    assert (stats["staged"], stats["loaded"], stats["lost"]) == (len(names), len(names), 0)


def test_a_preempted_and_a_later_request_load_the_same_features_again(service, consumer):
    """A request preempted after its features were loaded, and a second request naming
    the same image scheduled after the first finished and vLLM's encoder cache dropped
    it: both load the features again, bit-equal to /v1/encode, with no push between;
    once both finished nothing stays staged."""
    vllm = consumer()
    url = service.urls["f32"]
    image = base64.b64encode(image_bytes("RGB", (88, 72), 51)).decode()
    items = [{"type": "image", "image": image}]
    (reference,) = _reference(url, items)
    data = base64.b64decode(reference["data"])
    want = torch.from_numpy(np.frombuffer(data, "<f4").reshape(reference["shape"]).copy())
    output = {"kind": "vllm_push", "uuids": ["again-0"], "to": [vllm.address]}
    pushed = requests.post(
        f"{url}/v1/encode", json={"items": items, "output": output}, headers=AUTH, timeout=60
    )
    assert pushed.status_code == 200, pushed.text
    tokens = [reference["num_tokens"]]
    first, second = (
        _request("again-1", ["again-0"], tokens),
        _request("again-2", ["again-0"], tokens),
    )
    received = vllm.worker._receiver.received

    assert vllm.ready(first)
    assert torch.equal(vllm.load(first)["again-0"], want)
    assert vllm.ready(second)  # waiting behind the first: it names the image too
    vllm.evict(first)  # preempted: vLLM's encoder cache drops the features
    assert "again-0" not in vllm.encoder_cache
    assert vllm.ready(first)  # scheduled again
    assert torch.equal(vllm.load(first)["again-0"], want)
    vllm.scheduler.request_finished(first)
    vllm.evict(first)  # the entry no request uses is evicted from vLLM's encoder cache
    assert vllm.ready(second)
    assert torch.equal(vllm.load(second)["again-0"], want)
    assert vllm.worker._receiver.received == received  # nothing pushed in between
    assert vllm.staging.counts["loaded_again"] == 2
    vllm.scheduler.request_finished(second)
    _wait(lambda: vllm.staging.held_bytes == 0)  # every request finished: nothing staged
    stats = vllm.scheduler.get_ec_connector_stats().data
    assert (stats["loaded"], stats["loaded_again"]) == (1, 2)


def test_a_restarted_worker_fails_the_waiting_requests_at_once(consumer):
    vllm = consumer(wait_timeout_s=60)
    assert _push(vllm.address, ["before-0"]) == [64]
    waiting = _request("restart-chat", ["before-0", "before-1"], [2, 2])  # one still to come
    assert not vllm.ready(waiting, within_s=0.5)
    vllm.restart_worker()
    failed: set[str] = set()

    def failed_now() -> bool:
        assert not vllm.scheduler.ensure_cache_available(waiting, 0)
        failed.update(vllm.scheduler.take_unavailable_requests())
        return bool(failed)

    took = _wait(failed_now, within_s=10)
    assert failed == {"restart-chat"}
    assert took < 10  # not after wait_timeout_s (60 s)
    reason = vllm.scheduler.failures["restart-chat"]
    assert "'before-0' lost with the restart of worker tcp://127.0.0.1:" in reason
    vllm.scheduler.request_finished(waiting)
    assert _push(vllm.address, ["after-0"]) == [64]
    later = _request("restart-later", ["after-0"], [2])
    assert vllm.ready(later)
    assert torch.equal(vllm.load(later)["after-0"], torch.zeros(2, 8))
    assert vllm.scheduler.get_ec_connector_stats().data["lost"] == 1


def test_staging_at_its_limit_evicts_unreferenced_and_answers_busy(service, consumer):
    url = service.urls["f32"]
    images = [image_bytes("RGB", (64, 64), 60 + i) for i in range(4)]
    items = [{"type": "image", "image": base64.b64encode(b).decode()} for b in images]
    reference = _reference(url, items[:1])[0]
    nbytes = reference["num_tokens"] * reference["shape"][1] * 4
    vllm = consumer(ec_buffer_size=2 * nbytes, wait_timeout_s=0.5)  # room for two

    def push(i: int) -> requests.Response:
        output = {"kind": "vllm_push", "uuids": [f"limit-{i}"], "to": [vllm.address]}
        body = {"items": items[i : i + 1], "output": output}
        return requests.post(f"{url}/v1/encode", json=body, headers=AUTH, timeout=60)

    tokens = [reference["num_tokens"]]
    assert push(0).status_code == 200
    assert push(1).status_code == 200
    holder = _request("limit-chat-0", ["limit-0"], tokens)
    assert vllm.ready(holder)  # limit-0 named by an unfinished request
    assert push(2).status_code == 200  # limit-1, the oldest unreferenced, goes
    assert set(vllm.staging.snapshot()) == {"limit-0", "limit-2"}
    assert vllm.ready(_request("limit-chat-2", ["limit-2"], tokens))
    busy = push(3)  # both held: nothing may go
    assert busy.status_code == 503, busy.text
    assert busy.headers["Retry-After"] == "1"
    message = busy.json()["error"]["message"]
    assert f"{vllm.address} is full" in message
    assert f"{2 * nbytes} of them named by unfinished requests" in message
    assert set(vllm.staging.snapshot()) == {"limit-0", "limit-2"}
    late = _request("limit-chat-1", ["limit-1"], tokens)
    with pytest.raises(AssertionError, match="request failed"):
        vllm.ready(late, within_s=5)
    assert "evicted unclaimed" in vllm.scheduler.failures["limit-chat-1"]
    assert f"ec_buffer_size={2 * nbytes} bytes" in vllm.scheduler.failures["limit-chat-1"]
    stats = vllm.scheduler.get_ec_connector_stats().data
    assert stats["evicted"] == 1


def test_the_stats_reach_vllms_log_and_prometheus(consumer):
    from prometheus_client import REGISTRY
    from vllm.distributed.ec_transfer.ec_connector.metrics import (
        ECConnectorLogging,
        ECConnectorProm,
    )

    vllm = consumer()
    _push(vllm.address, ["stat-0"])
    request = _request("stat-chat", ["stat-0"], [2])
    assert vllm.ready(request)
    vllm.load(request)
    data = vllm.scheduler.get_ec_connector_stats().data  # what vLLM's scheduler collects
    logging = ECConnectorLogging(vllm.config.ec_transfer_config)
    logged = []
    logging.observe(data)
    logging.log(log_fn=lambda fmt, text: logged.append(text))
    assert "staged=1" in logged[0]
    assert "loaded=1" in logged[0]
    prom = ECConnectorProm(vllm.config, ["engine"], {0: ["0"]})
    prom.observe(data, 0)
    labels = {"engine": "0", "event": "loaded"}
    assert REGISTRY.get_sample_value("vllm:kimi_encoder_ec_items_total", labels) == 1
