"""The hand-off's Ray-free pieces: admission of the vllm_ec output, a part's frames from
gathered row slices, the checked ec_root. Over HTTP: tests/serve/test_handoff.py."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time

import numpy as np
import pytest
import torch
from fakes import VISION, FakeRank, features_of
from images import image_bytes
from serve_helpers import admission, read_frame0

from deployments.admission import Admission, OutputNotConfiguredError
from deployments.args import AppArgs
from deployments.dispatch import Dispatcher
from deployments.fanout import FanOut, Gathered
from deployments.handoff import Handoff, check_ec_root, pusher_rank
from deployments.metrics import RequestTrace
from deployments.ranks.calls import RankUnavailableError
from deployments.ranks.roster import Roster
from deployments.schemas import EncodeRequest as V1Request
from deployments.security import ApiKey
from deployments.sinks import PartPush, part_frames
from kimi_encoder.engines.sglang import EncodeRequest
from kimi_encoder.features import to_numpy
from kimi_encoder.items import EncoderInputError

IMAGES = [image_bytes("RGB", (64, 48), 1), image_bytes("RGBA", (40, 40), 2)]


def gate(**sections) -> Admission:
    """The admission of an app with ``sections`` of args."""
    return admission(AppArgs.model_validate(sections))


def ec_request(uuids, images=IMAGES, **fields) -> V1Request:
    items = [{"type": "image", "image": base64.b64encode(b).decode()} for b in images]
    output = {"kind": "vllm_ec", "uuids": uuids}
    return V1Request.model_validate({"items": items, "output": output, **fields})


def test_vllm_ec_output_is_admitted_in_the_model_dtype(tmp_path):
    ec = gate(
        handoff={"ec_root": str(tmp_path)}, model={"dtype": "bfloat16", "feature_dtype": "float32"}
    )
    admitted = ec.admit_json(ec_request(["a", "b"]))
    assert admitted.output.uuids == ["a", "b"]
    assert admitted.feature_dtype == "bfloat16"
    plain = ec.admit_json(V1Request.model_validate({"items": ec_request(["a"]).items}))
    assert plain.output is None
    assert plain.feature_dtype == "float32"


@pytest.mark.parametrize(
    ("uuids", "fields", "match"),
    [
        (["a"], {}, r"output.uuids has 1 entries for 2 images \(after splitting"),
        (["a", "../b"], {}, r"output.uuids\[1\]: uuid '../b' cannot name a cache directory"),
        (["a", "."], {}, r"output.uuids\[1\]: uuid '.' cannot name"),
        (["a", "a"], {}, r"output.uuids\[1\] 'a' repeats output.uuids\[0\]"),
        (["a", "b"], {"response_format": "safetensors"}, "answers JSON metadata"),
        (["a", "b"], {"feature_dtype": "float16"}, r"stores the model's dtype \(float32\)"),
    ],
    ids=["count", "separator", "dot", "repeat", "format", "dtype"],
)
def test_vllm_ec_output_errors(tmp_path, uuids, fields, match):
    with pytest.raises(EncoderInputError, match=match):
        gate(handoff={"ec_root": str(tmp_path)}).admit_json(ec_request(uuids, **fields))


def test_vllm_ec_output_needs_ec_root():
    with pytest.raises(
        OutputNotConfiguredError, match=r"set the app's args handoff\.ec_root to the vLLM consumer"
    ):
        gate().admit_json(ec_request(["a", "b"]))


def test_admitted_files_keep_the_digests_their_part_checked():
    """A part's content_hash was checked against SHA-256 of the bytes (load_images): the
    items keep that digest for their cache and dedupe keys instead of hashing again."""
    digest = hashlib.sha256(IMAGES[0]).digest()
    items = gate().admit_files(IMAGES, None, digests=[digest, None]).items
    assert items[0].image_sha256 == digest
    assert items[0].image_digest() == digest
    assert items[1].image_sha256 is None  # no hash sent: computed when first needed
    assert items[1].image_digest() == hashlib.sha256(IMAGES[1]).digest()
    with pytest.raises(ValueError, match="zip"):
        gate().admit_files(IMAGES, None, digests=[digest])


def part(items, dtype: str) -> PartPush:
    """A pushed part of ``items`` (admitted) to one loopback endpoint."""
    body = {
        "req_id": "r_local_part_0",
        "modality": "IMAGE",
        "mm_items": ["x"] * len(items),
        "num_parts": 1,
        "part_idx": 0,
    }
    return PartPush(
        req=EncodeRequest.from_json(body),
        dtype=dtype,
        grids=tuple(tuple(item.grid) for item in items),
        sizes=tuple(tuple(item.original_size) for item in items),
        endpoints=("tcp://127.0.0.1:1",),
        one_off=False,
        send_timeout_s=1.0,
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_part_frames_concatenate_the_row_slices_in_item_order(dtype):
    """Two ranks' arrays, the part's items interleaved over them: frame 1 (made on the
    pushing rank) is the rows in item order, in one new buffer (frame 0 is checked in
    test_engines_sglang.py)."""
    items = gate().admit_files(IMAGES + IMAGES[:1], None).items  # tokens 6, 4, 6
    rank0 = torch.randn(12, 80).to(getattr(torch, dtype))  # items 0 and 2
    rank1 = torch.randn(4, 80).to(getattr(torch, dtype))  # item 1
    arrays = [to_numpy(rank0), to_numpy(rank1)]
    for array in arrays:
        array.flags.writeable = False  # as they come out of the object store
    features = [arrays[0][:6], arrays[1], arrays[0][6:]]
    _, frame1 = part_frames(part(items, dtype), features)
    want = torch.cat([rank0[:6], rank1, rank0[6:]])
    got = torch.frombuffer(bytearray(frame1), dtype=want.dtype).reshape(want.shape)
    assert torch.equal(got, want)
    buffer = np.frombuffer(frame1, np.uint8)
    assert not any(np.shares_memory(buffer, array) for array in arrays)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_part_frames_of_one_image_send_the_ranks_array_itself(dtype):
    """A part of one image: frame 1 is the rank's read-only array from the object store,
    not a copy of it."""
    items = gate().admit_files(IMAGES[:1], None).items  # 6 tokens
    rows = torch.randn(6, 80).to(getattr(torch, dtype))
    array = to_numpy(rows)
    array.flags.writeable = False
    frame0, frame1 = part_frames(part(items, dtype), [array])
    assert np.shares_memory(np.frombuffer(frame1, np.uint8), array)
    got = torch.frombuffer(bytearray(frame1), dtype=rows.dtype).reshape(rows.shape)
    assert torch.equal(got, rows)
    meta = read_frame0(frame0)
    assert (meta.dtype, meta.shape, meta.grid_dim.tolist()) == (
        rows.dtype,
        [6, 80],
        [list(items[0].grid)],
    )


def test_ec_root_must_be_a_writable_directory(tmp_path):
    assert check_ec_root(str(tmp_path)) == tmp_path
    assert check_ec_root(None) is None
    with pytest.raises(ValueError, match="is not a writable directory on this ingress's node"):
        check_ec_root(str(tmp_path / "missing"))


@pytest.mark.parametrize(
    ("owners", "rows", "down", "pusher"),
    [
        ([0], [6], set(), 0),  # one image: its rank
        ([1, 0, 1], [6, 9, 4], set(), 1),  # most rows: 10 on rank 1
        ([0, 1], [5, 5], set(), 0),  # a tie: the lowest
        ([1, 0, 1], [6, 9, 4], {1}, 0),  # the largest is down: the next
        ([1, 1], [6, 4], {1}, 1),  # no owner up: the first (its call fails the part)
    ],
    ids=["one", "most-rows", "tie", "largest-down", "none-up"],
)
def test_the_rank_with_most_rows_pushes_a_part(owners, rows, down, pusher):
    features = [np.zeros((n, 8), np.float32) for n in rows]
    assert pusher_rank(Gathered(features, owners, "float32"), down) == pusher


def handoff_of(ranks):
    """A ``Handoff`` over fake ranks (tests/fakes.py), as ``EncodeServer`` wires it."""
    args = AppArgs()
    dispatch = args.dispatch.model_copy(update={"cost_model": "patches"})
    roster = Roster(ranks, dispatch.model_copy(update={"cooldown_s": 60.0}))
    fanout = FanOut(
        roster,
        Dispatcher(roster, dispatch, model_name="tiny", dtype="float32", cache_enabled=False),
        vision=VISION,
        timeout_s=30.0,
    )
    return Handoff(args.handoff, "float32", admission(args), fanout, None, ApiKey(None))


def tokenizer_part(req_id: str, images: list[bytes]) -> EncodeRequest:
    refs = ["data:image/png;base64," + base64.b64encode(b).decode() for b in images]
    body = {
        "req_id": req_id,
        "modality": "IMAGE",
        "mm_items": refs,
        "num_parts": 1,
        "part_idx": 0,
        "prefill_host": "127.0.0.1",
        "embedding_port": 5,
    }
    return EncodeRequest.from_json(body)


@pytest.mark.parametrize("fails", [0, 1, 2], ids=["pushed", "pushed-again", "failed"])
def test_a_part_is_pushed_by_one_rank_with_the_ranks_features(fails):
    """The part's images are encoded over both ranks, their features kept there; one rank
    is given every image's features in item order and the checked endpoint, and pushes.
    A push that fails for a rank marks it down (the push goes through the roster's book)
    and is tried once more from the start, on the rank still up; a second failure is the
    part's."""
    ranks = [FakeRank(0), FakeRank(1)]
    failures = iter(range(fails))

    async def flaky(rank, part, stored):
        if next(failures, None) is not None:
            raise RankUnavailableError(rank, "its replica died while pushing")

    for rank in ranks:
        rank.push_behaviour = flaky
    handoff = handoff_of(ranks)
    images = [image_bytes("RGB", (96, 64), 1), image_bytes("RGB", (64, 48), 2), *IMAGES]
    req = tokenizer_part("p_local_part_0", images)

    async def run():
        receivers = handoff._receivers(req, time.monotonic() + 30)
        try:
            await handoff._encode_and_push(req, RequestTrace(""), receivers)
        finally:
            receivers.close()

    if fails == 2:
        with pytest.raises(RankUnavailableError, match="died while pushing"):
            asyncio.run(run())
        return
    asyncio.run(run())
    roster = handoff.fanout.roster
    if fails:  # the failed pusher is down; the encode again went to the other rank alone
        (down,) = roster.down()
        assert sorted(len(rank.calls) for rank in ranks) == [1, 2]
        assert len(ranks[down].calls) == 1
    else:
        assert all(len(rank.calls) == 1 for rank in ranks)  # spread over both
    ((part, features),) = [push for rank in ranks for push in rank.pushes]
    items = admission(AppArgs()).admit_files(images, None).items
    assert part.endpoints == ("tcp://127.0.0.1:5",)
    assert part.one_off
    assert part.grids == tuple(tuple(item.grid) for item in items)
    assert part.sizes == tuple(tuple(item.original_size) for item in items)
    for got, item in zip(features, items, strict=True):
        np.testing.assert_array_equal(got, features_of(item))
