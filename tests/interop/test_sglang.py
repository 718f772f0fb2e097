"""sglang 0.5.23's own code reads what kimi_encoder sends (runs in .venv-sglang).

(a) Its allow-list unpickler turns our frame 0 into its real ``EmbeddingData``,
equal field for field to what its own encoder would send. (b) Its receivers,
built without a server as its CPU tests build them, take our pushed frames for
1 and 2 parts on both transports, and its Kimi-K3 processor turns them into
prompt and embeddings: one pad per feature row, framed with each image's
original size.
"""

from __future__ import annotations

import asyncio
import subprocess
from array import array

import pytest
import torch
import zmq
import zmq.asyncio
from sglang.srt.disaggregation.encoder.receiver import (
    EmbeddingData,
    MMReceiverHTTP,
    WaitingMMRequestStatus,
    WaitingZmqRequest,
)
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.schedule_batch import Modality
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.utils.common import safe_pickle_loads
from sglang.srt.utils.network import get_zmq_socket_on_host
from sglang_side import check_processor_output, kimi_processor, prompt_ids, row_offsets

DTYPES = ["float32", "bfloat16"]
PARTS = [1, 2]


@pytest.mark.parametrize("dtype", DTYPES)
def test_frames_load_as_sglangs_own(produce, dtype):
    spec, features = produce("frames", "--dtype", dtype, "--num-parts", "2")
    offsets = row_offsets(spec["tokens"])
    for k, part in enumerate(spec["parts"]):
        items = part["items"]
        rows = features[offsets[items[0]] : offsets[items[-1] + 1]]
        meta = safe_pickle_loads((produce.out / f"{k}.frame0").read_bytes())
        expected = EmbeddingData(
            part["req_id"],
            2,
            k,
            torch.tensor([spec["grids"][i] for i in items]),
            Modality.IMAGE,
            embedding=rows,
            original_image_sizes=[spec["sizes"][i] for i in items],
        ).copy_without_embedding()
        assert type(meta) is EmbeddingData
        assert meta.modality is Modality.IMAGE
        assert vars(meta).keys() == vars(expected).keys()
        for key, value in vars(expected).items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == meta.grid_dim.dtype
                assert torch.equal(getattr(meta, key), value)
            else:
                assert getattr(meta, key) == value, key
        frame1 = (produce.out / f"{k}.frame1").read_bytes()
        embedding = torch.frombuffer(bytearray(frame1), dtype=meta.dtype).reshape(meta.shape)
        assert torch.equal(embedding, rows)

        error = safe_pickle_loads((produce.out / f"{k}.error").read_bytes())
        message, code = spec["error"]
        expected_error = EmbeddingData(
            part["req_id"], 2, k, None, Modality.IMAGE, error_msg=message, error_code=code
        ).copy_without_embedding()
        assert type(error) is EmbeddingData
        assert vars(error) == vars(expected_error)


@pytest.mark.parametrize("parts", PARTS, ids=["1-part", "2-parts"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_tokenizer_receiver_assembles_parts(produce, parts, dtype):
    """zmq_to_tokenizer: one PULL port per request, every part pushed to it."""
    processor, rid = kimi_processor(), f"tok{parts}{dtype}"
    pad = processor.mm_tokens.image_token_id
    receiver = MMReceiverHTTP.__new__(MMReceiverHTTP)
    receiver.model_type = "kimi_k3"

    async def main():
        context = zmq.asyncio.Context()
        port, sock = get_zmq_socket_on_host(context, zmq.PULL, host="127.0.0.1")
        args = ("--dtype", dtype, "--num-parts", str(parts), "--rid", rid, "--port", str(port))
        producer = await asyncio.create_subprocess_exec(
            *produce.command("push", *args), env=produce.env(), stderr=subprocess.PIPE
        )
        try:
            output = await asyncio.wait_for(
                receiver._recv_mm_data(rid, sock, processor, prompt_ids(pad, 3)), 120
            )
        finally:
            _, stderr = await producer.communicate()
            context.destroy(linger=0)
        assert producer.returncode == 0, stderr.decode()
        return output

    output = asyncio.run(main())
    assert output is not None, "sglang's receiver refused the frames (see its log above)"
    spec, features = produce.read()
    check_processor_output(output, spec, features, pad)


@pytest.mark.parametrize("parts", PARTS, ids=["1-part", "2-parts"])
def test_scheduler_receiver_assembles_parts(produce, parts):
    """zmq_to_scheduler: the rank's shared PULL port, registered for every part."""
    processor, rid = kimi_processor(), f"sched{parts}"
    pad = processor.mm_tokens.image_token_id
    context = zmq.Context()
    port, sock = get_zmq_socket_on_host(context, zmq.PULL, host="127.0.0.1")
    receiver = MMReceiverHTTP.__new__(MMReceiverHTTP)
    receiver.scheduler_recv_socket = sock
    recv_req = TokenizedGenerateReqInput(
        rid=rid,
        input_text=None,
        input_ids=array("q", prompt_ids(pad, 3)),
        input_embeds=None,
        mm_inputs=None,
        token_type_ids=None,
        sampling_params=SamplingParams(),
        return_logprob=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
        token_ids_logprob=None,
        stream=False,
    )
    waiting = WaitingZmqRequest(
        rid=rid,
        recv_req=recv_req,
        mm_processor=processor,
        encoder_urls=[],
        model_type="kimi_k3",
        host_name="127.0.0.1",
        receive_count=1,
        zmq_context=context,
        embedding_port=port,
    )
    receiver.waiting_by_rid = {rid: waiting}
    args = ("--num-parts", str(parts), "--rid", rid, "--receive-url", f"127.0.0.1:{port}")
    producer = subprocess.Popen(
        produce.command("push", *args), env=produce.env(), stderr=subprocess.PIPE, text=True
    )
    try:
        while waiting.status == WaitingMMRequestStatus.PENDING and producer.poll() is None:
            if sock.poll(1000):
                receiver._drain_scheduler_embeddings()
        while waiting.status == WaitingMMRequestStatus.PENDING and sock.poll(5000):
            receiver._drain_scheduler_embeddings()  # the producer has left; drain what it sent
    finally:
        _, stderr = producer.communicate(timeout=120)
        context.destroy(linger=0)
    assert producer.returncode == 0, stderr
    assert waiting.status == WaitingMMRequestStatus.SUCCESS, waiting.error_msg
    spec, features = produce.read()
    check_processor_output(recv_req.mm_inputs, spec, features, pad)
    assert list(recv_req.input_ids) == list(recv_req.mm_inputs.input_ids)
