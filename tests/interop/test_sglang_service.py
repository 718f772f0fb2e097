"""sglang 0.5.23's own prefill code against our running service (runs in .venv-sglang).

Its receivers are built without a server, as its CPU tests build them, and do
everything else themselves: post ``/encode`` (and ``/scheduler_receive_url``) to
our encoder URL, receive the pushed frames, and hand them to its real Kimi-K3
processor, whose prompt must hold one pad per feature row, framed with each
image's original size. Embeddings are compared with our ``/v1/encode`` features
of the same images: float32 bit for bit, bfloat16 equal to the float32 rounded,
and within 1e-5 where concurrent parts may share the ranks' batches.

Faults: a video item, an undecodable image and a rank killed while a part is in
flight; the receiver gets an error frame (or the failed ``/encode`` answer), or
the part completes by re-dispatch, and never waits past our request timeout.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures as cf
import functools
import hashlib
import logging
import os
import signal
import time
from array import array
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
import requests
import torch
import zmq
import zmq.asyncio
from images import image_bytes
from keyed import AUTH
from sglang.srt.disaggregation.encoder.receiver import (
    MMReceiverHTTP,
    WaitingMMRequestStatus,
    WaitingZmqRequest,
    _ReceiveRegistrationRunner,
)
from sglang.srt.managers.io_struct import GenerateReqInput, TokenizedGenerateReqInput
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.utils.common import safe_pickle_loads
from sglang.srt.utils.network import get_zmq_socket_on_host
from sglang_side import check_processor_output, kimi_processor, prompt_ids, row_offsets

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
# The receiver's own timeout is 3x our request timeout: a None answer logged as a timeout
# means we hung past ours.
TIMED_OUT = "Embedding recv timeout"
# Requests of 1 to 5 images, (mode, (width, height), seed) each: mixed sizes and modes,
# one resized to the tiny preset's patch budget, RGBA, palette, grey.
REQUESTS = [
    [("RGB", (64, 48), 1)],
    [("RGBA", (40, 40), 2), ("P", (100, 60), 3)],
    [("RGB", (700, 520), 4), ("L", (150, 110), 5), ("RGB", (90, 45), 6)],
    [("P", (56, 56), 7), ("RGB", (128, 96), 8), ("RGBA", (30, 70), 9), ("RGB", (64, 64), 10)],
    [
        ("RGB", (300, 20), 11),
        ("LA", (48, 80), 12),
        ("RGB", (700, 520), 13),
        ("P", (100, 60), 14),
        ("RGBA", (96, 64), 15),
    ],
]


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def v1_encode(url: str, images: list[bytes]) -> tuple[torch.Tensor, dict]:
    """Our /v1/encode float32 features of ``images`` (rows concatenated), with their
    original sizes and token counts."""
    items = [{"type": "image", "image": base64.b64encode(b).decode()} for b in images]
    body = {"items": items, "feature_dtype": "float32"}
    response = requests.post(f"{url}/v1/encode", json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    items = response.json()["items"]
    rows = [np.frombuffer(base64.b64decode(i["data"]), "<f4").reshape(i["shape"]) for i in items]
    spec = {
        "sizes": [item["original_size"] for item in items],
        "tokens": [item["num_tokens"] for item in items],
    }
    return torch.from_numpy(np.concatenate(rows)), spec


def generate_request(rid: str, images: list[bytes], **fields) -> GenerateReqInput:
    return GenerateReqInput(rid=rid, text="", image_data=[data_url(b) for b in images], **fields)


def tokenizer_receiver(service, urls: list[str]) -> MMReceiverHTTP:
    """sglang's tokenizer-side receiver (zmq_to_tokenizer: a PULL port per request)."""
    receiver = MMReceiverHTTP.__new__(MMReceiverHTTP)
    receiver.context = zmq.asyncio.Context()
    receiver.encode_urls = urls
    receiver.recv_timeout = 3 * service.request_timeout_s
    receiver.host = "127.0.0.1"
    receiver.model_type = "kimi_k3"
    return receiver


def receive(service, urls: list[str], request: GenerateReqInput, count: int):
    """``recv_mm_data`` of a request with ``count`` images: what the processor made of
    the parts, or None when sglang gave up on them."""
    processor = kimi_processor()
    receiver = tokenizer_receiver(service, urls)
    prompt = prompt_ids(processor.mm_tokens.image_token_id, count)
    try:
        return asyncio.run(receiver.recv_mm_data(request, processor, prompt))
    finally:
        receiver.context.destroy(linger=0)


@pytest.fixture
def sglang_log(caplog):
    caplog.set_level(logging.INFO, logger="sglang")
    return caplog


@pytest.mark.parametrize("app", list(DTYPES))
def test_tokenizer_receiver_takes_our_parts(service, sglang_log, app):
    url = service.urls[app]
    pad = kimi_processor().mm_tokens.image_token_id
    for n, specs in enumerate(REQUESTS):
        images = [image_bytes(mode, size, seed) for mode, size, seed in specs]
        features, spec = v1_encode(url, images)
        # One request carries each image's content hash, which our encoder checks.
        hashes = ["sha256:" + hashlib.sha256(b).hexdigest() for b in images] if n == 3 else None
        request = generate_request(f"tok-{app}-{n}", images, mm_content_hashes=hashes)
        output = receive(service, [url], request, len(images))
        assert output is not None, sglang_log.text
        check_processor_output(output, spec, features.to(DTYPES[app]), pad)


def test_two_encoder_urls_are_assembled_in_order(service, sglang_log):
    """Both URLs are ours (two spellings of one service): sglang splits the five images
    into two parts, one per URL, and joins them in part order."""
    url = service.urls["f32"]
    other = url.replace("127.0.0.1", "localhost")
    images = [image_bytes(mode, size, seed) for mode, size, seed in REQUESTS[4]]
    features, spec = v1_encode(url, images)
    output = receive(service, [url, other], generate_request("two-urls", images), len(images))
    assert output is not None, sglang_log.text
    pad = kimi_processor().mm_tokens.image_token_id
    check_processor_output(output, spec, features, pad, exact=False)


def parts_pending(url: str) -> int:
    info = requests.get(f"{url}/v1/info", headers=AUTH, timeout=30).json()
    return info["handoff"]["registry"]["parts_pending"]


def scheduler_rank(
    rid: str, url: str, prompt: list[int], assigned, processor, runner
) -> tuple[MMReceiverHTTP, WaitingZmqRequest, zmq.Context]:
    """One TP rank: its shared PULL socket and the request waiting on it."""
    context = zmq.Context()
    port, sock = get_zmq_socket_on_host(context, zmq.PULL, host="127.0.0.1")
    receiver = MMReceiverHTTP.__new__(MMReceiverHTTP)
    receiver.scheduler_recv_socket = sock
    recv_req = TokenizedGenerateReqInput(
        rid=rid,
        input_text=None,
        input_ids=array("q", prompt),
        input_embeds=None,
        mm_inputs=None,
        token_type_ids=None,
        sampling_params=SamplingParams(),
        return_logprob=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
        token_ids_logprob=None,
        stream=False,
        num_items_assigned=assigned,
    )
    waiting = WaitingZmqRequest(
        rid=rid,
        recv_req=recv_req,
        mm_processor=processor,
        encoder_urls=[url],
        model_type="kimi_k3",
        host_name="127.0.0.1",
        receive_count=2,
        zmq_context=context,
        embedding_port=port,
        registration_runner=runner,
    )
    receiver.waiting_by_rid = {rid: waiting}
    return receiver, waiting, context


def register_two(ranks: list, new_rank: Callable[[], tuple]) -> None:
    """Adds two scheduler ranks to ``ranks``; each posts /scheduler_receive_url. Returns once
    both are registered."""
    for _ in range(2):
        ranks.append(new_rank())
    for _, waiting, _ in ranks:
        waiting.send_encode_request()  # posts /scheduler_receive_url
    for _, waiting, _ in ranks:
        waiting.registration_future.result(timeout=60)


def wait_part_asks_for_addresses(url: str, pending: int) -> None:
    deadline = time.monotonic() + 60
    while parts_pending(url) == pending:  # until the part waits for its addresses
        assert time.monotonic() < deadline, "the part never asked for its addresses"
        time.sleep(0.05)


def drain(ranks: list, timeout_s: float, sglang_log) -> None:
    """Each rank takes what reaches its socket until no request is pending."""
    deadline = time.monotonic() + timeout_s
    while any(w.status == WaitingMMRequestStatus.PENDING for _, w, _ in ranks):
        assert time.monotonic() < deadline, sglang_log.text
        for receiver, waiting, _ in ranks:
            if receiver.scheduler_recv_socket.poll(100):
                receiver._drain_scheduler_embeddings()
            waiting._try_recv_mm_data()


@pytest.mark.parametrize("order", ["registered-first", "encode-first"])
def test_two_scheduler_ranks_get_identical_parts(service, sglang_log, order):
    """zmq_to_scheduler with receive_count 2: the tokenizer dispatches /encode without a
    port; each of two scheduler ranks registers its shared PULL port, before or after
    the part reached us, and assembles the request from what we push to it."""
    url = service.urls["f32"]
    images = [image_bytes(mode, size, seed) for mode, size, seed in REQUESTS[2]]
    features, spec = v1_encode(url, images)
    rid = f"sched-{order}"
    obj = generate_request(rid, images)
    tokenizer = tokenizer_receiver(service, [url])
    assigned = tokenizer._assign_items_by_modality(tokenizer._extract_url_data(obj), 1)
    processor = kimi_processor()
    pad = processor.mm_tokens.image_token_id
    runner = _ReceiveRegistrationRunner("interop-registration")
    prompt = prompt_ids(pad, len(images))
    new_rank = functools.partial(scheduler_rank, rid, url, prompt, assigned, processor, runner)
    ranks, dispatch_errors = [], []
    try:
        if order == "registered-first":
            register_two(ranks, new_rank)
            tokenizer._send_encode_request(obj, on_dispatch_error=dispatch_errors.append).set()
        else:
            pending = parts_pending(url)
            tokenizer._send_encode_request(obj, on_dispatch_error=dispatch_errors.append).set()
            wait_part_asks_for_addresses(url, pending)
            register_two(ranks, new_rank)
        drain(ranks, 3 * service.request_timeout_s, sglang_log)
    finally:
        for _, _, context in ranks:
            context.destroy(linger=0)
        runner.loop.call_soon_threadsafe(runner.loop.stop)
    assert dispatch_errors == []
    outputs = []
    for _, waiting, _ in ranks:
        assert waiting.status == WaitingMMRequestStatus.SUCCESS, waiting.error_msg
        outputs.append(waiting.recv_req.mm_inputs)
        check_processor_output(waiting.recv_req.mm_inputs, spec, features, pad)
    first, second = outputs
    assert list(first.input_ids) == list(second.input_ids)
    for a, b in zip(first.mm_items, second.mm_items, strict=True):
        assert torch.equal(a.precomputed_embeddings, b.precomputed_embeddings)


def test_fifty_concurrent_parts_are_each_delivered_once(service):
    """Eight threads, each with its own event loop and PULL port, dispatch 50 parts of 1
    to 3 images through sglang's own dispatch code; each part arrives exactly once."""
    url, timeout_s = service.urls["f32"], service.request_timeout_s
    pool = [image_bytes(mode, size, seed) for mode, size, seed in REQUESTS[3] + REQUESTS[4]]
    features, spec = v1_encode(url, pool)
    bounds = row_offsets(spec["tokens"])
    parts = [[(k + j) % len(pool) for j in range(1 + k % 3)] for k in range(50)]

    async def dispatch(thread: int) -> tuple[Counter, dict]:
        context = zmq.asyncio.Context()
        port, sock = get_zmq_socket_on_host(context, zmq.PULL, host="127.0.0.1")
        receiver = tokenizer_receiver(service, [url])
        mine = range(thread, len(parts), 8)
        try:
            bodies = [generate_request("", [pool[i] for i in parts[k]]) for k in mine]
            errors = await asyncio.gather(
                *(
                    receiver.encode(
                        f"burst{k}",
                        receiver._extract_url_data(request),
                        port,
                        "encode",
                        encode_urls=[url],
                    )
                    for k, request in zip(mine, bodies, strict=True)
                )
            )
            assert errors == [None] * len(mine), errors
            counts, received = Counter(), {}
            while sum(counts.values()) < len(mine):
                frames = await asyncio.wait_for(sock.recv_multipart(), 3 * timeout_s)
                meta = safe_pickle_loads(frames[0])
                counts[meta.req_id] += 1
                embedding = torch.frombuffer(bytearray(frames[1]), dtype=meta.dtype)
                received[meta.req_id] = (meta, embedding.reshape(meta.shape))
            # Every /encode was answered after its push: a duplicate would be on its way.
            assert await sock.poll(1000) == 0, "a part arrived twice"
            return counts, received
        finally:
            context.destroy(linger=0)
            receiver.context.destroy(linger=0)

    with cf.ThreadPoolExecutor(8) as threads:
        results = list(threads.map(lambda t: asyncio.run(dispatch(t)), range(8)))
    counts = sum((c for c, _ in results), Counter())
    assert counts == Counter({f"burst{k}_local_part_0": 1 for k in range(len(parts))})
    for _, received in results:
        for req_id, (meta, embedding) in received.items():
            indices = parts[int(req_id.removeprefix("burst").split("_")[0])]
            want = torch.cat([features[bounds[i] : bounds[i + 1]] for i in indices])
            assert meta.original_image_sizes == [spec["sizes"][i] for i in indices]
            torch.testing.assert_close(embedding, want, rtol=0, atol=1e-5)


TRUNCATED = image_bytes("RGB", (64, 48), 20)[:300]  # a valid header, pixels cut off


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"video_data": [data_url(image_bytes("RGB", (64, 48), 21))]}, "image input only"),
        (
            {"image_data": [data_url(image_bytes("RGB", (64, 48), 22)), data_url(TRUNCATED)]},
            "cannot decode the image",
        ),
    ],
    ids=["video", "truncated"],
)
def test_failed_part_fails_the_request_without_waiting(service, sglang_log, fields, message):
    """The image part goes through; the failing part comes back as an error frame (and a
    non-200 /encode): the receiver gives up at once with our message, never by timing out."""
    url = service.urls["f32"]
    request = GenerateReqInput(
        rid="", text="", **{"image_data": [data_url(image_bytes("RGB", (40, 40), 23))]} | fields
    )
    output = receive(service, [url], request, len(request.image_data))
    assert output is None
    assert message in sglang_log.text, sglang_log.text
    assert TIMED_OUT not in sglang_log.text, sglang_log.text


def info(url: str) -> dict:
    return requests.get(f"{url}/v1/info", headers=AUTH, timeout=30).json()


def test_rank_killed_while_a_part_is_in_flight(service, sglang_log):
    """kill -9 of a rank's process while it holds images of a part: the part completes on
    the other rank (re-dispatch) or fails with an error, never past our request timeout.
    Last in this module: it waits until Serve has replaced the rank."""
    url = service.urls["f32"]
    images = [image_bytes("RGB", (700, 520), 500 + i) for i in range(20)]  # resized, ~1k patches
    features, spec = v1_encode(url, images)
    pids = {rank["rank"]: rank["pid"] for rank in info(url)["ranks"]}
    killed = None
    with cf.ThreadPoolExecutor(1) as pool:
        for attempt in range(5):
            sglang_log.clear()
            request = generate_request(f"killed-{attempt}", images)
            answer = pool.submit(receive, service, [url], request, len(images))
            while killed is None and not answer.done():
                ranks = info(url)["ranks"]
                busy = [r["rank"] for r in ranks if r.get("outstanding", {}).get("images")]
                if busy:
                    killed = busy[-1]
                    os.kill(pids[killed], signal.SIGKILL)
            output = answer.result(timeout=4 * service.request_timeout_s)
            if killed is not None:
                break
        assert killed is not None, "no part was ever caught in flight"
    assert TIMED_OUT not in sglang_log.text, sglang_log.text
    if output is None:  # failed as a whole: with an error frame or a failed /encode
        assert "Encoder error" in sglang_log.text or "dispatch failed" in sglang_log.text
    else:  # re-dispatched: rows of the other rank, encoded in other batches
        pad = kimi_processor().mm_tokens.image_token_id
        check_processor_output(output, spec, features, pad, exact=False)
    deadline = time.monotonic() + 180
    while True:
        ranks = info(url)["ranks"]
        if all(r["state"] == "live" for r in ranks) and ranks[killed].get("pid") != pids[killed]:
            break
        assert time.monotonic() < deadline, f"rank {killed} was not replaced: {ranks}"
        time.sleep(1)
